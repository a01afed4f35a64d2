"""GLM-5.3-Flash (KDA with a lower-bounded gate + NoPE MLA with a pooled sparse-attention indexer +
hyper-connections + clamped SwiGLU), served from a Glm5NextForConditionalGeneration checkpoint as
text: a tiny random model matches transformers' full forward at prompts shorter and several
times longer than index_topk, in one shot and in chunks that are not multiples of index_kpool or
of the block; its pooled-indexer selection is the reference's; decodes, prefix hits (long
prompts, shared prefixes, a chat's second turn), a PD import at every n mod kpool, and n-gram
speculation whose rejected drafts cross pool boundaries all give the cold engine's tokens."""

from __future__ import annotations

import random

import pytest
import torch
import xxhash

from baton import LLM, SamplingParams
from baton.handoff.errors import InvalidKVImport
from baton.kv.manager import hash_block
from tests.test_handoff import prefill_output, repack, run_imported
from tests.test_spec_decode import _all_free, _loops

TOPK, POOL = 8, 4
TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=8,  # KDA 0-2, MLA 3, KDA 4-6, MLA 7
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=0,
    v_head_dim=16,
    qk_nope_head_dim=16,
    index_topk=TOPK,
    index_head_dim=32,
    index_n_heads=16,  # few heads tie ReLU zeros and a block's top-k differs from a row's
    index_kpool=POOL,
    linear_head_dim=16,
    linear_num_heads=2,
    hc_mult=4,
    pad_token_id=None,
    mlp_layer_types=["dense"] + ["sparse"] * 7,
    max_position_embeddings=4096,
    swiglu_limit=1.5,  # low enough that the clamp bites at this scale
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
PROMPT = torch.randint(2, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """(reference, directory): weights at O(1) scale (the pooling gate and ape too: their default
    init makes every pool's softmax uniform), so a wrong term shows."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    path = tmp_path_factory.mktemp("flash")
    torch.manual_seed(0)
    ref = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TEXT, vision_config=VISION)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "visual" in name or name.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(("hc.base", "hc.scale")) or "conv1d" in name or "compress_ape" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    ref.save_pretrained(path)
    return ref, path


def _llm(path, chunk: int = 2048, **kw) -> LLM:
    args = dict(progress=False, block_size=16, max_num_batched_tokens=chunk, kv_cache_memory_bytes=64 << 20)
    return LLM(str(path), **{**args, **kw})


def _reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def _reference_greedy(ref, ids: list[int], new: list[int]) -> list[int]:
    logits = _reference_logits(ref, ids + new)
    return [logits[len(ids) - 1 + i].argmax().item() for i in range(len(new))]


@pytest.mark.parametrize("length", [TOPK - 3, len(PROMPT)])
@pytest.mark.parametrize("chunk", [2048, 13])
def test_prompt_logits_match_reference(flash, length, chunk):
    ref, path = flash
    ids = PROMPT[:length]
    expected = _reference_logits(ref, ids)
    got = _llm(path, chunk).prompt_logits({"prompt_token_ids": ids})
    assert got.shape == expected.shape
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4


def test_pooled_indexer_selects_the_reference_tokens(flash):
    """Each MLA layer's pooled selection (top pools and the open pool's tail) equals transformers'
    wherever the chosen and the next pool's scores are apart."""
    ref, path = flash
    model = _llm(path).engine.model
    t = 61
    gen = torch.Generator().manual_seed(2)
    x, q_resid = torch.randn(t, 64, generator=gen), torch.randn(t, 32, generator=gen)
    checked = 0
    for i, layer in enumerate(model.layers):
        ours = getattr(layer.self_attn, "indexer", None)
        if ours is None:
            continue
        theirs = ref.model.language_model.layers[i].self_attn.indexer
        with torch.no_grad():
            expected = theirs(x[None], q_resid[None], torch.ones(1, t, dtype=torch.bool), None)[0]
        raw = torch.cat((ours.k_norm(ours.wk(x)), ours.index_kpool_compress_gate(x)), dim=-1)
        pools = raw[: t // POOL * POOL].view(t // POOL, POOL, -1)
        keys, gates = pools.split(ours.dim, dim=-1)
        pooled = ((gates + ours.index_kpool_compress_ape).softmax(dim=1) * keys).sum(dim=1)
        q, w = ours.queries(x, q_resid, None)
        pos = torch.arange(t)
        mask = ours._mask(q, w, pooled, pos, t)
        scores = ours.scores(q, w, pooled)
        for row in range(t):
            visible = (row + 1) // POOL
            want = set(expected[row][expected[row] >= 0].tolist())
            if visible > TOPK // POOL:
                ranked = scores[row, :visible].sort(descending=True).values
                if ranked[TOPK // POOL - 1] - ranked[TOPK // POOL] <= 1e-4 * ranked[0].abs():
                    continue
                checked += 1
            assert set(mask[row].nonzero().flatten().tolist()) == want, (i, row)
    assert checked >= 40


def test_decode_and_prefix_hits(flash):
    """Greedy decode at the reference's tokens; the same 600-token prompt twice hits 576+ (block
    16); a shared 200-token prefix hits 192+; a chat's second turn hits the first turn and its
    answer to a block; outputs equal a cold engine's."""
    ref, path = flash
    rng = random.Random(3)
    llm = _llm(path, 256)
    long = [rng.randrange(256) for _ in range(600)]
    first = llm.generate([{"prompt_token_ids": long}], GREEDY)[0]
    assert first.outputs[0].token_ids == _reference_greedy(ref, long, first.outputs[0].token_ids)
    again = llm.generate([{"prompt_token_ids": long}], GREEDY)[0]
    assert again.num_cached_tokens >= 576 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # a shared 200-token prefix hits its last block from the second request on: this model's KDA
    # state is small beside its KV, so the default checkpoint grid is a few blocks
    assert llm.engine.kv.checkpoint_interval < 256
    prefix = [rng.randrange(256) for _ in range(200)]
    a, b, c = (prefix + [rng.randrange(256) for _ in range(30 + i)] for i in range(3))
    out_a, out_b, out_c = (llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in (a, b, c))
    assert out_b.num_cached_tokens >= 192 and out_c.num_cached_tokens >= 192
    turn1 = [rng.randrange(256) for _ in range(90)]
    answer = llm.generate([{"prompt_token_ids": turn1}], GREEDY)[0].outputs[0].token_ids
    turn2 = turn1 + answer + [rng.randrange(256) for _ in range(25)]
    out_2 = llm.generate([{"prompt_token_ids": turn2}], GREEDY)[0]
    assert out_2.num_cached_tokens >= (len(turn1) + len(answer) - 1) // 16 * 16
    cold = _llm(path, 256).generate([{"prompt_token_ids": p} for p in (a, b, c, turn2)], GREEDY)
    assert [o.outputs[0].token_ids for o in cold] == [o.outputs[0].token_ids for o in (out_a, out_b, out_c, out_2)]
    # decodes of unlike lengths in one step: one sees fewer keys than index_topk, one many more
    prompts = [PROMPT[:5], PROMPT[13:64]]
    for p, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)):
        assert o.outputs[0].token_ids == _reference_greedy(ref, p, o.outputs[0].token_ids)
    assert llm.engine.kv.all_free()


