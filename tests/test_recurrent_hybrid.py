"""Recurrent-state hybrids on a random Qwen3-Next (Gated DeltaNet + gated attention + MoE) and
Qwen3.5 (the same mixers, dense MLPs, its own checkpoint layout): parity with transformers' full
forward along every path, and prefix caching that hits."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.models.loader import WeightMismatchError
from tests.server_util import ServerProcess
from tests.test_random_models import make_model

QWEN3_NEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=4096,
)
QWEN3_5 = {k: v for k, v in QWEN3_NEXT.items() if "expert" not in k and "moe" not in k}  # dense MLPs
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3-next"), "Qwen3NextForCausalLM", **QWEN3_NEXT)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3.5"), "Qwen3_5ForCausalLM", **QWEN3_5)


BOTH = pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def _full_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids]), use_cache=False).logits[0]


def _tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def test_reference_runs_its_torch_fallback():
    for package in ("fla", "causal_conv1d", "mamba_ssm"):
        assert importlib.util.find_spec(package) is None, f"{package} would replace transformers' torch reference"


@pytest.mark.parametrize(  # Qwen3.5 differs from Qwen3-Next in its loading only: one chunking
    "family,chunk", [("qwen3_next", 1024), ("qwen3_next", 37), ("qwen3_next", 100), ("qwen3_5", 37)]
)
def test_prefill_logits_match_full_forward_at_every_position(family, chunk, request):
    ref, path = request.getfixturevalue(family)
    ids = _ids(150, 1)  # longer than 64, not a multiple of it
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=chunk)
    assert _rel(llm.prompt_logits({"prompt_token_ids": ids}), _full_logits(ref, ids)) < 1e-4


@BOTH
def test_decode_prefix_hit_and_batch_composition_keep_the_reference_tokens(family, request):
    ref, path = request.getfixturevalue(family)
    ids = _ids(150, 2)
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": ids}], params)[0]
    new = _tokens(first)
    full = _full_logits(ref, ids + new).log_softmax(-1)
    for i, (tok, entry) in enumerate(zip(new, first.outputs[0].logprobs)):
        assert tok == full[len(ids) - 1 + i].argmax().item()
        assert abs(entry[tok].logprob - full[len(ids) - 1 + i, tok].item()) < 1e-4
    # resumed from the state checkpoint at 144 (the prompt's last block boundary): same tokens
    again = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert again.num_cached_tokens == 144 and _tokens(again) == new
    assert [e[t].logprob for t, e in zip(new, again.outputs[0].logprobs)] == [
        e[t].logprob for t, e in zip(new, first.outputs[0].logprobs)
    ]
    # the same prompt inside a batch of others, some sharing its prefix, others not
    batch = [{"prompt_token_ids": p} for p in (_ids(90, 3), ids[:100] + _ids(30, 4), ids, _ids(200, 5))]
    outs = LLM(
        str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=97
    ).generate(batch, GREEDY)
    assert _tokens(outs[2]) == new
    assert llm.engine.kv.all_free()


def test_prefix_cache_hits_on_repeats_shared_system_prompts_and_chat_turns(qwen3_next):
    _, path = qwen3_next
    cold = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # the same 1,000-token prompt twice
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    prompt = {"prompt_token_ids": _ids(1000, 20)}
    outs = [llm.generate([prompt], params)[0] for _ in range(2)]
    assert outs[1].num_cached_tokens >= 976
    assert _tokens(outs[1]) == _tokens(cold.generate([prompt], params)[0])
    # a 300-token system prompt, then different 100-token suffixes, one at a time and 8 at once
    system = _ids(300, 21)
    prompts = [{"prompt_token_ids": system + _ids(100, 30 + i)} for i in range(10)]
    expected = [_tokens(o) for o in cold.generate(prompts, params)]
    for concurrency in (1, 8):
        llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
        outs = []
        for i in range(0, len(prompts), concurrency):
            outs += llm.generate(prompts[i : i + concurrency], params)
        assert all(o.num_cached_tokens >= 288 for o in outs[2:]), [o.num_cached_tokens for o in outs]
        assert [_tokens(o) for o in outs] == expected
        assert llm.engine.kv.all_free()
    # a chat: turn 2 resumes after turn 1's prompt and answer, rounded down to a block
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    turn1 = _ids(200, 40)
    answer = _tokens(llm.generate([{"prompt_token_ids": turn1}], SamplingParams(max_tokens=37, temperature=0.0))[0])
    turn2 = {"prompt_token_ids": turn1 + answer + _ids(50, 41)}
    out = llm.generate([turn2], params)[0]
    assert out.num_cached_tokens == (len(turn1) + len(answer) - 1) // 16 * 16
    assert _tokens(out) == _tokens(cold.generate([turn2], params)[0])


def test_server_reports_cached_tokens_and_state_metrics(qwen3_next):
    _, path = qwen3_next
    server = ServerProcess("--model", str(path), "--served-model-name", "q3n", "--block-size", "16")
    try:
        prompt = _ids(300, 70)
        url = f"{server.base_url}/v1/completions"
        for expected_cached in (0, 288):
            body = {"model": "q3n", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            usage = requests.post(url, json=body, timeout=60).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == expected_cached
        # a model without a tokenizer streams its token ids as they come, and the usage at the end
        body = {**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
        with requests.post(url, json=body, stream=True, timeout=60) as r:
            chunks = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: {")]
        parsed = [json.loads(c) for c in chunks]
        assert sum(len(c["choices"][0].get("token_ids") or []) for c in parsed if c["choices"]) == 3
        assert len([c for c in parsed if c["choices"]]) == 3  # one chunk per token
        assert parsed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
        # two hits of 288 tokens, each served by the full-attention group and the state group
        assert server.metric("baton_prefix_cache_group_hit_tokens_total") == 2 * 2 * 288
        assert server.metric("baton_prefix_cache_no_checkpoint_tokens_total") == 0
        assert server.metric("baton_state_checkpoints_used") >= 2
        assert server.metric("baton_state_slots_used") == 0
    finally:
        server.terminate()


def test_qwen3_5_refuses_a_bad_head_split_and_qwen3_next_projection_names(qwen3_5, tmp_path):
    _, path = qwen3_5
    bad = shutil.copytree(path, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "linear_num_value_heads": 3}))
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a positive multiple of .* \(2\)"):
        LLM(str(bad), progress=False)
    renamed = shutil.copytree(path, tmp_path / "renamed")
    tensors = load_file(renamed / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    tensors[name.replace("qkv", "qkvz")] = tensors.pop(name)
    save_file(tensors, renamed / "model.safetensors")
    with pytest.raises(WeightMismatchError, match=rf"missing weights \(1\): {name}.*unexpected weights \(1\)"):
        LLM(str(renamed), progress=False)


def test_qwen3_5_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """How Qwen publishes Qwen3.5 (Qwen3_5ForConditionalGeneration): the language model under
    model.language_model., a vision tower and MTP weights beside it (not read)."""
    import transformers

    from tests.test_random_models import SMALL

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    config = transformers.Qwen3_5Config(text_config={**SMALL, **QWEN3_5}, vision_config=vision)
    ref = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in tensors)
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, tmp_path / "model.safetensors")
    llm = LLM(str(tmp_path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=37)
    ids = _ids(150, 6)
    assert _rel(llm.prompt_logits({"prompt_token_ids": ids}), _full_logits(ref, ids)) < 1e-4
    new = _tokens(llm.generate([{"prompt_token_ids": ids}], GREEDY)[0])
    full = _full_logits(ref, ids + new)
    assert new == full[len(ids) - 1 : -1].argmax(-1).tolist()
