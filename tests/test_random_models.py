"""Acceptance 2: random-weight Qwen2, Qwen3, Mistral (window < prompt) and Llama (GQA, untied)
match transformers' logits, read from an HF directory of safetensors."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make_model(tmp_path, arch: str, **overrides):
    """Save a seeded random transformers model; return (reference model, directory)."""
    import transformers

    model_cls = getattr(transformers, arch)
    # the text model's config where the family also has a multimodal one (Qwen3.5)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "TextConfig"), None)
    if config_cls is not model_cls.config_class:
        config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    config = config_cls(**{**SMALL, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # visible norm and bias weights, so a mis-loaded one shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model, tmp_path


def rerandomized(ref, path, conv: str = "conv1d", router_bias: str | None = None):
    """(ref, path) with ref's weights re-randomised at O(1) scale and saved to path, so that every
    layer moves the logits: norms near 1, other vectors small, matrices at 1 / sqrt(fan-in), conv
    kernels (names holding `conv`) at 0.5; A_log, dt_bias and D keep HF's init (a recurrent decay);
    a router's bias buffer (named `router_bias`) set so it steers the expert choice."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                continue
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if conv in name else p.shape[-1] ** -0.5))
        for name, b in ref.named_buffers():
            if router_bias and name.endswith(router_bias):
                b.copy_(0.3 * torch.randn_like(b))
    ref.save_pretrained(path)
    return ref, path


CASES = {
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 8}),
    "llama-gqa-untied": ("LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama-mha-tied": ("LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen3-sliding-upper-layers": (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1, "layer_types": None},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_model_logits(tmp_path, case, monkeypatch):
    arch, overrides = CASES[case]
    ref, path = make_model(tmp_path, arch, **overrides)
    llm = LLM(str(path), progress=False, block_size=4, max_num_batched_tokens=7)
    ids = torch.randint(0, SMALL["vocab_size"], (21,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = llm.prompt_logits({"prompt_token_ids": ids})  # 21 tokens in chunks of 7 with 4-token blocks
    assert got.shape == expected.shape
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
    # Decode steps through the paged cache: each sampled token's logprob equals the reference's.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    completion = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    new = completion.token_ids
    with torch.no_grad():
        ref_lp = ref(torch.tensor([ids + new])).logits[0].log_softmax(-1)
    for i, (tok, entry) in enumerate(zip(new, completion.logprobs)):
        assert abs(entry[tok].logprob - ref_lp[len(ids) - 1 + i, tok].item()) < 1e-4
        assert tok == ref_lp[len(ids) - 1 + i].argmax().item()
    assert llm.engine.model.fused_decoder is not None  # the decode steps ran as one C++ call
    # ... with the bits of the module-by-module path
    monkeypatch.setattr(llm.engine.model, "fused_decode", False)
    unfused = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    assert unfused.token_ids == new
    assert [e[t].logprob for t, e in zip(new, unfused.logprobs)] == [
        e[t].logprob for t, e in zip(new, completion.logprobs)
    ]
    assert llm.engine.kv.all_free()


def test_bfloat16_checkpoint_served_in_float32_warns_once(tmp_path, caplog):
    ref, path = make_model(tmp_path, "LlamaForCausalLM")
    ref.to(torch.bfloat16).save_pretrained(path)
    with caplog.at_level("WARNING"):
        llm = LLM(str(path), progress=False, dtype="float32")
    warnings = [r.message for r in caplog.records if "converting" in r.message]
    assert len(warnings) == 1 and "bfloat16" in warnings[0] and "float32" in warnings[0]
    ids = list(range(1, 12))
    with torch.no_grad():
        expected = ref.float()(torch.tensor([ids])).logits[0]
    assert (llm.prompt_logits({"prompt_token_ids": ids}) - expected).abs().max() / expected.abs().max() < 1e-4


def test_bfloat16_compute_and_bfloat16_kv_cache(tmp_path):
    ref, path = make_model(tmp_path, "Qwen3ForCausalLM", head_dim=32)
    ids = list(range(3, 30))
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    for settings in ({"dtype": "bfloat16"}, {"dtype": "float32", "kv_cache_dtype": "bfloat16"}):
        llm = LLM(str(path), progress=False, block_size=4, max_num_batched_tokens=8, **settings)
        got = llm.prompt_logits({"prompt_token_ids": ids})
        assert got.dtype == torch.float32
        assert (got - expected).abs().max() / expected.abs().max() < 3e-2, settings
        assert llm.engine.storage.dtype == torch.bfloat16
