"""Offline throughput: baton `LLM.generate` against transformers `generate`, same prompts and weights.

Prints output tokens/s for batch 1 and for 16 prompts at once, and the ratio baton / transformers.
    python -m bench.offline [--model smollm2-135m] [--max-tokens 64] [--num-prompts 16] [--module-path]
--model also takes a hybrid family's random model (bench/hybrid_models.py: qwen3-next-100m,
kimi-linear-100m, nemotron-h-100m, deepseek-v32-100m, glm5-100m, glm5-flash-100m), prompted with
random token ids. --module-path decodes module by module (the one-call decode step off), to
compare.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from baton import LLM, SamplingParams
from baton.config import EnvSettings
from baton.models.loader import resolve_model_path
from bench.hybrid_models import FAMILIES, build

PROMPTS = [
    "The history of the printing press begins",
    "Write a function in Python that checks whether a number is prime.",
    "Three reasons why the sky looks blue are",
    "A recipe for a simple tomato soup:",
    "In the year 2050, cities will",
    "The main differences between TCP and UDP are",
    "Once upon a time, a lighthouse keeper",
    "Explain photosynthesis to a ten-year-old:",
]


def hf_generate(model, pad: int, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for transformers to generate max_tokens for each prompt, batched with left padding."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--module-path", action="store_true", help="decode module by module (fused_decode off)")
    args = ap.parse_args()
    fused = {"fused_decode": not args.module_path}
    torch.set_num_threads(2)

    from transformers import AutoModelForCausalLM

    if args.model in FAMILIES:
        path = build(EnvSettings.read().cache_dir, args.model)
        llm = LLM(str(path), progress=False, **fused)
        import transformers

        arch = getattr(transformers, FAMILIES[args.model][0])  # a multimodal checkpoint's own class (GLM-5.3-Flash)
        ref = arch.from_pretrained(str(path), dtype=torch.float32).eval()
        rng = random.Random(0)
        prompts = [[rng.randrange(10, 31000) for _ in range(rng.randrange(8, 16))] for _ in range(args.num_prompts)]
        pad = 0
    else:
        llm = LLM(args.model, progress=False, **fused)
        tok = llm.get_tokenizer()
        path = resolve_model_path(args.model)
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        prompts = [tok.encode(PROMPTS[i % len(PROMPTS)] + f" (case {i})") for i in range(args.num_prompts)]
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))  # warm-up

    path_name = "module path" if args.module_path else "one-call decode step"
    print(
        f"model {args.model}, {args.max_tokens} new tokens per prompt, float32, {torch.get_num_threads()} threads, "
        f"{path_name}"
    )
    print(f"{'batch':>6} {'baton tok/s':>12} {'hf tok/s':>10} {'ratio':>7}")
    for batch in (1, args.num_prompts):
        chosen = prompts[:batch]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in chosen], params)
        baton_s = time.perf_counter() - start
        hf_s = hf_generate(ref, pad, chosen, args.max_tokens)
        tokens = batch * args.max_tokens
        print(f"{batch:>6} {tokens / baton_s:>12.1f} {tokens / hf_s:>10.1f} {hf_s / baton_s:>7.2f}")


if __name__ == "__main__":
    main()
