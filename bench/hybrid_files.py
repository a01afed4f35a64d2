"""Hybrid GGUF files at the sizes CPU users run, made as a user makes them: a random-weight
checkpoint of the family's shape (SmolLM2's tokenizer and vocabulary), converted by llama.cpp's own
convert_hf_to_gguf.py to bf16 and quantized by its llama-quantize. Made once under the cache
directory; random weights make no sense as text but cost what a trained model of that shape costs.

    python -m bench.hybrid_files qwen3.5-1.5b:Q4_K_M qwen3.5-0.4b:Q8_0 ...   (prints the paths)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from baton.bench.hf_export import export_hf_dir
from bench.peer_servers import CORES, llama_cpp_binary, llama_cpp_sources

_QWEN35 = dict(  # Qwen3.5's text shape: 3 Gated DeltaNet layers to 1 gated attention layer
    vocab_size=49152,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
SHAPES: dict[str, tuple[str, dict]] = {
    # ~1.5B parameters: hidden 2048, 24 layers (18 Gated DeltaNet, 6 attention), MLP 6144
    "qwen3.5-1.5b": (
        "Qwen3_5ForCausalLM",
        dict(
            _QWEN35,
            hidden_size=2048,
            num_hidden_layers=24,
            intermediate_size=6144,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
        ),
    ),
    # ~0.4B: the same pattern at half the width, for quick runs
    "qwen3.5-0.4b": (
        "Qwen3_5ForCausalLM",
        dict(
            _QWEN35,
            hidden_size=1024,
            num_hidden_layers=16,
            intermediate_size=3072,
            linear_num_key_heads=8,
            linear_num_value_heads=8,
        ),
    ),
}
QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "BF16")


def hf_dir(cache: Path, name: str) -> Path:
    out = cache / "bench" / f"{name}-hf"
    if (out / "config.json").exists():
        return out
    import transformers

    arch, config = SHAPES[name]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "TextConfig"))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_cls(**config)).to(torch.bfloat16)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer_dir = export_hf_dir("smollm2-135m")  # its tokenizer files, chat template and vocabulary
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, tmp / file)
    tmp.rename(out)
    return out


def gguf_file(cache: Path, name: str, quant: str) -> Path:
    """`name` in llama-quantize's `quant`: the checkpoint to bf16 by the converter, then quantized."""
    if name not in SHAPES or quant not in QUANTS:
        raise ValueError(f"unknown {name}:{quant}; shapes {', '.join(SHAPES)}, types {', '.join(QUANTS)}")
    out = cache / "bench" / "gguf" / f"{name}-{quant.lower()}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    bf16 = out.with_name(f"{name}-bf16.gguf")
    if not bf16.exists():
        script = llama_cpp_sources(cache) / "convert_hf_to_gguf.py"
        tmp = bf16.with_suffix(".tmp")
        cmd = [sys.executable, str(script), str(hf_dir(cache, name)), "--outtype", "bf16", "--outfile", str(tmp)]
        done = subprocess.run([*cmd, "--no-mtp"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
        tmp.rename(bf16)
    if quant == "BF16":
        return bf16
    tmp = out.with_suffix(".tmp")
    cmd = [str(llama_cpp_binary(cache, "llama-quantize")), str(bf16), str(tmp), quant, str(CORES)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    import argparse

    from baton.config import EnvSettings

    ap = argparse.ArgumentParser(description="Make hybrid GGUF files once (printing their paths).")
    ap.add_argument("files", nargs="+", metavar="NAME:TYPE", help=f"shapes {', '.join(SHAPES)}; types {QUANTS}")
    for spec in ap.parse_args().files:
        name, _, quant = spec.partition(":")
        try:
            print(gguf_file(EnvSettings.read().cache_dir, name, quant or "Q4_K_M"), flush=True)
        except ValueError as e:
            ap.error(str(e))
