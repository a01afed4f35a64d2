"""Pipeline parallel: the layers cut into stages, one step's rows cut into micro-batches that flow
through them, so that stage s works on micro-batch i while stage s + 1 works on i - 1.

A stage hands the next one the residual stream after its last layer (x + residual): the next
stage's first layer normalizes exactly that sum, as it would have inside one process. The last
stage computes the logits and sends them to the driver (rank 0, on the first stage)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from baton.engine.scheduler import ScheduledRequest
from baton.parallel.comm import TPGroup
from baton.parallel.shard import even_split


@dataclass
class Stage:
    index: int
    count: int
    tp: TPGroup
    layers: range  # this stage's decoder layers
    cache_layers: tuple[int, ...] = ()  # the KV and state layer ids it holds: its layers' and what they own

    def __post_init__(self) -> None:
        self.cache_layers = self.cache_layers or tuple(self.layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def peer(self, stage: int) -> int:
        """The global rank of this rank's tensor-parallel twin in `stage`."""
        return stage * self.tp.size + self.tp.rank


def stage_layers(num_layers: int, count: int, index: int, can_start: Callable[[int], bool] | None = None) -> range:
    """Stage `index`'s layers: an even cut, each stage's first layer moved back to one that
    `can_start` a stage (GLM-5's shared-selection layers read the layer before them)."""
    if num_layers < count:
        raise ValueError(f"{num_layers} layers do not cut into {count} pipeline stages")
    can_start = can_start or (lambda _: True)
    starts = [even_split(num_layers, count, i).start for i in range(count)] + [num_layers]
    for i in range(1, count):
        while not can_start(starts[i]) and starts[i] > starts[i - 1] + 1:
            starts[i] -= 1
        if not can_start(starts[i]):
            raise ValueError(f"no layer between {starts[i - 1] + 1} and {starts[i]} can start pipeline stage {i}")
    return range(starts[index], starts[index + 1])


class ResidualOut(nn.Module):
    """A non-last stage's end: the residual stream after its last layer, instead of the final norm."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return x if residual is None else residual + x


class StageInput(nn.Module):
    """A non-first stage's start: the stream received from the stage before, instead of the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.received: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.received is not None and self.received.shape[0] == input_ids.shape[0]
        x, self.received = self.received, None
        return x


def cut_stage(model: nn.Module, stage: Stage) -> None:
    """Keep this stage's layers (the others' weights are freed); wire its input and output."""
    model.layers = nn.ModuleList([model.layers[i] for i in stage.layers])
    # weights kept in GGUF blocks are found by parameter path: layer i of the stage was layer start + i
    moved = {f"layers.{layer}.": f"layers.{i}." for i, layer in enumerate(stage.layers)}
    blocks = {}
    for name, weight in getattr(model, "block_weights", {}).items():
        parts = name.split(".")
        if parts[0] != "layers":
            blocks[name] = weight
        elif f"layers.{parts[1]}." in moved:
            blocks[moved[f"layers.{parts[1]}."] + ".".join(parts[2:])] = weight
    model.block_weights = blocks
    if not stage.is_first:
        model.stage_input = StageInput()
        if hasattr(model, "embeddings"):  # Nemotron-H names it so and calls it directly
            if model.lm_head is None:  # tied: the head keeps the table
                model.lm_head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False, device="meta")
                model.lm_head.weight = model.embeddings.weight
            model.embeddings = model.stage_input
        else:  # an instance attribute, so that it shadows the family's embed()
            object.__setattr__(model, "embed", model.stage_input)
    if not stage.is_last:
        if hasattr(model, "norm_f"):
            model.norm_f = ResidualOut()
        else:
            model.norm = ResidualOut()


def micro_batches(scheduled: list[ScheduledRequest], count: int) -> list[list[ScheduledRequest]]:
    """The step's requests, in order, cut into up to `count` micro-batches of about equal rows; a
    long prefill chunk is cut into pieces (each at least 2 rows, so a piece is never a decode)."""
    total = sum(s.num_new_tokens for s in scheduled)
    target = -(-total // count)
    out: list[list[ScheduledRequest]] = [[]]
    room = target
    for s in scheduled:
        start, left = s.start, s.num_new_tokens
        while left:
            if room <= 0 and len(out) < count:
                out.append([])
                room = target
            take = left if s.is_decode or len(out) == count else min(left, max(room, 2))
            if 0 < left - take < 2:  # never leave a one-row tail
                take = left
            out[-1].append(dataclasses.replace(s, start=start, num_new_tokens=take) if take != s.num_new_tokens else s)
            start, left, room = start + take, left - take, room - take
    return [mb for mb in out if mb]


def num_logit_rows(step: dict) -> int:
    """`logit_rows`: the rows whose logits the step wants, None for every row."""
    rows = step["logit_rows"]
    return step["input_ids"].shape[0] if rows is None else rows.numel()


def run_stage(model: nn.Module, stage: Stage, steps: list[dict], forward) -> list[torch.Tensor]:
    """Every micro-batch through this stage, in order: receive, run, send on. `forward(step)` runs
    the model on one micro-batch's metadata. The last stage returns each micro-batch's logits (and
    sends them to the driver); the driver returns them as received; other ranks return []."""
    sends = []
    logits: list[torch.Tensor] = []
    # what crosses a stage boundary per row: the residual stream (GLM-5.3-Flash: its hc_mult streams)
    hidden_size, vocab = getattr(model, "stage_stream_width", model.cfg.hidden_size), model.cfg.vocab_size
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    for step in steps:
        n = step["input_ids"].shape[0]
        if not stage.is_first:
            x = torch.empty((n, hidden_size), dtype=dtype)
            _timed(stage.tp, "recv", dist.recv, x, stage.peer(stage.index - 1))
            model.stage_input.received = x
        hidden = forward(step)
        if not stage.is_last:
            hidden = hidden.contiguous()
            sends.append((hidden, dist.isend(hidden, stage.peer(stage.index + 1))))
            continue
        rows = step["logit_rows"]
        if num_logit_rows(step) == 0:
            logits.append(torch.empty((0, vocab)))
            continue
        out = model.compute_logits(hidden if rows is None else hidden[rows]).float().contiguous()
        if stage.tp.rank == 0 and not stage.is_first:
            sends.append((out, dist.isend(out, 0)))
        logits.append(out)
    for _, work in sends:
        work.wait()
    if stage.is_first and not stage.is_last and stage.tp.rank == 0:  # the driver: logits from the last stage
        for step in steps:
            n = num_logit_rows(step)
            out = torch.empty((n, vocab), dtype=torch.float32)
            logits.append(out)
            if n == 0:
                continue
            _timed(stage.tp, "recv", dist.recv, out, stage.peer(stage.count - 1) - stage.tp.rank)
    return logits


def _timed(tp: TPGroup, op: str, recv, x: torch.Tensor, src: int) -> None:
    start = time.perf_counter()
    recv(x, src)
    tp.stats.add(op, time.perf_counter() - start, x.nbytes)
