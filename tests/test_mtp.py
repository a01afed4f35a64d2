"""GLM-4-MoE with its multi-token-prediction layer on a random-weight config: the model against
transformers' full forward, the MTP drafts against transformers' own MtpModel (the drafter of
`generate(..., use_mtp=True)`), and speculation on it exact under batching, chunked prefill,
prefix hits and preemption, with every prefix-cache hit kept."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.spec_decode.mtp import MtpProposer
from tests.test_handoff import prefill_span, run_imported

GLM = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
    max_position_embeddings=512,
    num_nextn_predict_layers=1,
    use_qk_norm=True,
    attention_bias=True,
)
MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(transformers' model with its MtpModel, the checkpoint directory). The checkpoint carries
    an MTP layer as GLM-4.5's do: layer num_hidden_layers with enorm, hnorm, eh_proj, a decoder
    layer, shared_head.norm, and its own copies of the embedding and the head."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    from transformers.modeling_layers import MtpModel

    path = tmp_path_factory.mktemp("glm4-moe")
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**GLM)).eval()
    with torch.no_grad():  # visible norms, biases and routing biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name, w in list(weights.items()):
        if name.startswith("model.layers.2."):
            weights[name.replace("layers.2.", "layers.3.")] = w + torch.randn(w.shape, generator=g) * 0.05
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"model.layers.3.{norm}.weight"] = 1 + torch.randn(64, generator=g) * 0.1
    weights["model.layers.3.eh_proj.weight"] = torch.randn(64, 128, generator=g) * 0.08
    weights["model.layers.3.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.layers.3.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    # transformers finds MTP weights by GLM-4.5's layer numbers (46, 92); this config's is 3
    original = Glm4MoeForCausalLM._keys_to_ignore_on_load_unexpected
    Glm4MoeForCausalLM._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    try:
        ref = Glm4MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        mtp = MtpModel.from_pretrained(ref).eval()
    finally:
        Glm4MoeForCausalLM._keys_to_ignore_on_load_unexpected = original
    return (ref, mtp), path


def _prompts(seed: int, lengths=(40, 70, 33)) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(n)]} for n in lengths]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _reference_draft(ref, mtp, tokens: list[int]) -> torch.Tensor:
    """transformers' MTP logits for the token after `tokens`: its layer over every position, fed
    the target's last hidden states (as MTPCandidateGenerator feeds it)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = ref(ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
        out = mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, len(tokens))[None], None, input_ids=ids[:, 1:])
        return mtp._project_to_logits(out)[0, -1]


def test_glm4_moe_matches_transformers(glm):
    (ref, _), path = glm
    llm = LLM(str(path), progress=False)
    ids = _prompts(0)[1]["prompt_token_ids"]
    got = llm.prompt_logits({"prompt_token_ids": ids})
    with torch.no_grad():
        expected = ref(torch.tensor([ids]), use_cache=False).logits[0]
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


def _record_drafts(monkeypatch, oracle: dict | None = None) -> list[tuple[list[int], torch.Tensor]]:
    """(tokens, the MTP logits of the first draft) of every proposal MtpProposer makes; with
    `oracle` (prompt -> its greedy output) the drafts it returns are the true continuation, so
    every one is accepted."""
    seen = []
    propose = MtpProposer.propose

    def recording(self, wanted):
        for req, _ in wanted:
            h = self.newest.get(req.request_id)
            if h is not None and self.valid.get(req.request_id) == req.num_tokens - 1:
                seen.append((list(req.token_ids), self.model.compute_logits(h[None])[0].float()))
        drafts = propose(self, wanted)
        if oracle is None:
            return drafts
        return [
            oracle[tuple(req.prompt_token_ids)][req.num_output_tokens :][: len(d)]
            for (req, _), d in zip(wanted, drafts)
        ]

    monkeypatch.setattr(MtpProposer, "propose", recording)
    return seen


def _check_drafts(glm, seen, count: int) -> None:
    """Every recorded first-draft distribution against transformers' (after hits too)."""
    (ref, mtp), _ = glm
    assert len(seen) >= count
    for tokens, logits in seen:
        expected = _reference_draft(ref, mtp, tokens)
        err = ((logits - expected).abs().max() / expected.abs().max()).item()
        assert err < 1e-4, f"MTP logits after {len(tokens)} tokens: relative error {err:.2e}"


def test_mtp_drafts_are_transformers_and_speculation_is_exact(glm, monkeypatch):
    _, path = glm
    prompts = _prompts(1)
    off = LLM(str(path), progress=False)
    expected = _tokens(off, prompts)
    seen = _record_drafts(monkeypatch)
    on = LLM(str(path), progress=False, speculative_config=MTP)
    assert _tokens(on, prompts) == expected  # batched, cold
    assert _tokens(on, prompts[::-1]) == expected[::-1]  # every prompt hits the prefix cache
    chunked = LLM(str(path), progress=False, max_num_batched_tokens=16, speculative_config=MTP)
    assert _tokens(chunked, prompts) == expected
    before = len(seen)
    ids = prompts[1]["prompt_token_ids"]  # PD: the span carries the MTP layer's slots
    assert run_imported(on, ids, prefill_span(on, ids), GREEDY).outputs[0].token_ids == expected[1]
    assert len(seen) > before  # drafted on the imported request (checked below with the rest)
    assert on.engine.kv.all_free() and chunked.engine.kv.all_free()
    _check_drafts(glm, seen, 30)


