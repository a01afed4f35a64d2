"""`LLM`: the offline API, shaped like vLLM's."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

from tqdm import tqdm

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine, Prompt
from baton.outputs import RequestOutput
from baton.sampling_params import SamplingParams
from baton.tokenizer import apply_chat_template


class LLM:
    """`LLM(model="smollm2-135m", dtype="float32", block_size=16, ...)`: any setting of the config tree.

    A context manager: leaving it (or `shutdown()`, or the object being collected) stops the
    engine's other ranks and frees their port."""

    def __init__(self, model: str = "smollm2-135m", progress: bool = True, **settings) -> None:
        config = EngineConfig.from_kwargs(model=model, **settings)
        logging.basicConfig(level=config.env.log_level, format="%(levelname)s %(name)s: %(message)s")
        self.engine = LLMEngine(config, progress=progress)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (also done at exit)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def prompt_logits(self, prompt: Prompt):
        """The model's float32 logits at every prompt position (parity checks, scoring)."""
        return self.engine.prompt_logits(prompt)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": apply_chat_template(self.engine.tokenizer, c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]