def _pooled_block_bytes(llm: LLM, ids: list[int]) -> list[str]:
    """Checksums of the cached pooled-key blocks of `ids`' full blocks, per pooled group."""
    kv, storage = llm.engine.kv, llm.engine.storage
    bs, sums = kv.block_size, []
    for g in kv.spec.groups:
        if not g.kind.is_pooled:
            continue
        rows, parent = g.rows_per_block(bs), None
        for i in range(len(ids) // bs):
            tokens = tuple(ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens, b"")
            block = kv.pools[g.group_id].lookup(h, parent, tokens)
            assert block is not None
            data = storage.group_view(g.group_id)[0][:, block * rows : (block + 1) * rows]
            sums.append(xxhash.xxh64(data.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
            parent = h
    return sums


def test_cached_indexer_blocks_keep_their_bytes(flash):
    """vllm #57477's failure: a cached prompt's pooled-key blocks keep their bytes through 50 other
    requests (some sharing its prefix, chunked mid-pool) and still give its tokens."""
    _, path = flash
    llm = _llm(path, 23)
    rng = random.Random(4)
    ids = [rng.randrange(256) for _ in range(130)]
    first = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    before = _pooled_block_bytes(llm, ids)
    others = [
        ids[: rng.randrange(10, 120)] + [rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(50)
    ]
    llm.generate(
        [{"prompt_token_ids": p} for p in others], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert _pooled_block_bytes(llm, ids) == before
    again = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert again.num_cached_tokens == 128 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.kv.all_free()


@pytest.mark.parametrize("decode_args", [{"block_size": 32, "kv_layout": "HND"}, {"block_size": 8}])
def test_handoff_at_every_pool_offset_gives_the_lone_workers_tokens(flash, decode_args):
    """The span carries the latents, the complete pools and the open pool's rows (as state at n);
    a worker of another block size or layout decodes the lone worker's tokens for n mod kpool in
    {0, 1, kpool - 1}; a span whose pool count is off is refused before any write."""
    _, path = flash
    prefill = _llm(path, 13)
    decode = _llm(path, **decode_args)
    for n in (48, 49, 51, 7):  # n mod kpool: 0, 1, kpool - 1; and shorter than index_topk
        ids = PROMPT[:n]
        lone = decode.generate([{"prompt_token_ids": ids}], GREEDY)[0]
        out = run_imported(decode, ids, prefill_output(prefill, ids).kv_span, GREEDY)
        assert out.outputs[0].token_ids == lone.outputs[0].token_ids, (decode_args, n)
        assert decode.engine.kv.all_free()


def test_ngram_drafts_across_pool_boundaries_are_exact(flash):
    """Rejected drafts that completed a pool leave neither pooled rows nor open-pool rows behind:
    greedy output with speculation is the output without it, batched, chunked, under preemption."""
    _, path = flash
    config = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1}
    prompts = _loops(5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params)]
    on = _llm(path, speculative_config=config)
    assert [o.outputs[0].token_ids for o in on.generate(prompts, params)] == expected
    spec = on.engine.spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens > spec.num_accepted_tokens  # some were rejected
    assert _all_free(on)
    chunked = _llm(path, 15, speculative_config=config)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == expected and _all_free(chunked)


def test_spans_with_wrong_pool_counts_or_open_pool_rows_are_refused_before_any_write(flash):
    _, path = flash
    prefill, decode = _llm(path), _llm(path, block_size=32)
    ids = PROMPT[:51]  # 12 pools and 3 open-pool rows
    blob = prefill_output(prefill, ids).kv_span
    secret = decode.engine.handoff.secret
    spec = decode.engine.kv_spec
    pooled = {g.layer_ids for g in spec.groups if g.kind.is_pooled}
    windows = {g.layer_ids for g in spec.state_groups if g.state_shapes == ((POOL - 1, 64),)}

    def tensor(h, sets, kind):
        return next(t for t in h["tensors"] if tuple(t["layer_ids"]) in sets and t["kind"] == kind)

    def one_pool_more(h):
        tensor(h, pooled, "k")["shape"][h["layout"].index("T")] += 1

    def one_open_row_less(h):
        tensor(h, windows, "state")["shape"][1] -= 1

    def no_open_rows(h):
        h["tensors"].remove(tensor(h, windows, "state"))

    def digest():
        e = decode.engine
        data = e.storage.k + [t for ts in e.states.running for t in ts]
        return [xxhash.xxh64(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for t in data]

    before = digest()
    for edit, field in ((one_pool_more, "shape"), (one_open_row_less, "shape"), (no_open_rows, "state")):
        with pytest.raises(InvalidKVImport) as err:
            decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=repack(blob, secret, edit))
        assert err.value.field == field, str(err.value)
        assert digest() == before and decode.engine.kv.all_free()


def test_fused_step_refuses_bad_pool_metadata_before_any_write(flash):
    """The one-call decode step checks the pooled group's rows like any group's, with -1 (no pool
    completed) allowed there alone, before a byte of KV or state is written."""
    _, path = flash
    llm = _llm(path)
    llm.generate([{"prompt_token_ids": PROMPT[:20]}], GREEDY)
    decoder = llm.engine.model.fused_decoder._decoder
    e = llm.engine
    mla, pooled = (
        next(g for g in e.kv_spec.groups if pick(g.kind)) for pick in (lambda k: k.is_mla, lambda k: k.is_pooled)
    )
    rows = e.storage.group_view(pooled.group_id)[0].shape[1]

    def step(mla_slot: int, pool_row: int):
        """One decode row at position 19 (completing pool 4) over blocks [3, 4], state slot 0."""
        slots, blocks = [None, None], [None, None]
        for g, slot in ((mla, mla_slot), (pooled, pool_row)):
            slots[g.group_id], blocks[g.group_id] = torch.tensor([slot]), torch.tensor([[3, 4]])
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
        zeros, lens = [torch.tensor([0])] * 2, [torch.tensor([20])] * 2
        return decoder.forward(x, [], [], slots, blocks, zeros, lens, 16, [0], [], [], [])

    def digest() -> list[str]:
        data = e.storage.k + [t for ts in e.states.running for t in ts]
        return [xxhash.xxh64(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for t in data]

    before = digest()
    for mla_slot, pool_row, message in (
        (4 * 16 + 3, rows, rf"slot_mapping\[{pooled.group_id}\]\[0\] = {rows} is outside"),
        (4 * 16 + 3, -2, rf"slot_mapping\[{pooled.group_id}\]\[0\] = -2 is outside"),
        (-1, 16, rf"slot_mapping\[{mla.group_id}\]\[0\] = -1 is outside"),
    ):
        with pytest.raises(RuntimeError, match=message):
            step(mla_slot, pool_row)
        assert digest() == before
    assert step(4 * 16 + 3, 4 * 4 + 0).isfinite().all()  # the good step runs, and writes
    assert digest() != before
