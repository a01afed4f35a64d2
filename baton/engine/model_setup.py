"""Load the model a rank runs: the checkpoint, this rank's tensor-parallel part of it, its packed
linears. The driver's engine and every other rank call the same function, so they agree."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from baton.config import EngineConfig
from baton.models.layers import can_pack_linears, describe_linears
from baton.models.loader import LoadedModel, load_model
from baton.models.model_config import TextModelConfig
from baton.parallel.comm import TPGroup
from baton.parallel.pipeline import Stage, cut_stage, stage_layers

logger = logging.getLogger(__name__)


@dataclass
class RankModel:
    model: nn.Module
    loaded: LoadedModel
    local_config: TextModelConfig  # this rank's heads and widths (the whole model's on one rank)
    stage: Stage | None  # pipeline parallel: this rank's stage


def load_rank_model(config: EngineConfig, tp: TPGroup, rank: int = 0, progress: bool = True) -> RankModel:
    dtype = getattr(torch, config.model.torch_dtype_name)
    keep_blocks = config.model.keep_gguf_blocks
    if keep_blocks or config.model.quantization is not None:
        from baton.ops import ops, set_quant_kernel

        kernel = config.model.quant_kernel or config.env.quant_kernel
        if ops().QUANT_KERNELS:  # else no kernel reads blocks: PackedLinear.from_blocks says so if any ships
            set_quant_kernel(kernel)
    loaded = load_model(config.model.model, dtype, config.env.cache_dir, progress=progress, keep_blocks=keep_blocks)
    model, local = loaded.model, loaded.config
    stage = None
    pp = config.parallel.pipeline_parallel_size
    if pp > 1:
        index = rank // tp.size
        layers = stage_layers(local.num_layers, pp, index, getattr(model, "can_start_stage", None))
        owned = getattr(model, "cache_layers", None)  # an indexer's pooled caches belong to its layer
        stage = Stage(index, pp, tp, layers, tuple(owned(layers)) if owned else ())
        cut_stage(model, stage)
    if tp.size > 1:
        from baton.parallel.shard import shard_model

        local = shard_model(model, loaded.config, tp)
    if config.model.packed_linears and can_pack_linears(dtype):
        model.pack_linears(config.model.quantization)
        logger.info("%s: %s", loaded.path.name, describe_linears(model))
    model.fused_decode = config.model.fused_decode and model.fused_decode  # the model may lack it
    return RankModel(model, loaded, local, stage)


def kv_cache_dtype(config: EngineConfig, rank_model: RankModel) -> torch.dtype:
    """The dtype of the KV cache every rank allocates (CacheConfig.kv_torch_dtype_name). A GGUF
    model with MLA layers keeps its own dtype: its latents are a small cache already, and the
    one-call MLA step reads float32 (or fp8) latents, not float16."""
    gguf_blocks = config.model.keep_gguf_blocks and rank_model.loaded.path.suffix == ".gguf"
    gguf_blocks = gguf_blocks and not any(k.is_mla for k in rank_model.local_config.layer_kinds)
    return getattr(torch, config.cache.kv_torch_dtype_name(config.model.torch_dtype_name, gguf_blocks))


def spec_decoder(config: EngineConfig, model, model_config: TextModelConfig, kv, storage, structured, progress: bool):
    """The speculative decoder of `config.speculative`, with its drafter."""
    from baton.spec_decode.decoder import SpecDecoder

    spec = config.speculative
    assert spec is not None
    draft = None
    if spec.method == "mtp":
        from baton.spec_decode.mtp import MtpProposer

        draft = MtpProposer(model, kv, storage)
    if spec.method == "suffix":
        from baton.spec_decode.suffix import SuffixProposer

        draft = SuffixProposer(spec)
    if spec.method == "draft_model":
        from baton.spec_decode.draft_model import DraftModelProposer

        draft = DraftModelProposer(config, model_config, progress)
    return SpecDecoder(spec, draft, structured.allowed_drafts)
