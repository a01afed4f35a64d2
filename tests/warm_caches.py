"""Fill baton's cache with the test models' weights (kept in their GGUF blocks, as the engine loads
them) and converted tokenizers, in one process (`make install`, beside the C++ ops build: nothing here
needs the ops), and fetch llama.cpp's sources (its converter makes tests/test_gguf_hybrids.py's files).
Gemma3's tokenizer and weights take over a minute to convert; without this, on a fresh
machine, every test process and server that starts before the first conversion is written would
convert the same files itself, all at once."""

import torch

from baton.config import EnvSettings
from baton.models.loader import load_model, resolve_model_path
from baton.tokenizer import load_tokenizer
from bench.peer_servers import llama_cpp_sources

if __name__ == "__main__":
    cache_dir = EnvSettings.read().cache_dir
    for name in ("smollm2-135m", "gemma3-270m"):
        load_model(name, torch.float32, cache_dir, progress=False, keep_blocks=True)
        load_tokenizer(resolve_model_path(name), cache_dir)
    llama_cpp_sources(cache_dir)  # llama.cpp's converter, which makes the hybrid GGUF tests' files
