"""Every check on an incoming span, all before anything is written (docs/design.md, "Handoff").

`plan_import` checks the signature, reads the bytes, checks them against the receiver and returns an
ImportPlan whose tensors are already in the receiver's dtype and axis order; only `apply_import`
then allocates blocks and writes. Any failure raises InvalidKVImport naming the field, the expected
and the received value, and the receiver is exactly as before. Invariant: on any bytes whatever,
`plan_import` returns a plan or raises InvalidKVImport, nothing else: every value is type-checked
(bools are not integers here) and range-checked before it is used.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from baton.handoff import wire
from baton.handoff.errors import InvalidKVImport
from baton.handoff.replay import TransferLedger
from baton.handoff.span import AXES, SCALE_KINDS, SPAN_DTYPES, span_rows, to_layout
from baton.kv.manager import KVManager
from baton.kv.prefix import needed_start, resumable_prefix
from baton.kv.spec import STATE_DTYPE, KVGroup, KVSpec

__all__ = ["GroupWrite", "ImportPlan", "InvalidKVImport", "plan_import"]  # InvalidKVImport: old import path

_HEX32 = re.compile("[0-9a-f]{32}")


@dataclass
class GroupWrite:
    group_id: int
    positions: np.ndarray  # positions written, ascending
    # [layers in group, T, heads, dim] in the receiver's KV dtype (float32 for fp8: quantized as written)
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class ImportPlan:
    prompt_token_ids: list[int]
    first_token: int
    writes: list[GroupWrite]
    states: list[tuple[int, int, torch.Tensor]]  # (state group, state tensor index, [layers, *shape] float32)
    transfer_id: str


@dataclass
class _Source:
    """One tensor entry of the header, checked against the body and the receiver."""

    kind: str
    layer_ids: tuple[int, ...]
    start: int
    layer_starts: list[int]
    dtype: str
    shape: list[int]
    raw: memoryview
    index: int | None = None

    def first_real(self, layer_ids: tuple[int, ...]) -> int:
        """First position from which all of `layer_ids` hold real K/V."""
        return max(self.layer_starts[self.layer_ids.index(i)] for i in layer_ids)


def _check(ok: bool, field: str, expected: Any, received: Any) -> None:
    if not ok:
        raise InvalidKVImport(field, expected, received)


def _int(x: Any, lo: int = 0, hi: int = 2**62) -> bool:
    """An integer (never a bool) in [lo, hi]."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _ints(x: Any, lo: int = 0, hi: int = 2**62) -> bool:
    return isinstance(x, list) and all(_int(v, lo, hi) for v in x)


