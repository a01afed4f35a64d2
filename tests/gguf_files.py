"""GGUF files for the tests, made as a user makes them: a random-weight transformers checkpoint
(SmolLM2's tokenizer, which llama.cpp's converter knows) through llama.cpp's own
convert_hf_to_gguf.py (from the llama-cpp-python sdist, bench/peer_servers.py), and rewritten with
the gguf package where a test needs a quantized or a broken file."""

from __future__ import annotations

import atexit
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

from baton.config import EnvSettings
from baton.models.loader import resolve_model_path
from baton.tokenizer import load_tokenizer
from bench.gguf_rewrite import rewrite
from bench.peer_servers import llama_cpp_sources

VOCAB = 49152  # the converter wants the tokenizer's whole vocabulary in the embedding


def convert(hf_dir: Path, out: Path, *extra: str) -> Path:
    """hf_dir (with SmolLM2's tokenizer written into it) to an F32 GGUF by llama.cpp's converter."""
    cache = EnvSettings.read().cache_dir
    load_tokenizer(resolve_model_path("smollm2-135m"), cache).save_pretrained(str(hf_dir))
    rc, log = _converter(llama_cpp_sources(cache) / "convert_hf_to_gguf.py").run(
        [str(hf_dir), "--outtype", "f32", "--outfile", str(out), *extra]
    )
    if rc:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{log[-3000:]}")
    return out


# The converter's own main() over argv lines read from stdin, an answer line [rc, log tail] each: its
# imports (torch, transformers) cost ~9 s of a fresh process, paid once per test worker, not per file.
_SERVE = r"""
import json, logging, os, runpy, sys, traceback
script, log_path = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(script))
answers, sys.stdout = sys.stdout, sys.stderr
main = runpy.run_path(script, run_name="baton_converter")["main"]
for line in sys.stdin:
    sys.argv = [script, *json.loads(line)]
    sys.stderr.flush()
    log_start, rc = os.lseek(2, 0, os.SEEK_CUR), 0
    try:
        main()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        rc = 1
        traceback.print_exc()
    sys.stderr.flush()
    with open(log_path) as f:
        f.seek(log_start)
        log = f.read()
    answers.write(json.dumps([rc, log[-3000:]]) + "\n")
    answers.flush()
"""


class _Converter:
    def __init__(self, script: Path) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="convert-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(script), self.log.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        atexit.register(self.close)

    def run(self, argv: list[str]) -> tuple[int, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:  # the process died: what it logged says why
            with open(self.log.name) as f:
                return 1, f.read()
        rc, log = json.loads(line)
        return rc, log

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@functools.cache
def _converter(script: Path) -> _Converter:
    return _Converter(script)


def quantized(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """src's matrices whose width is whole blocks in `qtype` (gguf's quantizer), the rest as they are."""
    values = gguf.GGML_QUANT_SIZES[qtype][0]

    def quantize(name: str, data: np.ndarray, stored: gguf.GGMLQuantizationType):
        if data.ndim in (2, 3) and data.shape[-1] % values == 0 and stored.name == "F32":
            return gguf.quants.quantize(data, qtype), list(data.shape), qtype
        return data, list(data.shape), stored

    return rewrite(src, dst, tensor=quantize)
