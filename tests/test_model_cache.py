"""The load-time caches: the weights' content hash computed once and read back, and every cache file
written under a unique temporary name and renamed into place, so workers on one cold cache never collide."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from baton.config import EnvSettings
from baton.models import loader
from baton.models.gguf_file import GGUFFile
from baton.tokenizer import _save_atomically
from tests.test_random_models import make_model


def test_hf_content_hash_is_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    _, path = make_model(tmp_path / "model", "LlamaForCausalLM")
    cache = tmp_path / "cache"
    digest = loader.load_model(str(path), torch.float32, cache, progress=False).weights_content_sha256
    assert len(list((cache / "fingerprints").glob("*.json"))) == 1
    assert loader.load_model(str(path), torch.float32, None, progress=False).weights_content_sha256 == digest

    def rehash(files):
        raise AssertionError("a warm cache must not hash the weights again")

    monkeypatch.setattr(loader, "safetensors_content_sha256", rehash)
    assert loader.load_model(str(path), torch.float32, cache, progress=False).weights_content_sha256 == digest
    monkeypatch.undo()
    weights = next(path.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # a new file
    assert loader.load_model(str(path), torch.float32, cache, progress=False).weights_content_sha256 == digest
    assert len(list((cache / "fingerprints").glob("*.json"))) == 2
    assert not list(cache.rglob("*.tmp"))


def test_gguf_cache_keeps_the_gguf_content_hash(smollm2):
    """The warm cache's hash is the GGUF tensors' (quantized) bytes hashed afresh."""
    path = loader.resolve_model_path("smollm2-135m")
    cached = loader.GGUFCache(path, EnvSettings.read().cache_dir, keep_blocks=True)  # as the fixture loads it
    assert cached.gguf is None  # warm: nothing parsed
    assert cached.weights_content_sha256 == loader.gguf_content_sha256(GGUFFile(path))
    assert smollm2.engine.handoff.fingerprint["weights_content_sha256"] == cached.weights_content_sha256


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    target = tmp_path / "cache" / "meta.json"
    payloads = [json.dumps({"writer": i, "pad": "x" * 200_000}) for i in range(8)]
    threads = [
        threading.Thread(target=loader.write_atomically, args=(target, lambda tmp, p=p: tmp.write_text(p)))
        for p in payloads
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_text() in payloads
    assert sorted(p.name for p in target.parent.iterdir()) == ["meta.json"]

    def fails(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        loader.write_atomically(target, fails)
    assert target.read_text() in payloads  # the old file stays whole, the temporary one is gone
    assert sorted(p.name for p in target.parent.iterdir()) == ["meta.json"]


class _Tokenizer:
    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, directory: str) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps({"by": self.name}))


def test_converted_tokenizer_is_renamed_into_place_and_the_first_copy_wins(tmp_path):
    cached = tmp_path / "tokenizers" / "0123"
    _save_atomically(_Tokenizer("first"), cached)
    _save_atomically(_Tokenizer("second"), cached)  # another worker finished converting meanwhile
    assert json.loads((cached / "tokenizer_config.json").read_text()) == {"by": "first"}
    assert sorted(p.name for p in cached.parent.iterdir()) == ["0123"]