def _same(a: Any, b: Any) -> bool:
    """JSON values equal in type as well as value: 1, 1.0 and true differ."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_fingerprint(theirs: Any, ours: dict) -> None:
    _check(isinstance(theirs, dict), "fingerprint", "an object", type(theirs).__name__)
    ours = json.loads(json.dumps(ours))  # as it travels: tuples become lists
    layers = theirs.get("num_layers")
    _check(_same(layers, ours["num_layers"]), "layer_count", ours["num_layers"], layers)
    for key, value in ours.items():
        _check(key in theirs, f"fingerprint.{key}", value, "no such key")
        _check(_same(theirs[key], value), f"fingerprint.{key}", value, theirs[key])
    extra = sorted(str(k) for k in theirs if k not in ours)
    _check(not extra, f"fingerprint.{extra[0] if extra else ''}", "no such key", extra[:8])


def check_header(
    header: dict, fingerprint: dict, vocab_size: int, expected_tokens: list[int] | None, ledger: TransferLedger
) -> None:
    _check(_same(header.get("version"), wire.VERSION), "version", wire.VERSION, header.get("version"))
    tid = header.get("transfer_id")
    _check(isinstance(tid, str) and _HEX32.fullmatch(tid) is not None, "transfer_id", "32 hex digits", tid)
    expires = header.get("expires_at")
    _check(
        isinstance(expires, (int, float)) and not isinstance(expires, bool) and math.isfinite(expires),
        "expires_at",
        "unix seconds",
        expires,
    )
    ledger.check_expiry(expires)
    check_fingerprint(header.get("fingerprint"), fingerprint)
    layout = header.get("layout")
    _check(isinstance(layout, str) and sorted(layout) == sorted(AXES), "layout", f"a permutation of {AXES}", layout)
    tokens = header.get("prompt_token_ids")
    _check(isinstance(tokens, list) and len(tokens) > 0, "prompt_token_ids", "a non-empty list", tokens)
    if expected_tokens is not None:  # the cheap check first: a long list is not walked for nothing
        _check(
            len(tokens) == len(expected_tokens),
            "prompt_token_ids",
            f"the request's {len(expected_tokens)} tokens",
            f"{len(tokens)} tokens",
        )
    _check(_ints(tokens, 0, vocab_size - 1), "prompt_token_ids", f"ids below {vocab_size}", tokens)
    if expected_tokens is not None and tokens != expected_tokens:
        pairs = zip(tokens, expected_tokens)
        at = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(tokens), len(expected_tokens)))
        raise InvalidKVImport(
            "prompt_token_ids",
            f"the request's {len(expected_tokens)} tokens",
            f"{len(tokens)} tokens, differing from position {at}",
        )
    first = header.get("first_token")
    _check(_int(first, 0, vocab_size - 1), "first_token", f"an id below {vocab_size}", first)
    dtype = header.get("dtype")
    _check(isinstance(dtype, str) and dtype in SPAN_DTYPES, "dtype", f"one of {sorted(SPAN_DTYPES)}", dtype)
    tensors = header.get("tensors")
    _check(isinstance(tensors, list) and tensors, "tensors", "a non-empty list", tensors)


class _Receiver:
    """What this worker's spec lets a span tensor be: which layer sets, shapes and positions."""

    def __init__(self, spec: KVSpec, num_layers: int) -> None:
        self.spec = spec
        self.all_layers = tuple(range(num_layers))
        self.recurrent_layers = tuple(i for i, s in enumerate(spec.layer_to_state) if s is not None)
        self.kv_sets = {g.layer_ids for g in spec.groups} | {self.all_layers}
        self.state_sets = {g.layer_ids for g in spec.state_groups} | {self.recurrent_layers}

    def kv_geometry(self, kind: str, layers: tuple[int, ...]) -> dict:
        groups = [g for g in self.spec.groups if g.layer_ids == layers] or list(self.spec.groups)
        geometries = {(g.num_kv_heads, g.head_dim if kind == "k" else g.v_head_dim) for g in groups}
        _check(len(geometries) == 1, "layer_to_group", "a tensor per group (KV geometries differ)", list(layers))
        heads, dim = geometries.pop()
        return {"H": heads, "D": dim}

    def pool(self, layers: tuple[int, ...]) -> int:
        """Tokens per cache row of a group's layers: a pooled group's pool size, else 1."""
        return next((g.kind.pool for g in self.spec.groups if g.layer_ids == layers), 1)

    def state_shape(self, layers: tuple[int, ...], index: Any) -> list[int]:
        shapes = self.spec.state_groups[self.spec.layer_to_state[layers[0]][0]].state_shapes
        _check(_int(index, 0, len(shapes) - 1), "state_index", f"an index in [0, {len(shapes)})", index)
        return [len(layers), *shapes[index]]


