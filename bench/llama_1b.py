"""The 1B class for the peer tables: a random-weight Llama of about 1.1B parameters (hidden 2048,
16 layers, 32 / 8 heads, MLP 8192, SmolLM2's tokenizer and vocabulary), converted by llama.cpp's
own convert_hf_to_gguf.py and quantized by its llama-quantize, as a user would make a GGUF file.
Made once under the cache directory; random weights make no sense as text but cost what a
trained model of that shape costs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from baton.bench.hf_export import export_hf_dir
from bench.peer_servers import CORES, ONE_B, llama_cpp_binary, llama_cpp_sources

FILES = dict(zip(ONE_B, ("Q4_K_M", "Q4_0", "Q8_0"), strict=True))  # name -> llama-quantize's type
SHAPE = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192
)


def hf_dir(cache: Path) -> Path:
    out = cache / "peers" / "llama-1.1b-hf"
    if (out / "config.json").exists():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = export_hf_dir("smollm2-135m")  # its tokenizer files and vocabulary
    config = LlamaConfig(
        vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, **SHAPE,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, tmp / name)
    tmp.rename(out)
    return out


def gguf_file(cache: Path, name: str) -> Path:
    """FILES[name]'s GGUF: the HF directory to bf16 by convert_hf_to_gguf.py, then llama-quantize."""
    out = cache / "peers" / "gguf" / f"{name}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    bf16 = out.with_name("llama-1.1b-bf16.gguf")
    if not bf16.exists():
        script = llama_cpp_sources(cache) / "convert_hf_to_gguf.py"
        cmd = [sys.executable, str(script), str(hf_dir(cache)), "--outtype", "bf16", "--outfile", str(bf16)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    quantize = llama_cpp_binary(cache, "llama-quantize")
    cmd = [str(quantize), str(bf16), str(out), FILES[name], str(CORES)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


if __name__ == "__main__":
    import argparse

    from baton.config import EnvSettings

    ap = argparse.ArgumentParser(description="Make the 1B class's GGUF files once (printing their paths).")
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(FILES)} (default: all)")
    names = ap.parse_args().names
    if unknown := [n for n in names if n not in FILES]:
        ap.error(f"unknown {', '.join(unknown)}: the 1B class is {', '.join(FILES)}")
    for n in names or FILES:
        print(gguf_file(EnvSettings.read().cache_dir, n))