def test_accepted_drafts_keep_the_mtp_kv_right(glm, monkeypatch):
    """Drafts replaced by the true continuation are all accepted: the MTP layer then computes the
    pairs of several accepted tokens per step, and its next drafts must still be transformers'."""
    _, path = glm
    prompts = _prompts(2)
    off = LLM(str(path), progress=False)
    expected = _tokens(off, prompts)
    oracle = {tuple(p["prompt_token_ids"]): e for p, e in zip(prompts, expected)}
    seen = _record_drafts(monkeypatch, oracle)
    on = LLM(str(path), progress=False, speculative_config=MTP)
    assert _tokens(on, prompts) == expected
    spec = on.engine.spec
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 30
    small = LLM(str(path), progress=False, num_kv_blocks=9, max_model_len=112, speculative_config=MTP)
    assert _tokens(small, prompts) == expected
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.kv.all_free()
    _check_drafts(glm, seen, 30)


def test_prefix_hits_are_kept_with_mtp(glm):
    _, path = glm
    system = _prompts(3, (48,))[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": system + tail} for tail in ([1, 2, 3], [4, 5], [6])]
    off = LLM(str(path), progress=False)
    on = LLM(str(path), progress=False, speculative_config=MTP)
    hits_off = [o.num_cached_tokens for o in off.generate(prompts, GREEDY) + off.generate(prompts, GREEDY)]
    hits_on = [o.num_cached_tokens for o in on.generate(prompts, GREEDY) + on.generate(prompts, GREEDY)]
    assert hits_on == hits_off and sum(hits_on) > 0
    assert _tokens(on, prompts) == _tokens(off, prompts)


def test_drafts_are_those_of_transformers_generate_with_mtp(glm, monkeypatch):
    """transformers' `generate(..., use_mtp=True)` on the same checkpoint: the draft it proposes
    after each prefix is ours after that prefix."""
    from transformers import Glm4MoeForCausalLM
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    (ref, _), path = glm
    monkeypatch.setattr(Glm4MoeForCausalLM, "_keys_to_ignore_on_load_unexpected", [r"model\.layers\.3\..*"])
    theirs: dict[tuple[int, ...], tuple[int, float]] = {}
    get_candidates = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        if logits is not None and candidates.shape[1] > input_ids.shape[1]:
            top2 = logits[0, 0].topk(2).values
            theirs[tuple(input_ids[0].tolist())] = (int(candidates[0, input_ids.shape[1]]), float(top2[0] - top2[1]))
        return candidates, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", recording)
    prompt = _prompts(4, (30,))[0]["prompt_token_ids"]
    with torch.no_grad():
        generated = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, use_mtp=True)
    seen = _record_drafts(monkeypatch)
    on = LLM(str(path), progress=False, speculative_config=MTP)
    ours = on.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert ours.outputs[0].token_ids == generated[0, len(prompt) :].tolist()
    common = [(tokens, logits) for tokens, logits in seen if tuple(tokens) in theirs]
    assert len(common) >= 10
    for tokens, logits in common:
        draft, margin = theirs[tuple(tokens)]
        if margin > 1e-4:
            assert int(logits.argmax()) == draft, f"after {len(tokens)} tokens"


def test_mtp_drafts_run_as_one_call_with_the_bits_of_the_module_path(glm, monkeypatch):
    """GLM-4.5's MTP layer drafts through its own fused decoder (its block's steps, its head
    norm): the same draft distributions, drafts, acceptances and tokens as its module path."""
    _, path = glm
    prompts = _prompts(5)
    runs, seen_all = [], _record_drafts(monkeypatch)
    for fused in (True, False):
        start = len(seen_all)
        llm = LLM(str(path), progress=False, speculative_config=MTP, fused_decode=fused)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        decoder = llm.engine.model._mtp_decoders.get(0)
        assert (decoder is not None and decoder.steps > 10) == fused  # drafted by the C++ step, or not
        spec = llm.engine.spec
        seen = seen_all[start:]
        runs.append(([o.outputs[0].token_ids for o in outs], seen, spec.num_draft_tokens, spec.num_accepted_tokens))
        assert llm.engine.kv.all_free()
    (tokens, seen, drafted, accepted), (tokens_m, seen_m, drafted_m, accepted_m) = runs
    assert tokens == tokens_m and (drafted, accepted) == (drafted_m, accepted_m) and len(seen) == len(seen_m) > 10
    for (ids, logits), (ids_m, logits_m) in zip(seen, seen_m):
        assert ids == ids_m and torch.equal(logits, logits_m)  # bitwise
