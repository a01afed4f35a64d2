"""What a JSON schema costs the batch: TPOT at c1 and c8 with no constrained request, and with a JSON
schema on half of the requests (at c1: on the one), and the token-mask time per step.

    python -m bench.structured [--models smollm2-135m gemma3-270m] [--output-len 64] [--rounds 2]

Offline, on the engine (no HTTP): every request runs --output-len tokens (the schema is an array of
exactly 64 bounded objects, so constrained requests never end early); TPOT is a request's time from
its first to its last token over its tokens after the first; the figures are medians over requests
and rounds. Target (issue 15): constrained TPOT within 10 % of unconstrained at c8.
"""

from __future__ import annotations

import argparse
import statistics
import time

from baton import LLM, SamplingParams
from baton.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
        },
        "required": ["id", "name", "kind"],
        "additionalProperties": False,
    },
    "minItems": 64,
    "maxItems": 64,
}
PROMPT = "A list of 64 inventory records as JSON, each with an id, a short name and a kind:"


def run(
    llm: LLM, concurrency: int, constrained: int, output_len: int, forced: bool = True
) -> tuple[list[float], list[float]]:
    """TPOTs (ms) of the unconstrained and of the constrained requests of one batch; forced=False
    samples every token, as if the grammar never forced one (the mask's own cost)."""
    engine = llm.engine
    spec = StructuredOutputsParams(json=SCHEMA)
    kinds = {}
    for i in range(concurrency):
        schema = i < constrained
        params = SamplingParams(
            max_tokens=output_len, temperature=0.0, ignore_eos=True, structured_outputs=spec if schema else None
        )
        rid = engine.add_request(f"{PROMPT} (batch {i})", params)
        kinds[rid] = schema
        for req in engine.requests[rid]:
            if req.matcher is not None and not forced:
                req.matcher = _NoForcedTokens(req.matcher)
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            last[out.request_id] = (now, n)
    tpot: dict[bool, list[float]] = {False: [], True: []}
    for rid, schema in kinds.items():
        end, n = last[rid]
        if n > 1:
            tpot[schema].append(1000 * (end - first[rid]) / (n - 1))
    return tpot[False], tpot[True]


class _NoForcedTokens:
    """A matcher that never reports forced tokens."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def compute_ff_tokens(self) -> list[int]:
        return []

    def __getattr__(self, name):
        return getattr(self._m, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(
        "model | c | TPOT ms, no schema | schema on half: plain / constrained (ratio) | same, forced tokens "
        "sampled | mask ms/step"
    )
    for model in args.models:
        llm = LLM(model, progress=False)
        run(llm, 2, 1, 8)  # warm-up: the grammar tokenizer and the compiled schema
        so = llm.engine.structured
        for c in (1, 8):
            base: list[float] = []
            mixed = {True: ([], []), False: ([], [])}  # forced tokens on / off: (plain, constrained) TPOTs
            steps0, secs0 = so.mask_steps, so.mask_seconds
            for _ in range(args.rounds):
                base += run(llm, c, 0, args.output_len)[0]
                for forced in (True, False):
                    plain, schema = run(llm, c, max(1, c // 2), args.output_len, forced)
                    mixed[forced][0].extend(plain)
                    mixed[forced][1].extend(schema)
            mask_ms = 1000 * (so.mask_seconds - secs0) / max(1, so.mask_steps - steps0)
            b = statistics.median(base)
            cells = []
            for forced in (True, False):
                plain, schema = mixed[forced]
                p = f"{statistics.median(plain):.1f}" if plain else "-"
                m = statistics.median(schema)
                cells.append(f"{p} / {m:.1f} ({m / b:.2f})")
            print(f"{model} | {c} | {b:.1f} | {cells[0]} | {cells[1]} | {mask_ms:.3f}")
        del llm


if __name__ == "__main__":
    main()
