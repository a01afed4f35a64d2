"""GGUF files rewritten with the gguf package: fields replaced or dropped, tensors changed, dropped
or added (a converter's output put right, or a broken file made for a test)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

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


class _Renamed:
    def __init__(self, name: str, t) -> None:
        self.name, self.data, self.tensor_type, self.shape = name, t.data, t.tensor_type, t.shape
