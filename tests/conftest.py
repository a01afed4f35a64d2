"""Shared fixtures: the real test models (baton and the transformers reference) load once per session."""

from __future__ import annotations

import os
import random

import pytest
import torch

from baton import LLM
from baton.bench.hf_export import export_hf_dir


def pytest_configure(config) -> None:
    """Async test cases (langchain-tests' suite has them) run under pytest-asyncio, which the
    `clients` extra installs; its auto mode takes them without a mark in the suite's code."""
    if config.pluginmanager.hasplugin("asyncio"):
        config.option.asyncio_mode = "auto"


# `make test` runs the files in two processes, one per core, with BATON_NUM_THREADS=1 (and
# OMP_NUM_THREADS=1) set: each computes on one thread, and so do the servers and ranks it starts
# (they inherit the environment). Run alone, a test has both cores.
THREADS = int(os.environ.setdefault("BATON_NUM_THREADS", "2"))
torch.set_num_threads(THREADS)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    subjects = ["The engineer", "A small cat", "The river", "Our team", "The old library", "A train", "The market"]
    verbs = ["watched", "carried", "described", "measured", "followed", "painted", "counted"]
    objects = ["the morning light", "three red boxes", "a quiet song", "the long road", "every number", "the harbor"]
    tails = ["before noon.", "with care.", "for the third time.", "near the station.", "and then rested."]
    return " ".join(
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}" for _ in range(n)
    )


PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a list of the planets of the solar system, in order from the sun:",
    "Translate to French: 'The weather is nice today.'\nFrench:",
    "1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a village at the edge of a forest, there lived",
    _words(1, 85) + " In summary,",  # ~820 tokens: longer than Gemma3's 512-token window
    _words(2, 130) + " The next day,",  # ~1,260 tokens
]


def reference_model(name: str):
    """transformers' own model on the same GGUF weights (exported once to an HF directory)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(export_hf_dir(name)), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    return LLM("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def gemma3() -> LLM:
    return LLM("gemma3-270m", progress=False)


# The float GGUF kernel and a float32 KV cache compute with the gguf package's float32 weights bit
# for bit, as the transformers reference does; the defaults (int8 kernel, float16 KV, as llama.cpp)
# quantize activations and KV (their fidelity is bench/quant_quality.py's KL, their invariances
# tests/test_batching.py's).
FLOAT = dict(quant_kernel="float", kv_cache_dtype="float32")


@pytest.fixture(scope="session")
def smollm2_float() -> LLM:
    return LLM("smollm2-135m", progress=False, **FLOAT)


@pytest.fixture(scope="session")
def gemma3_float() -> LLM:
    return LLM("gemma3-270m", progress=False, **FLOAT)


@pytest.fixture(scope="session")
def smollm2_ref():
    return reference_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_ref():
    return reference_model("gemma3-270m")
