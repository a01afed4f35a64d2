"""How far a quantized model's next-token distributions are from the float32 model's, for baton and
for llama.cpp's `llama-perplexity --kl-divergence`, on the same file and text, side by side.

    python -m bench.quant_quality [--model smollm2-135m | qwen3.5-1.5b:Q4_K_M] [--text /usr/share/common-licenses/GPL-3]
        [--ctx 512] [--chunks 8] [--quantization q4_k | --kv-cache-dtype fp8] [--quantized-kv-cache-dtype float32]

The text is cut into chunks of --ctx tokens, each starting with BOS, and (as llama-perplexity does)
the second half of each chunk is scored: mean KL(float32 || quantized), top-1 agreement and the
perplexity of each model. Beside llama.cpp, baton scores the token ids llama.cpp's own tokenizer
gives (`llama-tokenize`), so that both score the same positions. Without --quantization, baton's
quantized model is the GGUF file as shipped and its float32 model the same file dequantized
(`--dtype float32`), so baton's figures measure only its kernels; with it, the dequantized weights
quantized again at load. llama.cpp's float32 model is the F32 GGUF made from the same weights
(bench/peer_servers.f32_gguf). For bench/hybrid_files.py's files (`--model NAME:TYPE`), both
engines' float model is the file's F32 sibling (the random checkpoint's bf16 weights, converted by
llama.cpp's converter to float32: llama.cpp computes a BF16 file's matmuls on bf16 activations, a
float model of its own), so both figures count the quantization and the kernels. KL is summed as
llama-perplexity sums it (base log-probs more than 16 below a row's top left out). Beside
llama.cpp, each engine's quantized model is also scored against the other's float model
(llama-perplexity's log-prob file read by baton, and baton's written in its format:
bench/kld_file.py), with the KL between the two float models: where the float models differ
(near-uniform MoE routers flip an expert on rounding), the cross rows tell a gap in the quantized
math from a difference of references.
With --kv-cache-dtype, both models run the weights as shipped and differ only in the KV cache's
dtype ("float32" and "quantized" in the table are then the KV's); pick --ctx past the model's
sliding window (Gemma3's is 512) so that every kind of layer reads quantized K/V.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from baton import LLM
from baton.bench.hf_export import export_hf_dir
from baton.config import EnvSettings
from baton.models.loader import resolve_model_path
from bench import hybrid_files, kld_file
from bench.peer_servers import f32_gguf, llama_cpp_binary


def chunks(llm: LLM, text: str, ctx: int, count: int, ids: list[int] | None = None) -> list[list[int]]:
    """llama-perplexity's chunks: tokens [i * ctx, (i + 1) * ctx) of the text's ids (baton's own
    tokenization unless given), the first of each replaced by BOS."""
    ids = ids if ids is not None else llm.engine.tokenizer.encode(text)
    bos = llm.engine.model_config.bos_token_id
    out = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)][:count]
    return [[bos, *c[1:]] if bos is not None else c for c in out]


def scored_logprobs(llm: LLM, batches: list[list[int]]) -> torch.Tensor:
    """log-softmax of the next-token logits over the second half of every chunk: [positions, vocab]."""
    rows = []
    for ids in batches:
        logits = llm.prompt_logits({"prompt_token_ids": ids})
        rows.append(logits[len(ids) // 2 : -1].log_softmax(-1))
    return torch.cat(rows)


def targets(batches: list[list[int]]) -> torch.Tensor:
    return torch.tensor([t for ids in batches for t in ids[len(ids) // 2 + 1 :]])


def logprobs_pair(
    model: str,
    ref_args: dict,
    test_args: dict,
    text: str,
    ctx: int,
    count: int,
    ids: list[int] | None = None,
    ref_model: str | None = None,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """(the chunks, the float model's scored log-probs, the quantized model's)."""
    ref = LLM(ref_model or model, progress=False, **ref_args)
    batches = chunks(ref, text, ctx, count, ids)
    base = scored_logprobs(ref, batches)
    del ref
    quant = LLM(model, progress=False, **test_args)
    return batches, base, scored_logprobs(quant, batches)


def figures(base: torch.Tensor, test: torch.Tensor, tgt: torch.Tensor) -> dict[str, float]:
    kl = kld_file.mean_kl(base, test)
    return {
        "tokens scored": float(len(tgt)),
        "mean KL": kl.mean().item(),
        "KL std. error": (kl.std() / len(kl) ** 0.5).item(),
        "top-1 agreement %": 100 * (base.argmax(-1) == test.argmax(-1)).float().mean().item(),
        "PPL float32": base.gather(1, tgt[:, None]).mean().neg().exp().item(),
        "PPL quantized": test.gather(1, tgt[:, None]).mean().neg().exp().item(),
    }


def model_files(model: str) -> tuple[Path, Path]:
    """(the quantized GGUF file, llama.cpp's float model of the same weights): a packaged model's
    file and the F32 GGUF of its export, or bench/hybrid_files.py's NAME:TYPE and its F32 file (the
    random checkpoint's own weights in float32)."""
    cache = EnvSettings.read().cache_dir
    name, _, quant = model.partition(":")
    if name in hybrid_files.SHAPES:
        return hybrid_files.gguf_file(cache, name, quant or "Q4_K_M"), hybrid_files.gguf_file(cache, name, "F32")
    return resolve_model_path(model), f32_gguf(cache, model, export_hf_dir(model))


def llama_cpp_tokens(model: str, text_file: Path) -> list[int]:
    """The text's token ids as llama-perplexity tokenizes it (BOS first where the vocabulary adds one)."""
    tool = llama_cpp_binary(EnvSettings.read().cache_dir, "llama-tokenize")
    cmd = [str(tool), "-m", str(model_files(model)[0]), "-f", str(text_file), "--ids", "--log-disable"]
    out = subprocess.run([*cmd, "--no-escape"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_cpp_base(model: str, text_file: Path, ctx: int, count: int, out: Path) -> float:
    """llama.cpp's float model's log-probs written to `out`; its perplexity."""
    tool = llama_cpp_binary(EnvSettings.read().cache_dir, "llama-perplexity")
    cmd = [str(tool), "-m", str(model_files(model)[1]), "--kl-divergence-base", str(out)]
    run = subprocess.run([*cmd, *_common(text_file, ctx, count)], capture_output=True, text=True)
    return _final(r"Final estimate: PPL = ([\d.]+)", run.stdout + run.stderr)


def llama_cpp_figures(model: str, text_file: Path, ctx: int, count: int, base: Path) -> dict[str, float]:
    """llama.cpp's quantized model scored against the log-probs in `base` (its own float model's or baton's)."""
    tool = llama_cpp_binary(EnvSettings.read().cache_dir, "llama-perplexity")
    cmd = [str(tool), "-m", str(model_files(model)[0]), "--kl-divergence-base", str(base), "--kl-divergence"]
    out = subprocess.run([*cmd, *_common(text_file, ctx, count)], capture_output=True, text=True)
    log = out.stdout + out.stderr
    return {
        "mean KL": _final(r"Mean\s+KLD:\s+([\d.eE+-]+)", log),
        "KL std. error": _final(r"Mean\s+KLD:\s+[\d.eE+-]+\s+±\s+([\d.eE+-]+)", log),
        "top-1 agreement %": _final(r"Same top p:\s+([\d.]+)", log),
        "PPL quantized": _final(r"Mean\s+PPL\(Q\)\s*:\s+([\d.]+)", log),
    }


def _common(text_file: Path, ctx: int, count: int) -> list[str]:
    return ["-f", str(text_file), "-c", str(ctx), "--chunks", str(count), "-t", "2"]


def _final(pattern: str, log: str) -> float:
    found = re.findall(pattern, log)
    return float(found[-1]) if found else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--quantization", default=None)
    ap.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="compare this KV dtype (fp8, bfloat16, ...) against float32 KV, both on the weights as shipped",
    )
    ap.add_argument(
        "--quantized-kv-cache-dtype",
        default=None,
        help="the quantized model's KV dtype (default: the engine's, float16 for a GGUF file's blocks)",
    )
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    text = Path(args.text).read_text()
    if args.kv_cache_dtype:
        ref_args, test_args = {"kv_cache_dtype": "float32"}, {"kv_cache_dtype": args.kv_cache_dtype}
    else:
        ref_args, test_args = {"dtype": "float32"}, {"quantization": args.quantization}
        if args.quantized_kv_cache_dtype:
            test_args["kv_cache_dtype"] = args.quantized_kv_cache_dtype
    beside_llama_cpp = not args.no_llama_cpp and args.quantization is None and args.kv_cache_dtype is None
    ids = llama_cpp_tokens(args.model, Path(args.text)) if beside_llama_cpp else None
    quantized, base = model_files(args.model)
    # a hybrid file's float model is its F32 file, as llama.cpp's; a packaged one's, itself dequantized
    ref_model = str(base) if args.model.partition(":")[0] in hybrid_files.SHAPES and not args.kv_cache_dtype else None
    batches, base, test = logprobs_pair(
        str(quantized), ref_args, test_args, text, args.ctx, args.chunks, ids, ref_model
    )
    tgt = targets(batches)
    rows = {"baton": figures(base, test, tgt)}
    if beside_llama_cpp:
        with tempfile.TemporaryDirectory() as tmp:
            llama_file, baton_file = Path(tmp) / "llama.kld", Path(tmp) / "baton.kld"
            text_file, ctx, count = Path(args.text), args.ctx, args.chunks
            ppl = llama_cpp_base(args.model, text_file, ctx, count, llama_file)
            rows["llama.cpp"] = {**llama_cpp_figures(args.model, text_file, ctx, count, llama_file), "PPL float32": ppl}
            # each engine's quantized model against the other's float model: tells a gap in the
            # quantized math from the two float models' own difference (MoE routers flip on it)
            llama_base = kld_file.read(llama_file)
            if llama_base.tokens != ids[: len(llama_base.tokens)] or llama_base.logprobs.shape != base.shape:
                raise SystemExit("llama-perplexity scored other tokens or another vocabulary than baton")
            kld_file.write(baton_file, ctx, llama_base.tokens, base)
            rows["baton, llama.cpp's float"] = figures(llama_base.logprobs, test, tgt)
            rows["llama.cpp, baton's float"] = llama_cpp_figures(args.model, text_file, ctx, count, baton_file)
            rows["float models"] = figures(llama_base.logprobs, base, tgt)
    from baton.ops import quant_kernel

    kv = test_args.get("kv_cache_dtype", "the engine's default")
    tokens = "llama.cpp's token ids, both" if ids is not None else "baton's tokenizer"
    print(f"{args.model}, {Path(args.text).name}, {args.chunks} chunks of {args.ctx}, second halves scored ({tokens})")
    print(f"baton's quantized model: kernel {quant_kernel()}, KV {kv}; llama.cpp: its defaults (f16 KV)")
    names = list(rows["baton"])
    width = max(len(who) for who in rows) + 2
    print(f"{'':<{width}}" + "".join(f"{n:>20}" for n in names))
    for who, row in rows.items():
        print(f"{who:<{width}}" + "".join(f"{row.get(n, float('nan')):>20.6g}" for n in names))
    if beside_llama_cpp:
        print("rows 3-4: each quantized model against the other engine's float model; row 5: llama.cpp's")
        print("float model (base) against baton's ('quantized'), KL between the references themselves")


if __name__ == "__main__":
    main()
