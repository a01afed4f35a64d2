"""The completions and chat endpoints' work: validate against the model, run, shape the answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from baton.config import ServerConfig
from baton.engine.async_engine import AsyncEngine
from baton.handoff.transport import HeldSpan, SpanStore
from baton.http import APIError
from baton.outputs import RequestOutput
from baton.sampling_params import SamplingParams
from baton.server.chat import ChatServing
from baton.server.metrics import ServerMetrics
from baton.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from baton.server.responses import (
    ChoiceStream,
    Timing,
    TokenText,
    completion_logprobs,
    sse,
    stream_safe_text,
    usage,
)

T = TypeVar("T")


class OpenAIServing(ChatServing):
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        served_name: str,
        spans: SpanStore,
        config: ServerConfig,
    ) -> None:
        self.async_engine = engine
        self.spans = spans
        self.engine = engine.engine
        self.metrics = metrics
        self.served_name = served_name
        self.config = config
        self.piece = TokenText(self.engine.tokenizer)
        # tokenizing and chat templates run here, off the event loop, so a huge prompt does not
        # stall other streams; one thread, as a tokenizer is not meant for concurrent calls
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="baton-tokenize")

    # ---- shared ----------------------------------------------------------------------------------
    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def admit(self, num_sequences: int) -> None:
        """Refuse a request the server should not take on: too many sequences, or a full queue."""
        limit = self.config.max_sequences_per_request
        if num_sequences > limit:
            raise APIError(400, f"the request asks for {num_sequences} sequences (prompts x n); the limit is {limit}")
        self.async_engine.check_alive()  # EngineDeadError: 503 with Retry-After
        if self.async_engine.num_waiting() >= self.config.max_waiting_requests:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(
                503,
                f"the server is busy: {self.config.max_waiting_requests} requests are waiting; retry later",
                headers={"Retry-After": "1"},
            )

    def _prepare(self, prompt, body: _SamplingFields, max_tokens: int | None) -> tuple[str | None, list[int], int]:
        """Tokenize and check against the context; returns (text, ids, max_tokens resolved)."""
        text, ids = self.engine.inputs.tokenize(prompt)
        limit = self.engine.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens")
        if max_tokens is None:
            max_tokens = limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceeds the context of {limit} tokens"
            )
        return text, ids, max_tokens

    async def _tracked(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str,
        kv_span: HeldSpan | None = None,
        export_kv: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request, with its latency and outcome recorded; a parked
        span it took is counted against the worker's span budget until it ends."""
        timing, last, outcome = Timing(), None, "abort"
        try:
            prompt = {"prompt_token_ids": prompt_ids}
            blob = kv_span.blob if kv_span is not None else None
            async for out in self.async_engine.generate(prompt, params, rid, blob, export_kv):
                timing.saw(out)
                last = out
                yield out
            outcome = ",".join(sorted({c.finish_reason or "abort" for c in last.outputs})) if last else "abort"
        except Exception:
            outcome = "error"
            raise
        finally:
            if kv_span is not None:
                kv_span.release()
            produced = sum(len(c.token_ids) for c in last.outputs) if last else 0
            e2e = time.perf_counter() - timing.start
            ttft = timing.first_token - timing.start if timing.first_token else None
            self.metrics.observe(outcome, len(prompt_ids), produced, ttft, e2e)

    @staticmethod
    async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several requests' outputs; leaving early cancels (and so aborts) all of them."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    await queue.put((i, out))
            except Exception as e:
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _final(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for i, out in self._merge(gens):
            last[i] = out
        return [last[i] for i in range(len(gens))]

    def _header(self, rid: str, obj: str) -> dict:
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.served_name}

    def _prepare_all(self, prompts: list, body: _SamplingFields, max_tokens: int | None) -> list:
        return [self._prepare(p, body, max_tokens) for p in prompts]

    def _check(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> None:
        """The engine's own checks, here, so a bad request is a 4xx before any stream starts."""
        for ids, p in zip(prompt_ids, params):
            self.engine.inputs.check(ids, p)

    def _parked_span(self, body: _SamplingFields) -> HeldSpan | None:
        if body.kv_transfer_id is None:
            return None
        held = self.spans.take(body.kv_transfer_id)
        if held is None:  # expired or unknown: the prompt is simply prefilled here
            self.async_engine.rejected_imports += 1
        return held

    async def prefill(self, body: CompletionRequest | ChatCompletionRequest, rid: str, fmt: str) -> bytes:
        """Prefill one prompt and return its encoded KV span (the first token travels inside)."""
        self.admit(1)
        if isinstance(body, ChatCompletionRequest):
            ids, tool_spec, _ = await self.off_loop(self._chat_ids, body)
            max_tokens = body.max_completion_tokens or body.max_tokens
            _, ids, _ = await self.off_loop(self._prepare, {"prompt_token_ids": ids}, body, max_tokens)
            params = self._chat_params(body, tool_spec, 1, None)
        else:
            prompts = body.prompts()
            if len(prompts) != 1:
                raise ValueError("a KV handoff carries one prompt")
            _, ids, _ = await self.off_loop(self._prepare, prompts[0], body, body.max_tokens)
            params = body.sampling_params(1, None, None)
        await self.off_loop(self._check, [ids], [params])
        (out,) = await self._final([self._tracked(ids, params, rid, export_kv=fmt)])
        if out.kv_span is None:
            raise RuntimeError("the prefill produced no KV span")
        return out.kv_span

    # ---- /v1/completions -------------------------------------------------------------------------
    async def completion(self, body: CompletionRequest, rid: str):
        prompts = body.prompts()
        self.admit(len(prompts) * body.n)
        prepared = await self.off_loop(self._prepare_all, prompts, body, body.max_tokens)
        echo_lp = body.logprobs if body.echo and body.logprobs is not None else None
        params = [body.sampling_params(max(1, m), body.logprobs, echo_lp) for _, _, m in prepared]
        await self.off_loop(self._check, [ids for _, ids, _ in prepared], params)
        span = self._parked_span(body) if len(prepared) == 1 else None
        gens = [
            self._tracked(ids, p, f"{rid}-{i}", kv_span=span)
            for i, ((_, ids, _), p) in enumerate(zip(prepared, params))
        ]
        keep_output = [m > 0 for _, _, m in prepared]  # max_tokens 0: prompt only (echo / scoring)
        if body.stream:
            return sse(self._completion_stream(body, rid, prepared, keep_output, gens))
        outs = await self._final(gens)
        choices, completion_tokens = [], 0
        for i, (out, (text, ids, _)) in enumerate(zip(outs, prepared)):
            prompt_text = text if text is not None else self._decode(ids)
            for c in out.outputs:
                out_ids = c.token_ids if keep_output[i] else []
                out_text = c.text if keep_output[i] else ""
                completion_tokens += len(out_ids)
                choice = {
                    "index": i * body.n + c.index,
                    "text": (prompt_text if body.echo else "") + out_text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason if keep_output[i] else "length",
                    "stop_reason": c.stop_reason,
                }
                if c.error:
                    choice["error"] = c.error
                if body.logprobs is not None:
                    lp_ids = (ids if body.echo else []) + out_ids
                    entries = (out.prompt_logprobs if body.echo else []) + (c.logprobs or [])[: len(out_ids)]
                    choice["logprobs"] = completion_logprobs(lp_ids, entries, self.piece)
                if body.return_token_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = ids, out_ids
                choices.append(choice)
        prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
        return {
            **self._header(rid, "text_completion"),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in outs)),
        }

    async def _completion_stream(self, body, rid, prepared, keep_output, gens) -> AsyncIterator[dict]:
        states: dict[int, ChoiceStream] = {}
        completion_tokens = 0
        cached: dict[int, int] = {}
        opts = body.stream_options
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        stop = list(body.stop or []) if not isinstance(body.stop, str) else [body.stop]
        async for i, out in self._merge(gens):
            text, ids, _ = prepared[i]
            cached[i] = out.num_cached_tokens
            for c in out.outputs:
                index = i * body.n + c.index
                st = states.setdefault(index, ChoiceStream())
                if st.finished:
                    continue
                first = st.text_sent == 0 and st.tokens_sent == 0
                done = c.finish_reason is not None
                safe = stream_safe_text(c.text, done, stop) if keep_output[i] else ""
                delta = safe[st.text_sent :]
                new_ids = c.token_ids[st.tokens_sent :] if keep_output[i] else []
                if not (delta or done or (first and body.echo) or (body.return_token_ids and new_ids)):
                    continue
                choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": None}
                lp_ids, entries = (
                    list(new_ids),
                    list((c.logprobs or [])[st.tokens_sent : st.tokens_sent + len(new_ids)]),
                )
                if first and body.echo:
                    choice["text"] = (text if text is not None else self._decode(ids)) + delta
                    lp_ids, entries = ids + lp_ids, (out.prompt_logprobs or [None] * len(ids)) + entries
                if body.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(lp_ids, entries, self.piece)
                if body.return_token_ids:
                    choice["token_ids"] = new_ids
                    if first:
                        choice["prompt_token_ids"] = ids
                if done:
                    choice["finish_reason"] = c.finish_reason if keep_output[i] else "length"
                    choice["stop_reason"] = c.stop_reason
                    if c.error:
                        choice["error"] = c.error
                    st.finished = True
                    completion_tokens += len(c.token_ids) if keep_output[i] else 0
                st.text_sent += len(delta)
                st.tokens_sent += len(new_ids)
                chunk = {**self._header(rid, "text_completion"), "choices": [choice]}
                if continuous:  # vLLM's continuous_usage_stats: the counts so far in every chunk
                    prompt_tokens = sum(len(p_ids) for _, p_ids, _ in prepared)
                    chunk["usage"] = usage(
                        prompt_tokens, sum(x.tokens_sent for x in states.values()), sum(cached.values())
                    )
                yield chunk
        if body.stream_options and body.stream_options.include_usage:
            prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
            yield {
                **self._header(rid, "text_completion"),
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, sum(cached.values())),
            }

    # ---- /v1/chat/completions --------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""
