"""Tensor and pipeline parallel over gloo ranks on this host give one rank's greedy tokens, and
logits within 1e-4 of it (sums in another order are the only difference: the row-parallel
all-reduce, a prefill chunk cut into micro-batches), for the shipped models and random attention,
MoE and hybrid configs; on the integer GGUF kernels, where each rank's share of a row-parallel K
is a whole number of its parts, one rank's bits."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys

import pytest
import torch

from baton import LLM, SamplingParams
from baton.parallel.shard import even_split, head_split
from tests.test_mtp import GLM
from tests.test_random_models import make_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a long story about a lighthouse keeper. " * 12,
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_head_split_takes_whole_kv_groups_or_replicates_kv_heads():
    assert [head_split(9, 3, 2, r) for r in range(2)] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    assert [head_split(4, 1, 2, r) for r in range(2)] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    assert [head_split(8, 2, 4, r) for r in range(4)] == [
        (range(0, 2), range(0, 1)),
        (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)),
        (range(6, 8), range(1, 2)),
    ]
    assert [even_split(10, 3, r) for r in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    with pytest.raises(ValueError, match="do not split"):
        head_split(6, 2, 4, 0)


def _run(model: str, layout: tuple[int, int], prompts: list, **settings):
    tp, pp = layout
    llm = LLM(model, progress=False, tensor_parallel_size=tp, pipeline_parallel_size=pp, **settings)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        logits = [llm.prompt_logits(p) for p in prompts[:2]]
        fused = llm.engine.model.fused_decoder is not None  # built by the first decode-only step it takes
        return [list(o.outputs[0].token_ids) for o in outs], logits, fused
    finally:
        llm.shutdown()


def _same(model: str, prompts: list, layouts=((2, 1), (1, 2)), fused: bool = True, **settings) -> None:
    """`fused`: the model has a fused decode step, so the check below is not vacuous."""
    tokens1, logits1, fused1 = _run(model, (1, 1), prompts, **settings)
    assert fused1 == fused
    for layout in layouts:
        tokens, logits, fused_here = _run(model, layout, prompts, **settings)
        assert tokens == tokens1, layout
        assert fused_here == fused1, layout  # the fused decode step runs per rank and per pipeline stage
        for a, b in zip(logits1, logits):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.slow  # 28 s; the default suite's TP and PP parity: the random Llama below
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_shipped_models_tp2_and_pp2_match_one_rank(model):
    # SmolLM2's 3 KV heads split 2 / 1 over two ranks: its o_proj shares cut the integer kernels' K
    # parts, and int8's codes (and float16 KV's rounding) turn the last-bit difference into more;
    # the float kernel's on float32 KV stays small
    settings = dict(quant_kernel="float", kv_cache_dtype="float32") if model == "smollm2-135m" else {}
    _same(model, PROMPTS, max_model_len=1024, **settings)


def _logits_and_tokens(path: str, ids: list, **settings) -> tuple[list[torch.Tensor], list[list[int]]]:
    with LLM(path, progress=False, **settings) as llm:
        outs = llm.generate(ids, GREEDY, use_tqdm=False)
        return [llm.prompt_logits(p) for p in ids], [list(o.outputs[0].token_ids) for o in outs]


def test_int8_kernels_give_one_ranks_bits_over_two_ranks(tmp_path):
    """A float checkpoint quantized to Q8_0 blocks at load, on the integer kernels: two ranks' row-
    parallel shares hold whole K parts and their sums are added in the parts' tree, so the logits
    are one rank's bits, not merely close (tests/test_quant_linear.py has the kernel's side)."""
    _, path = make_model(tmp_path, "LlamaForCausalLM", hidden_size=256, intermediate_size=512, num_key_value_heads=2)
    ids = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in (6, 45)]  # fmt: skip
    settings = dict(quantization="q8_0", quant_kernel="int8", block_size=8, kv_cache_memory_bytes=16 << 20)
    logits1, tokens1 = _logits_and_tokens(str(path), ids, **settings)
    logits2, tokens2 = _logits_and_tokens(str(path), ids, tensor_parallel_size=2, **settings)
    assert tokens2 == tokens1
    assert all(torch.equal(a, b) for a, b in zip(logits1, logits2))


@pytest.mark.slow  # 16-19 s: two ranks of a model built for it
def test_random_llama_with_fewer_kv_heads_than_ranks(tmp_path):
    _, path = make_model(tmp_path, "LlamaForCausalLM", num_key_value_heads=1, tie_word_embeddings=False)
    ids = [
        {"prompt_token_ids": torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
        for n in (5, 40, 90)
    ]
    _same(str(path), ids, block_size=4, max_num_batched_tokens=32)


@pytest.mark.slow
def test_random_glm_moe_experts_split_over_ranks(tmp_path):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    config = {**GLM, "num_nextn_predict_layers": 0}
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    ids = [
        {"prompt_token_ids": torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
        for n in (7, 33, 70)
    ]
    _same(str(tmp_path), ids, block_size=4, max_num_batched_tokens=32)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"])
def test_random_qwen3_next_hybrid_with_prefix_hits(tmp_path, arch):
    """Gated DeltaNet split by key heads, gated attention by heads, MoE experts by rank (Qwen3.5:
    dense MLPs); the second round resumes from recurrent checkpoints (the driver's restores
    replayed per rank)."""
    from tests.test_recurrent_hybrid import QWEN3_5, QWEN3_NEXT

    _, path = make_model(tmp_path, arch, **(QWEN3_NEXT if arch == "Qwen3NextForCausalLM" else QWEN3_5))
    base = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    ids = [{"prompt_token_ids": p} for p in (base[:9], base, base[:40] + [1, 2, 3])]
    results = []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(
            str(path),
            progress=False,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            block_size=8,
            max_num_batched_tokens=32,
        )
        try:
            first = llm.generate(ids, GREEDY, use_tqdm=False)
            again = llm.generate(ids[1:], GREEDY, use_tqdm=False)  # prefix hits on checkpoints
            assert all(o.num_cached_tokens > 0 for o in again)
            results.append(([list(o.outputs[0].token_ids) for o in first + again], llm.prompt_logits(ids[1])))
        finally:
            llm.shutdown()
    for tokens, logits in results[1:]:
        assert tokens == results[0][0]
        torch.testing.assert_close(logits, results[0][1], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_tp2_times_pp2_on_four_ranks(tmp_path):
    _, path = make_model(tmp_path, "LlamaForCausalLM", tie_word_embeddings=False)
    ids = [
        {"prompt_token_ids": torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
        for n in (5, 40, 90)
    ]
    _same(str(path), ids, layouts=((2, 2),), block_size=4, max_num_batched_tokens=32)


@pytest.mark.slow  # 18 s; the default suite hands a hybrid's KV between TP=1 and TP=2 below
@pytest.mark.parametrize("fmt", ["grouped", "dense"])
def test_pd_between_tp1_and_tp2_gives_the_lone_workers_tokens(fmt):
    """A TP=1 prefill's span imports into a TP=2 decoder (heads split on import) and a TP=2
    prefill's span (heads gathered on export) into a TP=1 decoder; both decode the lone worker's
    tokens. The TP=2 side also differs in block size and KV layout."""
    from tests.test_handoff import prefill_span, run_imported

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # the float kernel: SmolLM2's o_proj shares over two ranks cut the integer kernels' K parts
    one = LLM("smollm2-135m", progress=False, max_model_len=1024, quant_kernel="float")
    two = LLM(
        "smollm2-135m",
        progress=False,
        max_model_len=1024,
        tensor_parallel_size=2,
        block_size=32,
        kv_layout="HND",
        quant_kernel="float",
    )
    try:
        tok = one.get_tokenizer()
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            alone = list(one.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids)
            into_two = run_imported(two, ids, prefill_span(one, ids, fmt), params)
            assert list(into_two.outputs[0].token_ids) == alone
            into_one = run_imported(one, ids, prefill_span(two, ids, fmt), params)
            assert list(into_one.outputs[0].token_ids) == alone
        assert one.engine.prefills["remote"] == two.engine.prefills["remote"] == len(PROMPTS)
    finally:
        two.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["kimi-linear", "nemotron-h", "granite-4.0-h", "lfm2", "falcon-h1"])
def test_random_kimi_and_nemotron_split_by_head(tmp_path, family):
    """Kimi Linear (KDA by heads, MLA by heads over a replicated latent, grouped MoE),
    Nemotron-H (Mamba2 by head groups, NoPE attention, relu2 MLP and MoE) and Granite-4.0-H
    (Mamba2, fused-qkv attention, softmax MoE with a shared expert, scaled blocks) and LFM2 (short
    convolutions by channels) and Falcon-H1 (attention and Mamba2 side by side, each layer's KV and
    state kept by its stage) at TP=2 and PP=2."""
    from tests import test_falcon_h1, test_granite_hybrid, test_kimi_linear, test_lfm2, test_nemotron_h

    module = {
        "kimi-linear": test_kimi_linear,
        "nemotron-h": test_nemotron_h,
        "granite-4.0-h": test_granite_hybrid,
        "lfm2": test_lfm2,
        "falcon-h1": test_falcon_h1,
    }[family]
    _, path = module.build(tmp_path)
    ids = [
        {"prompt_token_ids": torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
        for n in (9, 70, 150)
    ]
    _same(str(path), ids, block_size=16, max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)


def test_pd_of_a_hybrid_between_tp1_and_tp2(tmp_path):
    """Qwen3-Next's span carries Gated DeltaNet state beside the attention KV: TP=2 exports it
    reassembled from both ranks' channels, and imports a TP=1 span as each rank's channels."""
    from tests.test_handoff import prefill_span, run_imported
    from tests.test_recurrent_hybrid import QWEN3_NEXT

    _, path = make_model(tmp_path, "Qwen3NextForCausalLM", **QWEN3_NEXT)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    settings = dict(progress=False, block_size=8, max_num_batched_tokens=32)
    one = LLM(str(path), **settings)
    two = LLM(str(path), **settings, tensor_parallel_size=2)
    try:
        for n in (5, 37):
            ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            alone = list(one.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids)
            assert list(run_imported(two, ids, prefill_span(one, ids), params).outputs[0].token_ids) == alone
            assert list(run_imported(one, ids, prefill_span(two, ids), params).outputs[0].token_ids) == alone
    finally:
        two.shutdown()


@pytest.mark.slow  # 46 s: two TP engines side by side (the default suite's servers take free ports too)
def test_parallel_engines_take_free_ports_and_give_them_back(tmp_path):
    """Two engines of two ranks on one host at once (one in another process, leaving its `with`
    block): no fixed port collides; and the one dropped without shutdown() releases its ranks and
    its port when it is collected."""
    _, path = make_model(tmp_path, "LlamaForCausalLM")
    ids = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    script = (
        "import sys; from baton import LLM, SamplingParams\n"
        f"with LLM({str(path)!r}, progress=False, tensor_parallel_size=2) as llm:\n"
        f"    out = llm.generate({ids!r}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))\n"
        "    print(list(out[0].outputs[0].token_ids)); sys.stdout.flush(); sys.stdin.read()\n"
    )
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = other.stdout.readline()
        first = LLM(str(path), progress=False, tensor_parallel_size=2)  # the other process holds its own port
        tokens = list(first.generate(ids, GREEDY)[0].outputs[0].token_ids)
        assert theirs.strip() == str(tokens)
        ranks, port = first.engine.ranks.procs, first.engine.ranks.config.parallel.master_port
        del first
        gc.collect()
        assert all(p.wait(timeout=30) == 0 for p in ranks)
        with socket.socket() as s:  # the collected engine's port is free again (for a listener, as ours are)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        other.communicate("", timeout=60)
    assert other.returncode == 0


@pytest.mark.slow  # 35 s a family; the default suite hands GLM-5.3-Flash's caches between TP=1 and TP=2 below
@pytest.mark.parametrize("family", ["glm5", "flash"])
def test_sparse_attention_models_at_tp2_and_pp2(tmp_path, family):
    """GLM-5 (its indexer replicated so every rank selects alike; a stage never starts at a layer
    that shares the selection before it) and GLM-5.3-Flash (KDA by heads, the pooled indexer and
    its caches replicated, the hyper-connection streams crossing the stage boundary), the fused
    decode step on every rank and stage."""
    from tests import test_dsa, test_glm5_flash

    if family == "glm5":
        _, path = test_dsa.build(tmp_path, "glm5")
    else:
        _, path = test_glm5_flash.flash.__wrapped__(_Factory(tmp_path))
    ids = [
        {"prompt_token_ids": torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
        for n in (9, 70, 150)
    ]
    _same(str(path), ids, block_size=16, max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)


class _Factory:
    """tmp_path_factory's one method, over a test's own directory."""

    def __init__(self, path) -> None:
        self.path = path

    def mktemp(self, name: str):
        return self.path


def test_pd_of_glm5_flash_between_tp1_and_tp2_and_fp8(tmp_path):
    """GLM-5.3-Flash's span (latents, complete pools, the open pool's rows and the KDA state) from
    TP=1 into TP=2 and back, and from float32 into an fp8 worker: the receiving worker's own tokens."""
    from tests import test_glm5_flash
    from tests.test_handoff import prefill_span, run_imported

    _, path = test_glm5_flash.flash.__wrapped__(_Factory(tmp_path))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    settings = dict(progress=False, block_size=16, max_num_batched_tokens=32, kv_cache_memory_bytes=64 << 20)
    one = LLM(str(path), **settings)
    two = LLM(str(path), **settings, tensor_parallel_size=2)
    fp8 = LLM(str(path), **{**settings, "block_size": 32}, kv_cache_dtype="fp8")
    try:
        for n in (37, 64, 67):
            ids = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            alone = list(one.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids)
            assert list(run_imported(two, ids, prefill_span(one, ids), params).outputs[0].token_ids) == alone
            assert list(run_imported(one, ids, prefill_span(two, ids), params).outputs[0].token_ids) == alone
            own = list(fp8.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids)
            assert list(run_imported(fp8, ids, prefill_span(one, ids), params).outputs[0].token_ids) == own
    finally:
        two.shutdown()