def check_tensor(i: int, e: Any, n: int, layout: str, receiver: _Receiver, body: memoryview) -> _Source:
    f = f"tensors[{i}]"
    _check(isinstance(e, dict), f, "an object", type(e).__name__)
    kind, layers = e.get("kind"), e.get("layer_ids")
    kinds = ("k", "v", "state", *SCALE_KINDS.values())
    _check(isinstance(kind, str) and kind in kinds, f"{f}.kind", f"one of {', '.join(kinds)}", kind)
    layers = tuple(layers) if _ints(layers) and layers else None
    sets = receiver.state_sets if kind == "state" else receiver.kv_sets
    _check(
        layers in sets,
        "layer_to_group",
        f"one of the receiver's groups or all layers: {sorted(sets)}",
        e.get("layer_ids"),
    )
    dtype = e.get("dtype")
    if kind in SCALE_KINDS.values():
        _check(dtype == "float32", "dtype", f"float32 for {kind}", dtype)
    _check(isinstance(dtype, str) and dtype in SPAN_DTYPES, "dtype", f"one of {sorted(SPAN_DTYPES)}", dtype)
    start = e.get("start")
    if kind == "state":
        _check(_int(start) and start == n, "state_position", f"the state after the prompt, at {n}", start)
        starts = [n] * len(layers)
        expected_shape = receiver.state_shape(layers, e.get("index"))
    else:
        _check(_int(start, 0, n - 1), "positions", f"a start in [0, {n})", start)
        starts = e.get("layer_starts", [start] * len(layers))
        _check(
            _ints(starts, start, n) and len(starts) == len(layers),
            f"{f}.layer_starts",
            f"{len(layers)} positions in [{start}, {n}]",
            starts,
        )
        base = kind[0]  # a scale tensor has its K or V tensor's geometry with a head dim of 1
        pool = receiver.pool(layers)  # a pooled group's rows: its complete pools, from pool 0
        _check(pool == 1 or start == 0, "positions", "pooled keys from pool 0", start)
        want = {"L": len(layers), "T": n - start if pool == 1 else n // pool, **receiver.kv_geometry(base, layers)}
        if kind != base:
            want["D"] = 1
        expected_shape = [want[a] for a in layout]
    shape = e.get("shape")
    _check(_ints(shape) and shape == expected_shape, "shape", expected_shape, shape)
    size = math.prod(expected_shape) * SPAN_DTYPES[dtype].itemsize
    nbytes, offset = e.get("nbytes"), e.get("offset")
    _check(_int(nbytes) and nbytes == size, "nbytes", f"{size} ({dtype} x {expected_shape})", nbytes)
    _check(_int(offset), f"{f}.offset", "a byte offset >= 0", offset)
    _check(offset + nbytes <= len(body), "body_length", f">= {offset + nbytes} bytes", len(body))
    raw = body[offset : offset + nbytes]
    digest = e.get("xxh64")
    _check(isinstance(digest, str) and wire.checksum(raw) == digest, "checksum", digest, wire.checksum(raw))
    return _Source(kind, layers, start, starts, dtype, shape, raw, e.get("index"))


def _check_finite(t: torch.Tensor, field: str) -> None:
    """Every value a number: a NaN or infinity written into the cache would spread through every
    later token of the request (and of any request resuming from its blocks)."""
    if t.is_floating_point():
        bad = int(t.numel() - torch.isfinite(t).sum())
        _check(bad == 0, field, "finite values", f"{bad} NaN or infinite")


def _values(src: _Source, sources: dict) -> torch.Tensor:
    """A K or V tensor's values in the span's layout: fp8 codes times their scales as float32."""
    t = wire.tensor_from_bytes(src.raw, SPAN_DTYPES[src.dtype], src.shape)
    if t.dtype != torch.float8_e4m3fn:
        return t
    bits = t.view(torch.uint8)
    nan = (bits & 0x7F) == 0x7F
    _check(not bool(nan.any()), f"{src.kind}.values", "finite fp8 codes", f"{int(nan.sum())} NaN codes")
    scale_src = sources[(SCALE_KINDS[src.kind], src.layer_ids, None)]
    scale = wire.tensor_from_bytes(scale_src.raw, torch.float32, scale_src.shape)
    ok = torch.isfinite(scale) & (scale >= 0)
    _check(bool(ok.all()), scale_src.kind, "finite scales >= 0", f"{int((~ok).sum())} that are not")
    return t.float() * scale  # the scale's head dim of 1 broadcasts, in any layout


def plan_import(
    blob: bytes,
    *,
    secret: bytes,
    fingerprint: dict,
    kv: KVManager,
    kv_dtype: torch.dtype,
    vocab_size: int,
    expected_tokens: list[int] | None,
    ledger: TransferLedger,
    heads_spec: KVSpec | None = None,
) -> ImportPlan:
    """Pure over the receiver's spec and pool sizes (it may run beside the engine thread); the
    transfer id is taken only once every other check passed."""
    header, body = wire.read_header(blob, secret)
    check_header(header, fingerprint, vocab_size, expected_tokens, ledger)
    spec = kv.spec
    n = len(header["prompt_token_ids"])
    layout = header["layout"]
    # tensor parallel: a span carries every KV head, this rank's spec only its own
    receiver = _Receiver(heads_spec or spec, fingerprint["num_layers"])
    sources: dict[tuple[str, tuple[int, ...], int | None], _Source] = {}
    for i, e in enumerate(header["tensors"]):
        src = check_tensor(i, e, n, layout, receiver, body)
        key = (src.kind, src.layer_ids, src.index)
        _check(key not in sources, f"tensors[{i}].layer_ids", "each layer once per kind", f"{key[0]} {key[1]} twice")
        sources[key] = src
    for (kind, layers, _), src in sources.items():
        scale = sources.get((SCALE_KINDS.get(kind, ""), layers, None))
        if kind in SCALE_KINDS and src.dtype == "float8_e4m3fn":
            _check(scale is not None, SCALE_KINDS[kind], f"scales for the fp8 {kind} of layers {layers}", "none")
            _check(scale.start == src.start, f"{SCALE_KINDS[kind]}.start", src.start, scale.start)
        if kind in SCALE_KINDS.values():
            of = sources.get((kind[0], layers, None))
            _check(
                of is not None and of.dtype == "float8_e4m3fn", kind, f"an fp8 {kind[0]} for layers {layers}", "none"
            )
    picked: dict[tuple[int, str], _Source] = {}
    problems: list[InvalidKVImport] = []

    def has_positions(g: KVGroup, lo: int, hi: int) -> bool:
        for kind in ("k", "v"):
            src = sources.get((kind, g.layer_ids, None)) or sources.get((kind, receiver.all_layers, None))
            if src is None:
                problems.append(InvalidKVImport("layer_to_group", f"{kind} for layers {g.layer_ids}", "no tensor"))
                return False
            first = src.first_real(g.layer_ids)
            if first > lo:
                what = "from position 0" if not g.kind.is_sliding else f"from {lo} (window {g.kind.window})"
                field = "sliding_coverage" if g.kind.is_sliding else "positions"
                problems.append(InvalidKVImport(field, f"{g.kind.name} layers {g.layer_ids} {what}", first))
                return False
            picked[(g.group_id, kind)] = src
        return True

    states: list[tuple[int, int, _Source]] = []

    def has_state(num_tokens: int) -> bool:
        for sg in spec.state_groups:
            for j in range(len(sg.state_shapes)):
                src = sources.get(("state", sg.layer_ids, j)) or sources.get(("state", receiver.recurrent_layers, j))
                if src is None:
                    problems.append(InvalidKVImport("state", f"state {j} of layers {sg.layer_ids} at {n}", "none"))
                    return False
                states.append((sg.group_id, j, src))
        return True

    # the one rule for what a prefix can resume from (kv/prefix.py), asked about the whole prompt
    if resumable_prefix(spec, [n], has_positions, has_state) != n:
        raise problems[0] if problems else InvalidKVImport("positions", f"KV and state for all {n} positions", "less")
    # the blocks are taken when the scheduler admits the request; here: could the pool ever hold it
    needed = kv.blocks_for_import(n, n + 1)
    for g, blocks in zip(spec.groups, needed):
        size = kv.pools[g.group_id].num_blocks
        _check(blocks <= size, "kv_capacity", f"a pool of >= {blocks} blocks in group {g.group_id}", size)
    writes = []
    for g in spec.groups:
        need = needed_start(g, n)
        out = {}
        for kind in ("k", "v"):
            src = picked[(g.group_id, kind)]
            t = to_layout(_values(src, sources), layout, AXES)
            if src.layer_ids != g.layer_ids:  # dense: pick this group's layers
                t = t[list(g.layer_ids)]
            t = t[:, need - src.start :]  # only real positions
            out[kind] = t.to(torch.float32 if kv_dtype == torch.float8_e4m3fn else kv_dtype).contiguous()
            _check_finite(out[kind], f"{kind}.values")  # in the receiver's dtype: float16 overflows too
        writes.append(GroupWrite(g.group_id, span_rows(g, need, n), out["k"], out["v"]))
    state_writes = []
    for gid, j, src in states:
        t = wire.tensor_from_bytes(src.raw, SPAN_DTYPES[src.dtype], src.shape)
        if src.layer_ids != spec.state_groups[gid].layer_ids:  # all recurrent layers: pick this group's
            t = t[[src.layer_ids.index(i) for i in spec.state_groups[gid].layer_ids]]
        t = t.to(STATE_DTYPE).contiguous()
        _check_finite(t, "state.values")
        state_writes.append((gid, j, t))
    tokens = list(header["prompt_token_ids"])
    ledger.claim(header["transfer_id"], header["expires_at"])
    return ImportPlan(tokens, header["first_token"], writes, state_writes, header["transfer_id"])
