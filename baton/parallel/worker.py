"""A rank other than the driver: load this rank's part of the model, build its KV and state from
the sizes the driver decided, then run every step the driver sends until told to stop.

`python -m baton.parallel.worker --rank R` reads the engine config (JSON) on stdin."""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import subprocess
import sys
from functools import partial

import torch

from baton.config import EngineConfig
from baton.engine.model_setup import kv_cache_dtype, load_rank_model
from baton.engine.runner import forward_step
from baton.handoff.transfer import read_group, write_group
from baton.kv.spec import KVSpec
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.parallel import messages
from baton.parallel.comm import destroy_process_group, init_process_group
from baton.parallel.pipeline import run_stage
from baton.parallel.ranks import reduce_state, spawn_ranks
from baton.parallel.shard import group_heads, split_caches

logger = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: this process is killed when the process that started it dies (no orphaned ranks)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_rank(config: EngineConfig, rank: int) -> None:
    if config.env.num_threads:
        torch.set_num_threads(config.env.num_threads)
    torch.manual_seed(config.seed)
    tp = init_process_group(config.parallel, rank)
    rank_model = load_rank_model(config, tp, rank, progress=False)
    model, local = rank_model.model, rank_model.local_config
    sizes = messages.broadcast(None)
    assert sizes["op"] == "caches"
    spec = KVSpec.build(local.layer_kinds, local.num_kv_heads, local.head_dim, config.cache.block_size)
    kv_dtype = kv_cache_dtype(config, rank_model)
    layers = rank_model.stage.cache_layers if rank_model.stage else None  # a pipeline stage keeps only its own
    storage = KVStorage(spec, sizes["num_blocks"], kv_dtype, sizes["kv_layout"], layers=layers)
    states = StateStorage(
        spec,
        sizes["num_state_slots"],
        sizes["num_checkpoints"],
        drafts_per_slot=sizes["drafts_per_slot"],
        layers=layers,
    )
    whole = rank_model.loaded.config  # the model's, where `local` is this rank's share
    split = split_caches(model, whole, storage, states, tp, config.cache.block_size)
    read = read_group(storage, spec.block_size)
    forward = partial(forward_step, model, storage, states)

    with torch.inference_mode():
        while True:
            step = messages.broadcast(None)
            if step["op"] == "stop":
                break
            if step["op"] == "read_kv":  # an export: this rank's heads, gathered on the driver
                heads = group_heads(spec.groups[step["group"]], split.shares, whole.num_kv_heads)
                for _, t, scale in read(step["group"], step["slots"]):
                    for x in (t, scale) if scale is not None else (t,):
                        tp.gather_heads(x, *heads)
                continue
            if step["op"] == "read_state":
                reduce_state(tp, states, split.whole_spec, step["slot"])
                continue
            if step["op"] == "write_kv":  # an import the driver validated and wrote its heads of
                for group_id, j, slot, values in step["states"]:
                    states.write_state(slot, group_id, j, values)
                for group_id, slots, k, v in step["groups"]:
                    write_group(spec.groups[group_id].layer_ids, storage, spec.block_size, slots, k, v)
                continue
            if step["op"] == "pipeline":
                states.replay(step["journal"])
                run_stage(model, rank_model.stage, step["steps"], forward)
                continue
            if step["op"] != "forward":
                raise ValueError(f"rank {rank}: unknown command {step['op']!r}")
            states.replay(step["journal"])
            hidden = forward(step)
            if step["logit_rows"] is not None:
                hidden = hidden[step["logit_rows"]]
            model.compute_logits(hidden)  # this rank's vocabulary share, gathered on every rank
    destroy_process_group()


def run_node(config: EngineConfig) -> None:
    """A host other than the driver's (node_rank > 0): start its ranks and wait on them; exit
    non-zero as soon as one fails."""
    parallel = config.parallel
    first = parallel.node_rank * parallel.ranks_per_node
    procs = spawn_ranks(config, range(first, first + parallel.ranks_per_node))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while procs:
            for proc in list(procs):
                try:
                    code = proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
                procs.remove(proc)
                if code != 0:
                    raise RuntimeError(f"a rank of node {parallel.node_rank} exited with code {code}")
    finally:
        for proc in procs:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args()
    _die_with_parent()
    config = EngineConfig.from_json(sys.stdin.read())
    logging.basicConfig(level=config.env.log_level, format=f"%(levelname)s rank{args.rank} %(name)s: %(message)s")
    try:
        run_rank(config, args.rank)
    except RuntimeError as e:  # the driver went away under a collective
        logger.error("rank %d stops: %s", args.rank, e)
        sys.exit(1)


if __name__ == "__main__":
    main()
