"""Acceptance 1: greedy tokens identical to transformers `generate`, prefill logits within 1e-4 (the
float GGUF kernel and float32 KV: transformers runs the dequantized float32 weights)."""

from __future__ import annotations

import pytest
import torch

from baton import SamplingParams
from tests.conftest import FLOAT, PROMPTS

NUM_TOKENS = 48


def _check_parity(llm, ref) -> None:
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert sum(700 <= len(p) <= 1500 for p in prompts) >= 2, [len(p) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            expected = ref.generate(
                torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
            ref_logits = ref(torch.tensor([ids])).logits[0].float()
        assert out.outputs[0].token_ids == expected, f"prompt of {len(ids)} tokens diverged"
        logits = llm.prompt_logits({"prompt_token_ids": ids})
        rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel < 1e-4, f"prompt of {len(ids)} tokens: relative logit error {rel:.2e}"


@pytest.mark.slow  # the default suite keeps its 12-minute budget; random-model parity stays in it
def test_smollm2_matches_transformers(smollm2_float, smollm2_ref):
    _check_parity(smollm2_float, smollm2_ref)


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma3_float, gemma3_ref):
    _check_parity(gemma3_float, gemma3_ref)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [7])
def test_gemma3_block_sizes(gemma3_ref, block_size):
    """A block size that divides nothing gives the same tokens."""
    from baton import LLM

    llm = LLM("gemma3-270m", progress=False, block_size=block_size, max_num_batched_tokens=256, **FLOAT)
    ids = llm.get_tokenizer().encode(PROMPTS[6])
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    with torch.no_grad():
        expected = gemma3_ref.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert out[0].outputs[0].token_ids == expected
