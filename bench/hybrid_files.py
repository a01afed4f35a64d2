"""Hybrid GGUF files at the sizes CPU users run, made as a user makes them: a random-weight
checkpoint of the family's shape (SmolLM2's tokenizer and vocabulary), converted by llama.cpp's own
convert_hf_to_gguf.py to bf16 and quantized by its llama-quantize. Made once under the cache
directory; random weights make no sense as text but cost what a trained model of that shape costs.

    python -m bench.hybrid_files qwen3.5-1.5b:Q4_K_M qwen3.5-0.4b:Q8_0 ...   (prints the paths)
"""

from __future__ import annotations

import json
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
    # Granite-4.0-H-shaped MoE, ~3.0B total / ~0.95B active: 32 layers (every 8th NoPE attention,
    # the rest Mamba2 of 48 heads x 64), 32 experts of 512 (4 used) beside a shared 1024, IBM's multipliers
    "granite-4.0-h-3b-moe": (
        "GraniteMoeHybridForCausalLM",
        dict(
            vocab_size=49152,
            hidden_size=1536,
            num_hidden_layers=32,
            layer_types=["attention" if i % 8 == 7 else "mamba" for i in range(32)],
            num_attention_heads=12,
            num_key_value_heads=4,
            mamba_n_heads=48,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=128,
            mamba_d_conv=4,
            num_local_experts=32,
            num_experts_per_tok=4,
            intermediate_size=512,
            shared_intermediate_size=1024,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=6.0,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # LFM2-1.2B's shape: 16 layers (6 attention, 10 gated short convolutions), MLP 12288 -> 8192
    "lfm2-1.2b": (
        "Lfm2ForCausalLM",
        dict(
            vocab_size=49152,
            hidden_size=2048,
            num_hidden_layers=16,
            layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=12288,
            block_auto_adjust_ff_dim=True,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            conv_L_cache=3,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}
QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "BF16")
_IBM_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}  # the names llama.cpp's converter knows


def hf_dir(cache: Path, name: str) -> Path:
    out = cache / "bench" / f"{name}-hf"
    if (out / "config.json").exists():
        return out
    import transformers

    arch, config = SHAPES[name]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "TextConfig"), None)
    config_cls = config_cls or getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_cls(**config)).to(torch.bfloat16)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    if arch == "GraniteMoeHybridForCausalLM":
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["layer_types"] = [_IBM_TYPES.get(t, t) for t in cfg["layer_types"]]
        (tmp / "config.json").write_text(json.dumps(cfg))
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
        no_mtp = ["--no-mtp"] if SHAPES[name][0].startswith("Qwen") else []  # the others refuse the flag
        done = subprocess.run([*cmd, *no_mtp], capture_output=True, text=True)
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
