"""Acceptance 8: bad input gets a clear error that names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.models.loader import WeightMismatchError
from tests.test_random_models import make_model


@pytest.fixture
def llama_dir(tmp_path):
    return make_model(tmp_path, "LlamaForCausalLM")[1]


def test_unknown_architecture_lists_the_supported_ones(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'FooForCausalLM'.*Gemma3ForCausalLM.*LlamaForCausalLM"
    ):
        LLM(str(llama_dir), progress=False)


def test_missing_weights_are_listed(llama_dir):
    f = llama_dir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, f)
    with pytest.raises(
        WeightMismatchError, match=r"missing weights \(2\): model.layers.1.mlp.up_proj.weight, model.norm.weight"
    ):
        LLM(str(llama_dir), progress=False)


def test_unexpected_and_misshapen_weights_are_listed(llama_dir):
    f = llama_dir / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    tensors["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    save_file(tensors, f)
    with pytest.raises(WeightMismatchError) as err:
        LLM(str(llama_dir), progress=False)
    msg = str(err.value)
    assert "unexpected weights (1): model.layers.0.mlp.extra.weight" in msg
    assert "model.layers.2.self_attn.k_proj.weight: expected [32, 64], found [5, 64]" in msg


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        LLM("/nonexistent/model", progress=False)


def test_prompt_longer_than_max_model_len(llama_dir):
    llm = LLM(str(llama_dir), progress=False, max_model_len=32)
    with pytest.raises(ValueError, match="40 tokens.*max_model_len=32"):
        llm.generate([{"prompt_token_ids": [1] * 40}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 256\)"):
        llm.generate([{"prompt_token_ids": [1, 999]}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams(max_tokens=4))
    assert llm.engine.kv.all_free() and not llm.engine.has_unfinished_requests()


def test_kv_budget_too_small_for_max_model_len(llama_dir):
    with pytest.raises(ValueError, match="max_model_len=128 needs"):
        LLM(str(llama_dir), progress=False, num_kv_blocks=4, block_size=16, max_model_len=128)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {field}="):
        SamplingParams(**kwargs)


def test_unknown_engine_setting():
    with pytest.raises(TypeError, match="unknown engine setting 'blocksize'"):
        LLM("smollm2-135m", blocksize=16)
