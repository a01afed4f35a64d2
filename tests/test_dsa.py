"""DeepSeek Sparse Attention: DeepSeek-V3.2 (MLA with interleaved rotary and yarn, an indexer on
every layer, sigmoid-routed MoE) and GLM-5 (the indexer's rotary interleaved, "shared" layers
reusing the selection before them): tiny random models match transformers' full forward in prompt
logits at prompts shorter and several times longer than index_topk, along one-shot and chunked
prefill, greedy decode (batched, of unlike lengths) and a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.kv.memory import _bytes_per_token
from baton.kv.spec import KVSpec
from baton.models.dsa import layer_kinds
from tests.test_handoff import prefill_output, run_imported
from tests.test_random_models import make_model

TOPK = 8
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    index_topk=TOPK,
    index_head_dim=32,
    index_n_heads=16,  # few heads tie ReLU zeros and a block's top-k differs from a row's
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    pad_token_id=None,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
GLM5 = dict(  # layers full, full, shared, full
    TINY,
    num_hidden_layers=4,
    index_topk_freq=2,
    index_skip_topk_offset=2,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
ARCHS = {"v32": ("DeepseekV32ForCausalLM", TINY), "glm5": ("GlmMoeDsaForCausalLM", GLM5)}
PROMPT = torch.randint(2, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()  # 8.75 x index_topk


def build(tmp_path, name: str):
    """(reference, directory): weights re-randomised at O(1) scale, so a wrong term shows."""
    arch, config = ARCHS[name]
    ref, path = make_model(tmp_path, arch, **config)
    if name == "glm5":
        assert ref.config.indexer_types == ["full", "full", "shared", "full"]
    torch.manual_seed(0)
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for bname, b in ref.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    ref.save_pretrained(path)
    return ref, path


@pytest.fixture(scope="module")
def dsa_v32(tmp_path_factory):
    return build(tmp_path_factory.mktemp("v32"), "v32")


@pytest.fixture(scope="module")
def dsa_glm5(tmp_path_factory):
    return build(tmp_path_factory.mktemp("glm5"), "glm5")


@pytest.fixture(params=["dsa_v32", "dsa_glm5"])
def dsa(request):
    return request.getfixturevalue(request.param)


def _llm(path, chunk: int) -> LLM:
    return LLM(str(path), progress=False, block_size=16, max_num_batched_tokens=chunk, kv_cache_memory_bytes=64 << 20)


def _reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids]), use_cache=False).logits[0]


@pytest.mark.parametrize("length", [TOPK - 2, len(PROMPT)])
@pytest.mark.parametrize("chunk", [1024, 13])
def test_prompt_logits_match_reference(dsa, length, chunk):
    ref, path = dsa
    ids = PROMPT[:length]
    expected = _reference_logits(ref, ids)
    got = _llm(path, chunk).prompt_logits({"prompt_token_ids": ids})
    assert got.shape == expected.shape
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4


def test_greedy_decode_and_prefix_cache(dsa):
    ref, path = dsa
    llm = _llm(path, 32)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    new = out.outputs[0].token_ids
    logits = _reference_logits(ref, PROMPT + new)
    assert new == [logits[len(PROMPT) - 1 + i].argmax().item() for i in range(len(new))]
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == new
    # decodes of unlike lengths in one step: one sees fewer keys than index_topk, one many more
    prompts = [PROMPT[:5], PROMPT[20:61]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outs):
        got = o.outputs[0].token_ids
        logits = _reference_logits(ref, p + got)
        assert got == [logits[len(p) - 1 + i].argmax().item() for i in range(len(got))]
    assert llm.engine.kv.all_free()


def test_indexer_selects_the_reference_keys(dsa):
    """Each indexer layer's selection equals transformers' top-k wherever the k-th and (k+1)-th
    scores are apart (a tie may go either way in either)."""
    ref, path = dsa
    model = _llm(path, 1024).engine.model
    t = 48
    gen = torch.Generator().manual_seed(2)
    x, q_resid, pos = torch.randn(t, 64, generator=gen), torch.randn(t, 32, generator=gen), torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    checked = 0
    for i, layer in enumerate(model.layers):
        ours = layer.self_attn.indexer
        if ours is None:
            continue
        with torch.no_grad():
            expected = ref.model.layers[i].self_attn.indexer(
                x[None], q_resid[None], ref.model.rotary_emb(x[None], pos[None]), causal[None], pos[None]
            )[0]
        rope = model.rotary["full"](pos, torch.float32)
        q, w = ours.queries(x, q_resid, rope)
        keys = ours.keys(x, rope)
        chosen = ours.prefill_selection(q, w, keys, 0)
        ranked = ours.scores(q, w, keys).masked_fill(~causal, float("-inf")).sort(dim=-1, descending=True).values
        for row in range(TOPK, t):  # rows that see more than index_topk keys
            if ranked[row, TOPK - 1] - ranked[row, TOPK] > 1e-4 * ranked[row, 0].abs():
                assert set(chosen[row].nonzero().flatten().tolist()) == set(expected[row].tolist())
                checked += 1
        assert chosen[:TOPK].equal(causal[:TOPK])  # rows that see no more: every visible key
    assert checked >= 30


def test_kv_sizing_counts_indexer_keys():
    """A token's bytes: every layer's latent, the indexer layers' keys (GLM-5: three of four)."""
    spec = KVSpec.build(layer_kinds(GLM5), 1, 1, 16)
    assert [g.head_dim for g in spec.groups] == [24 + 32, 24]
    assert _bytes_per_token(spec, torch.float32) == {"mla": 4 * 24 * 4, "indexer": 3 * 32 * 4}


@pytest.mark.parametrize("decode_args", [{"block_size": 32, "kv_layout": "HND"}, {"block_size": 8}])
def test_handoff_between_unlike_workers_gives_the_lone_workers_tokens(dsa_glm5, decode_args):
    """The span carries latents and indexer keys; a worker of another block size or layout decodes
    the lone worker's tokens, at prompts shorter and longer than index_topk, off a block edge."""
    _, path = dsa_glm5
    prefill = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=13)
    decode = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, **decode_args)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for n in (TOPK - 1, 57):
        ids = PROMPT[:n]
        lone = decode.generate([{"prompt_token_ids": ids}], params)[0]
        out = run_imported(decode, ids, prefill_output(prefill, ids).kv_span, params)
        assert out.outputs[0].token_ids == lone.outputs[0].token_ids, (decode_args, n)
        assert decode.engine.kv.all_free()
    with pytest.raises(ValueError, match="dense span format holds one KV geometry"):  # indexer and shared rows differ
        prefill_output(prefill, PROMPT, "dense")
    assert prefill.engine.kv.all_free()
