"""GGUF files for the tests, made as a user makes them: a random-weight transformers checkpoint
(SmolLM2's tokenizer, which llama.cpp's converter knows) through llama.cpp's own
convert_hf_to_gguf.py (from the llama-cpp-python sdist, bench/peer_servers.py), and rewritten with
the gguf package where a test needs a quantized or a broken file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from baton.config import EnvSettings
from baton.models.loader import resolve_model_path
from baton.tokenizer import load_tokenizer
from bench.peer_servers import llama_cpp_sources

VOCAB = 49152  # the converter wants the tokenizer's whole vocabulary in the embedding


def convert(hf_dir: Path, out: Path, *extra: str) -> Path:
    """hf_dir (with SmolLM2's tokenizer written into it) to an F32 GGUF by llama.cpp's converter."""
    cache = EnvSettings.read().cache_dir
    load_tokenizer(resolve_model_path("smollm2-135m"), cache).save_pretrained(str(hf_dir))
    script = llama_cpp_sources(cache) / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(hf_dir), "--outtype", "f32", "--outfile", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


Field = tuple[object, gguf.GGUFValueType, gguf.GGUFValueType | None]  # value, type, array item type


def rewrite(
    src: Path,
    dst: Path,
    fields: dict[str, Field | None] | None = None,
    tensor: Callable[[str, np.ndarray, gguf.GGMLQuantizationType], tuple] | None = None,
    added: list[tuple[str, object]] = (),
) -> Path:
    """src copied to dst with `fields` replaced (None: dropped), each tensor through `tensor(name,
    data, type)` -> (data, shape, type) or () to drop it, and `added` reader tensors under new names."""
    reader = gguf.GGUFReader(str(src))
    fields = fields or {}
    arch = fields.get("general.architecture", (reader.fields["general.architecture"].contents(),))[0]
    writer = gguf.GGUFWriter(str(dst), str(arch))
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in fields:
            continue
        writer.add_key_value(name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for name, value in fields.items():
        if value is not None and name != "general.architecture":
            writer.add_key_value(name, *value)
    for t in [*reader.tensors, *(_Renamed(name, t) for name, t in added)]:
        data, qtype = np.array(t.data), t.tensor_type
        shape = [int(d) for d in reversed(t.shape)]
        out = (
            tensor(t.name, data.reshape(shape) if qtype.name == "F32" else data, qtype)
            if tensor
            else (data, shape, qtype)
        )
        if out:
            data, shape, qtype = out
            writer.add_tensor(t.name, data, raw_dtype=qtype)  # quantized data: rows of block bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def quantized(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """src's matrices whose width is whole blocks in `qtype` (gguf's quantizer), the rest as they are."""
    values = gguf.GGML_QUANT_SIZES[qtype][0]

    def quantize(name: str, data: np.ndarray, stored: gguf.GGMLQuantizationType):
        if data.ndim in (2, 3) and data.shape[-1] % values == 0 and stored.name == "F32":
            return gguf.quants.quantize(data, qtype), list(data.shape), qtype
        return data, list(data.shape), stored

    return rewrite(src, dst, tensor=quantize)


class _Renamed:
    def __init__(self, name: str, t) -> None:
        self.name, self.data, self.tensor_type, self.shape = name, t.data, t.tensor_type, t.shape
