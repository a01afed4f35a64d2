"""GGUF files read as HF checkpoints: the architecture's declaration (gguf_arch.GGUFArch, found in
the registry) gives the config and the names; this module only reads: metadata, then tensors
(dequantized, or matrices kept in their GGUF blocks), each under its HF name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from baton.models.gguf_arch import GGUFArch, GGUFMetadata, Value
from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor
from baton.models.registry import GGUF_ARCHITECTURES

_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_READABLE = {"F32", "F16", "F64", *(t.name for t in gguf.quants._type_traits)}


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the gguf package's errors for a bad or truncated file are of many types
            raise ValueError(f"{path.name}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        arch = self._field("general.architecture")
        self.spec: GGUFArch | None = GGUF_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
        if self.spec is None:
            raise ValueError(
                f"{path.name}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.gguf_arch = arch
        self.architecture = self.spec.architecture
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in self.reader.tensors}
        self.meta = GGUFMetadata(_Fields(self.reader), arch, path.name, shapes)
        self.config = self._config()

    def _field(self, key: str) -> Any:
        f = self.reader.fields.get(key)
        return None if f is None else f.contents()

    def _config(self) -> dict[str, Any]:
        cfg = self.spec.config(self.meta)
        names = {t.name for t in self.reader.tensors}
        embd = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None or len(embd.shape) != 2:
            raise ValueError(f"{self.path.name}: no token_embd.weight matrix")
        cfg["vocab_size"] = int(embd.shape[1])
        cfg["tie_word_embeddings"] = "output.weight" not in names
        return cfg

    def _stored(self) -> Iterator[tuple[Any, str]]:
        """The tensors something reads, with the HF name each is read under."""
        for t in self.reader.tensors:
            if _kept_elsewhere(t.name, self.config["num_hidden_layers"]):
                continue
            name = self.spec.hf_name(t.name)
            if name is None:
                raise ValueError(f"{self.path.name}: tensor {t.name} is not one a {self.gguf_arch} model has")
            if t.tensor_type.name not in _READABLE:
                raise ValueError(
                    f"{self.path.name}: tensor {t.name} is of type {t.tensor_type.name}, which baton cannot read"
                )
            yield t, name

    def header(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF name -> (shape, stored type): the transforms run on meta tensors, nothing is read."""
        out = {}
        for t, name in self._stored():
            shape = tuple(int(d) for d in reversed(t.shape))
            stand_in = torch.empty(shape, device="meta")
            try:
                for hf, value in self.spec.hf_tensors(name, stand_in, self.meta):
                    out[hf] = (tuple(value.shape), t.tensor_type.name)
            except (IndexError, RuntimeError, ValueError) as e:  # a shape the transform cannot take
                raise ValueError(
                    f"{self.path.name}: tensor {t.name} of shape {list(shape)} does not fit ({e})"
                ) from None
        return out

    def tensors(self, keep_blocks: bool = False) -> Iterator[tuple[str, Value]]:
        """Every tensor under its HF name, dequantized to float32; with `keep_blocks`, matrices in a
        format baton's kernels read stay in their GGUF blocks (BlockTensor; stacked experts as one
        [experts * N, K] block matrix the transform splits)."""
        for t, name in self._stored():
            shape = tuple(int(d) for d in reversed(t.shape))
            value: Value
            if keep_blocks and len(shape) in (2, 3) and t.tensor_type.name in BLOCK_FORMATS:
                rows = np.asarray(t.data).reshape(int(np.prod(shape[:-1])), -1)  # rows of block bytes
                value = BlockTensor.from_rows(t.tensor_type.name, np.array(rows, copy=True))
            else:
                value = torch.from_numpy(_float32(t, shape))
            yield from self.spec.hf_tensors(name, value, self.meta)


def _float32(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    if t.tensor_type.name in _FLOAT_TYPES:
        data = np.asarray(t.data).astype(np.float32)
    else:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"tensor {t.name}: {data.size} values for shape {list(shape)}")
    return np.array(data.reshape(shape), dtype=np.float32, copy=True)


def _kept_elsewhere(gguf_name: str, num_layers: int) -> bool:
    """A block past the trunk: an MTP (nextn) layer a file carries for speculative decoding."""
    if not gguf_name.startswith("blk."):
        return False
    index = gguf_name.split(".", 2)[1]
    return index.isdigit() and int(index) >= num_layers


class _Fields:
    """The reader's fields by key, each read only when asked (tokenizer arrays are large)."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self.reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()
