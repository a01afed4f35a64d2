"""bfloat16 prefill, float32 decode: how far does the handoff move the result?

Per prompt: the first position where greedy tokens (bf16-prefilled span imported into a float32
decode worker) diverge from the float32-only run, the float32 reference's top-1 / top-2 logit
margin there, and the relative RMS error of the span's K and V and of the first-token logits.
    python -m bench.pd_precision [--model smollm2-135m] [--max-tokens 32]
"""

from __future__ import annotations

import argparse

import torch

from baton import LLM, SamplingParams
from baton.handoff import wire

PROMPTS = [
    "The history of the printing press begins",
    "Write a function in Python that checks whether a number is prime.",
    "Three reasons why the sky looks blue are",
    "Once upon a time, a lighthouse keeper named Ada kept a log of every ship that passed. " * 4,
]


def export(llm: LLM, ids: list[int]) -> bytes:
    e = llm.engine
    rid = e.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0), export_kv="grouped")
    while True:
        for out in e.step():
            if out.request_id == rid and out.finished:
                return out.kv_span


def span_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    header, body = wire.read_header(blob)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    out = {}
    for e in header["tensors"]:
        t = wire.tensor_from_bytes(body[e["offset"] : e["offset"] + e["nbytes"]], dtypes[e["dtype"]], e["shape"])
        out[f"{e['kind']}{e['layer_ids'][0]}"] = t.float()
    return out


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    fp32 = LLM(args.model, progress=False)
    bf16 = LLM(args.model, progress=False, dtype="bfloat16")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print(f"{args.model}: bfloat16 prefill -> float32 decode, {args.max_tokens} greedy tokens")
    print(f"{'prompt':>6} {'tokens':>6} {'diverge@':>9} {'margin':>8} {'K rms':>9} {'V rms':>9} {'logit rms':>10}")
    for i, text in enumerate(PROMPTS):
        ids = fp32.get_tokenizer().encode(text)
        ref = fp32.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
        blob = export(bf16, ids)
        e = fp32.engine
        rid = e.add_request({"prompt_token_ids": ids}, params, kv_span=blob)
        got = None
        while got is None:
            got = next((o for o in e.step() if o.request_id == rid and o.finished), None)
        tokens = got.outputs[0].token_ids
        diverge = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
        margin = float("nan")
        if diverge is not None:
            logits = fp32.prompt_logits({"prompt_token_ids": ids + ref[:diverge]})[-1]
            top2 = logits.topk(2).values
            margin = float(top2[0] - top2[1])
        a, b = span_tensors(blob), span_tensors(export(fp32, ids))
        k = rel_rms(
            torch.cat([a[n].flatten() for n in a if n[0] == "k"]), torch.cat([b[n].flatten() for n in b if n[0] == "k"])
        )
        v = rel_rms(
            torch.cat([a[n].flatten() for n in a if n[0] == "v"]), torch.cat([b[n].flatten() for n in b if n[0] == "v"])
        )
        lg = rel_rms(
            bf16.prompt_logits({"prompt_token_ids": ids})[-1], fp32.prompt_logits({"prompt_token_ids": ids})[-1]
        )
        where = "-" if diverge is None else str(diverge)
        print(f"{i:>6} {len(ids):>6} {where:>9} {margin:>8.3f} {k:>9.2e} {v:>9.2e} {lg:>10.2e}")


if __name__ == "__main__":
    main()
