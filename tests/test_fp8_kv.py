"""--kv-cache-dtype fp8: e4m3 codes with a power-of-two float32 scale per (block, KV head). Kernels
against torch's own float8_e4m3fn conversion; engines batch- and prefix-invariant on it; spans carry
codes and scales and convert to and from other KV dtypes on import; hostile fp8 spans refused."""

from __future__ import annotations

import json

import pytest
import torch

from baton import LLM, SamplingParams
from baton.handoff import wire
from baton.handoff.errors import InvalidKVImport
from baton.handoff.transfer import _slots
from baton.kv.storage import LayerKV
from baton.ops import paged_attention, read_kv_fp8, write_kv_fp8
from tests.conftest import _words
from tests.test_handoff import prefill_span, receiver_state, repack, run_imported

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def pow2_scale(amax: float) -> float:
    """The smallest power of two s with amax / s <= 448 (e4m3's largest finite value)."""
    if amax == 0:
        return 2.0**-100
    s = 2.0 ** torch.tensor(amax / 448, dtype=torch.float64).log2().ceil().item()
    return s if amax / s <= 448 else 2 * s


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).to(FP8)


def torch_fp8_writes(monkeypatch) -> None:
    """Make float caches store what an fp8 cache holds, computed with torch's e4m3 conversion and
    pow2_scale: valid for writes that start their blocks (the prefill of a whole prompt)."""
    original = LayerKV.write

    def write(self, slots, k, v, block_size, fresh=False):
        def fake(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            x, blocks = x.float().clone(), slots // block_size
            for b in blocks.unique():
                rows = blocks == b
                assert slots[rows][0] % block_size == 0, "a write that does not start its block"
                for h in range(x.shape[1]):
                    s = pow2_scale(x[rows, h].abs().max().item())
                    x[rows, h] = quantize(x[rows, h], s).float() * s
            return x

        original(self, slots, fake(k), fake(v), block_size, fresh)

    monkeypatch.setattr(LayerKV, "write", write)


def test_write_quantizes_each_block_and_head_as_torch_does():
    torch.manual_seed(0)
    bs, heads, dim, blocks = 16, 3, 64, 8
    cache = torch.zeros(blocks * bs, heads, dim, dtype=FP8)
    scales = torch.full((blocks, heads), 7.0)  # stale scales of blocks used before
    x = torch.randn(40, heads, dim) * torch.tensor([1e-5, 1.0, 3e4])[None, :, None]
    x[5:9, 1] = 0.0
    table = [5, 2, 7]  # 40 positions over three blocks
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(40)])
    write_kv_fp8(x, cache, scales, slots, bs, False)
    for b, block in enumerate(table):
        rows = slice(b * bs, min(40, (b + 1) * bs))
        for h in range(heads):
            s = pow2_scale(x[rows, h].abs().max().item())
            assert scales[block, h].item() == s, (block, h)
            want = quantize(x[rows, h], s).view(torch.uint8)
            assert torch.equal(cache[slots[rows], h].view(torch.uint8), want)
    got = read_kv_fp8(cache, scales, slots, bs)
    expect = torch.stack([cache[slots[t]].float() * scales[slots[t] // bs][:, None] for t in range(40)])
    assert torch.equal(got, expect)
    assert ((got - x).abs() <= x.abs() / 16 + 2.0**-9 * scales[slots // bs][..., None]).all()  # 3 mantissa bits


def test_a_larger_value_raises_the_scale_and_rescales_the_block_exactly():
    bs, dim = 8, 16
    cache = torch.zeros(2 * bs, 1, dim, dtype=FP8)
    scales = torch.zeros(2, 1)
    torch.manual_seed(1)
    first = torch.randn(3, 1, dim)
    write_kv_fp8(first, cache, scales, torch.arange(8, 11), bs, False)
    old = read_kv_fp8(cache, scales, torch.arange(8, 11), bs)
    big = torch.randn(1, 1, dim) * 50
    write_kv_fp8(big, cache, scales, torch.tensor([11]), bs, False)
    s = pow2_scale(max(first.abs().max().item(), big.abs().max().item()))
    assert scales[1, 0].item() == s
    assert torch.equal(cache[8:11].view(torch.uint8), quantize(old, s).view(torch.uint8))  # from the cached values
    assert torch.equal(cache[11].view(torch.uint8), quantize(big[0], s).view(torch.uint8))
    small = torch.full((1, 1, dim), 0.5)  # a smaller value leaves the scale
    write_kv_fp8(small, cache, scales, torch.tensor([12]), bs, False)
    assert scales[1, 0].item() == s
    # a run starting a block, or any run when fresh, forgets the block's old scale
    write_kv_fp8(small, cache, scales, torch.tensor([8]), bs, False)
    assert scales[1, 0].item() == pow2_scale(0.5)
    write_kv_fp8(big, cache, scales, torch.tensor([13]), bs, False)
    write_kv_fp8(small, cache, scales, torch.tensor([13]), bs, True)
    assert scales[1, 0].item() == pow2_scale(0.5)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_attention_reads_codes_times_scales(layout):
    torch.manual_seed(2)
    bs, kv_heads, heads, dim, blocks = 16, 2, 6, 64, 6
    shape = (blocks * bs, kv_heads, dim) if layout == "NHD" else (kv_heads, blocks * bs, dim)
    k_cache, v_cache = (torch.zeros(shape, dtype=FP8) for _ in range(2))
    if layout == "HND":
        k_cache, v_cache = k_cache.transpose(0, 1), v_cache.transpose(0, 1)
    k_scale, v_scale = torch.zeros(blocks, kv_heads), torch.zeros(blocks, kv_heads)
    slots = torch.arange(bs, 5 * bs)
    write_kv_fp8(torch.randn(64, kv_heads, dim) * 4, k_cache, k_scale, slots, bs, False)
    write_kv_fp8(torch.randn(64, kv_heads, dim) * 0.01, v_cache, v_scale, slots, bs, False)
    q = torch.randn(2, heads, dim)
    table = torch.tensor([[1, 2, 3, 4], [4, 2, 0, 0]])
    offsets, lens = torch.tensor([3, 0]), torch.tensor([61, 20])
    out = paged_attention(q, k_cache, v_cache, table, offsets, lens, bs, 0.125, (k_scale, v_scale))
    for s in range(2):
        pos = torch.arange(offsets[s], offsets[s] + lens[s])
        at = table[s][pos // bs] * bs + pos % bs
        k = read_kv_fp8(k_cache, k_scale, at, bs).repeat_interleave(3, 1)
        v = read_kv_fp8(v_cache, v_scale, at, bs).repeat_interleave(3, 1)
        ref = torch.einsum("ht,thd->hd", torch.einsum("hd,thd->ht", q[s], k).mul(0.125).softmax(-1), v)
        torch.testing.assert_close(out[s], ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="needs its k and v scales"):
        paged_attention(q, k_cache, v_cache, table, offsets, lens, bs, 0.125)


@pytest.fixture(scope="module")
def smollm2_fp8(smollm2) -> LLM:
    return LLM("smollm2-135m", progress=False, kv_cache_dtype="fp8")


def _tokens(llm: LLM, prompts: list, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_fp8_cache_holds_a_byte_per_value_and_is_batch_and_prefix_invariant(smollm2, smollm2_fp8):
    blocks, blocks_fp8 = smollm2.engine.kv.pools[0].num_blocks, smollm2_fp8.engine.kv.pools[0].num_blocks
    width = smollm2.engine.storage.dtype.itemsize  # the default cache's bytes per value (float16: 2)
    # 1 byte per value, plus a float32 K and V scale per block and head
    assert 0.97 * width < blocks_fp8 / blocks <= width
    tok = smollm2_fp8.get_tokenizer()
    target = {"prompt_token_ids": tok.encode(_words(3, 12))}
    alone = _tokens(smollm2_fp8, [target])[0]
    neighbours = [{"prompt_token_ids": tok.encode(_words(s, 3 + s))} for s in range(4, 7)]
    assert _tokens(smollm2_fp8, [neighbours[0], target, *neighbours[1:]])[1] == alone
    assert _tokens(smollm2_fp8, [target])[0] == alone  # its blocks now come from the prefix cache
    assert smollm2_fp8.engine.kv.all_free()


@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])  # gemma3: 14 s
def test_fp8_model_reads_what_torch_quantizes(model, request, monkeypatch):
    """A prompt's logits on an fp8 cache equal those of the float32 model whose cache holds torch's
    e4m3 quantization of every block and head; on Gemma3 past its sliding window."""
    llm: LLM = request.getfixturevalue(model)
    # Gemma3: ~680 tokens, past its 512-token window; SmolLM2: ~300, many blocks
    ids = {"prompt_token_ids": llm.get_tokenizer().encode(_words(10, 70 if model == "gemma3" else 30))}
    fp8 = LLM({"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}[model], progress=False, kv_cache_dtype="fp8")
    got = fp8.prompt_logits(ids)
    exact = llm.prompt_logits(ids)
    torch_fp8_writes(monkeypatch)
    assert torch.equal(got, llm.prompt_logits(ids))
    assert not torch.equal(got, exact)


def test_fp8_span_converts_to_other_kv_dtypes(smollm2, smollm2_fp8):
    tok = smollm2_fp8.get_tokenizer()
    ids = tok.encode(_words(8, 9))  # ~90 tokens: several blocks
    blob = prefill_span(smollm2_fp8, ids)
    header, _ = wire.read_header(blob, smollm2_fp8.engine.handoff.secret)
    kinds = sorted({(t["kind"], t["dtype"]) for t in header["tensors"]})
    assert kinds == [("k", "float8_e4m3fn"), ("k_scale", "float32"), ("v", "float8_e4m3fn"), ("v_scale", "float32")]
    # an fp8 receiver of the same block size holds the exporter's codes: the exporter's own tokens
    assert (
        run_imported(smollm2_fp8, ids, blob).outputs[0].token_ids
        == _tokens(smollm2_fp8, [{"prompt_token_ids": ids}])[0]
    )
    # a float32 receiver holds exactly code * scale
    engine = smollm2.engine
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=2), kv_span=blob)
    batch = engine.schedule()  # admitted and written; the forward has not run
    header, body = wire.read_header(blob, smollm2_fp8.engine.handoff.secret)

    def sent(kind: str, dtype: torch.dtype) -> torch.Tensor:  # layer 7 of the span's NHD tensor
        e = next(t for t in header["tensors"] if t["kind"] == kind)
        return wire.tensor_from_bytes(body[e["offset"] : e["offset"] + e["nbytes"]], dtype, e["shape"])[7]

    held = engine.storage.layer(7)[0][
        _slots(engine.kv, engine.requests[rid][0].request_id, 0, torch.arange(len(ids)).numpy())
    ]
    assert torch.equal(held, sent("k", FP8).float() * sent("k_scale", torch.float32))
    engine.run(batch)
    while rid in engine.requests:
        engine.step()
    assert engine.kv.all_free()


def test_float_span_is_quantized_by_an_fp8_receiver(smollm2, smollm2_fp8):
    ids = smollm2.get_tokenizer().encode(_words(9, 4))
    blob = prefill_span(smollm2, ids)
    engine = smollm2_fp8.engine
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=2), kv_span=blob)
    batch = engine.schedule()  # admitted and written; the forward has not run
    header, body = wire.read_header(blob, smollm2.engine.handoff.secret)
    e = header["tensors"][0]  # K of all layers, NHD: [layers, positions, heads, dim]
    sent = wire.tensor_from_bytes(body[e["offset"] : e["offset"] + e["nbytes"]], getattr(torch, e["dtype"]), e["shape"])
    sent = sent[3].float()
    cache = engine.storage.layer_kv(3)
    slots = _slots(engine.kv, engine.requests[rid][0].request_id, 0, torch.arange(len(ids)).numpy())
    for b in range(0, len(ids), 16):
        for h in range(sent.shape[1]):
            scale = pow2_scale(sent[b : b + 16, h].abs().max().item())
            assert cache.k_scale[slots[b] // 16, h].item() == scale
            assert torch.equal(
                cache.k[slots[b : b + 16], h].view(torch.uint8), quantize(sent[b : b + 16, h], scale).view(torch.uint8)
            )
    engine.run(batch)
    while rid in engine.requests:
        engine.step()
    assert engine.kv.all_free()


def _edit_first(kind: str, change):
    def edit_body(header, body):
        e = next(t for t in header["tensors"] if t["kind"] == kind)
        raw = memoryview(body)[e["offset"] : e["offset"] + e["nbytes"]]
        change(raw)
        e["xxh64"] = wire.checksum(raw)

    return edit_body


@pytest.mark.parametrize(
    "edit_header, edit_body, field",
    [
        (lambda h: h.update(tensors=[t for t in h["tensors"] if t["kind"] != "k_scale"]), None, "k_scale"),
        (lambda h: next(t for t in h["tensors"] if t["kind"] == "v_scale").update(dtype="float16"), None, "dtype"),
        (None, _edit_first("k", lambda raw: raw.__setitem__(5, 0x7F)), "k.values"),
        (None, _edit_first("v_scale", lambda raw: raw.__setitem__(slice(0, 4), b"\x00\x00\x80\xbf")), "v_scale"),
    ],
)
def test_hostile_fp8_spans_are_refused_before_a_byte_is_written(smollm2_fp8, edit_header, edit_body, field):
    ids = smollm2_fp8.get_tokenizer().encode("An fp8 span, edited by someone holding the secret.")
    secret = smollm2_fp8.engine.handoff.secret
    blob = repack(prefill_span(smollm2_fp8, ids), secret, edit_header, edit_body)
    before = receiver_state(smollm2_fp8)
    with pytest.raises(InvalidKVImport) as err:
        smollm2_fp8.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=blob)
    assert err.value.field == field, json.dumps(err.value.field)
    assert receiver_state(smollm2_fp8) == before
