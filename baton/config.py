"""One typed config tree. Environment variables are read once, in `EnvSettings.read()`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from baton.config_kv import KV_ROLES, KVTierConfig, KVTransferConfig, check_kv_secret
from baton.config_spec import SPEC_METHODS, SpeculativeConfig

__all__ = [
    "KV_ROLES",
    "SPEC_METHODS",
    "CacheConfig",
    "EngineConfig",
    "EnvSettings",
    "KVTierConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "check_kv_secret",
]

DTYPES = ("float32", "bfloat16", "float16")
# KV cache dtypes besides DTYPES: vLLM's names for fp8 e4m3, scaled per block and KV head
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "glm45")  # baton/server/reasoning.py
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "glm45", "generic")  # baton/server/tool_formats.py
QUANT_KERNELS = ("int8", "float", "int8-avx512_vnni", "int8-avx_vnni", "int8-avx2")


@dataclass
class ModelConfig:
    model: str = "smollm2-135m"
    """A known name (smollm2-135m, gemma3-270m), an HF directory or a .gguf file."""
    dtype: str = "auto"
    """Compute and weight dtype. auto: float32, with a GGUF file's matrices kept in the block formats
    it ships (Q4_K, Q8_0, ...); float32: every weight dequantized to float32."""
    quantization: str | None = None
    """Quantize the linears of a float checkpoint at load into a GGUF block format (q8_0, q4_0,
    q4_1, q5_0, q5_1, q4_k, q5_k, q6_k); a linear whose input width is not a whole number of blocks
    stays float32."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to the model's own."""
    packed_linears: bool = True
    """float32: run the linears on baton's panel kernel over packed weights (false: torch's F.linear)."""
    fused_decode: bool = True
    """Packed float32 models: a step of decodes only runs as one C++ call (false: module by module,
    as steps with a prefill do; the outputs are the same bits either way)."""
    quant_kernel: str | None = None
    """The kernel of linears over GGUF blocks (baton/ops/quant_linear.h); None: BATON_QUANT_KERNEL,
    else int8. int8: activations quantized per block to int8, integer dot products on the best
    instruction set the CPU has (int8-avx512_vnni, int8-avx_vnni, int8-avx2 force one; all give the
    same bits), weights regrouped at load; float: the blocks dequantized in registers and float32
    multiply-adds, the gguf package's float32 weights bit for bit (what parity with transformers on
    the dequantized model checks)."""

    def __post_init__(self) -> None:
        if self.quant_kernel is not None and self.quant_kernel not in QUANT_KERNELS:
            raise ValueError(f"quant_kernel must be one of {', '.join(QUANT_KERNELS)}, got {self.quant_kernel!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization is not None and (self.torch_dtype_name != "float32" or not self.packed_linears):
            raise ValueError("quantization needs float32 compute and packed linears")

    @property
    def torch_dtype_name(self) -> str:
        return "float32" if self.dtype == "auto" else self.dtype

    @property
    def keep_gguf_blocks(self) -> bool:
        """A GGUF file's matrices stay in their blocks (auto dtype on packed linears)."""
        return self.dtype == "auto" and self.packed_linears


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    """KV budget in bytes, split between the KV groups by `kv.spec.size_kv_pools`."""
    num_kv_blocks: int | None = None
    """If set, every KV group gets exactly this many blocks (overrides the byte budget)."""
    enable_prefix_caching: bool = True
    kv_cache_dtype: str | None = None
    """Storage dtype of the KV cache: float32, bfloat16, float16, or fp8 (e4m3 with a float32 scale per
    block and KV head, a power of two); defaults to float16 for a GGUF file's blocks (as llama.cpp),
    else to the model dtype."""
    kv_layout: str = "NHD"
    """Axis order of stored K/V per layer: NHD = [slots, heads, dim], HND = [heads, slots, dim]."""
    state_checkpoint_interval: int | None = None
    """Recurrent layers: checkpoint the state every this many tokens (a multiple of block_size),
    besides the prompt's last block boundary, a request's end and where requests diverge; default
    `kv.spec.checkpoint_interval`: every few blocks for a state small beside its KV, at most 256
    tokens apart."""
    state_checkpoint_fraction: float = 0.25
    """Recurrent layers: the share of the KV budget (after running requests' state) for checkpoints."""

    def kv_torch_dtype_name(self, model_dtype: str, gguf_blocks: bool = False) -> str:
        """The configured KV dtype's torch name; unset: float16 for a model whose linears run on
        GGUF blocks (llama.cpp's default: half of float32's bytes, which decode reads at every
        step), else the model's dtype."""
        if self.kv_cache_dtype in FP8_KV_DTYPES:
            return "float8_e4m3fn"
        return self.kv_cache_dtype or ("float16" if gguf_blocks else model_dtype)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be NHD or HND, got {self.kv_layout!r}")
        interval = self.state_checkpoint_interval
        if interval is not None and (interval < 1 or interval % self.block_size):
            raise ValueError(
                f"state_checkpoint_interval must be a multiple of block_size ({self.block_size}), "
                f"got {self.state_checkpoint_interval}"
            )
        if not 0.0 <= self.state_checkpoint_fraction < 1.0:
            raise ValueError(f"state_checkpoint_fraction must be in [0, 1), got {self.state_checkpoint_fraction}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in DTYPES + FP8_KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(DTYPES + FP8_KV_DTYPES)}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    """Token budget of one step: prefill chunks and decodes share it. 256 on the CPU: a step then
    takes about as long as a few decode steps, so the running chats' next tokens are not held
    behind a long prompt's prefill (bench/README.md, the chat trace)."""
    max_model_len: int | None = None
    """Defaults to the model's max_position_embeddings, capped by what the KV budget holds."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """Required as `Authorization: Bearer KEY` on /v1 routes when set (or BATON_API_KEY)."""
    served_model_name: str | None = None
    """The model name clients send; defaults to --model."""
    max_request_bytes: int = 4 << 20
    """Larger request bodies get 413."""
    graceful_shutdown_s: int = 30
    max_waiting_requests: int = 256
    """Requests queued but not yet running; past it new requests get 503 with Retry-After."""
    max_sequences_per_request: int = 256
    """prompts x n of one request; past it, 400."""
    tool_call_parser: str | None = None
    """How chat replies call tools: hermes, llama3_json, mistral or glm45 (the model's own format,
    its template rendering the tools), generic (tools described in a system message, a JSON reply); default:
    the format the chat template shows, else generic."""
    reasoning_parser: str | None = None
    """qwen3, deepseek_r1 or glm45 (vLLM's names): a chat reply's thinking (`<think>...</think>`)
    goes out as `reasoning_content`, apart from `content`."""
    ui: bool = True
    """The chat page at `/` (--no-ui: none)."""
    stall_timeout_s: float = 60.0
    """If the engine makes no progress this long while work is pending, /health answers 503 (and
    baton_engine_stalls_total counts it) until it moves again."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be positive")
        if self.max_waiting_requests < 1 or self.max_sequences_per_request < 1:
            raise ValueError("max_waiting_requests and max_sequences_per_request must be positive")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            known = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"tool_call_parser must be {known}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            known = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {known}, got {self.reasoning_parser!r}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks each layer is split over (Megatron-style: heads, MLP columns, experts, vocabulary)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are cut into."""
    nnodes: int = 1
    """Hosts the ranks span (torchrun's --nnodes); each host starts its share of the ranks."""
    node_rank: int = 0
    """This host's index; host 0 runs the scheduler and the API, the others only ranks."""
    master_addr: str = "127.0.0.1"
    """Where rank 0 listens for the process group (torchrun's --master-addr)."""
    master_port: int | None = None
    """Where rank 0 listens; default: a free port when the ranks share one host (two engines on
    a host never collide), required with nnodes > 1."""
    distributed_backend: str = "auto"
    """auto: gloo, as baton's ranks compute on the CPU (nccl is for CUDA tensors: refused)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks do not divide over {self.nnodes} nodes")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("ranks on several hosts need --master-port (every host must know it)")
        if self.distributed_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"distributed_backend must be auto, gloo or nccl, got {self.distributed_backend!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass
class EnvSettings:
    num_threads: int | None = None
    log_level: str = "INFO"
    cache_dir: Path = Path.home() / ".cache" / "baton"
    api_key: str | None = None
    kv_secret: str | None = None
    kv_tier_secret: str | None = None
    router_admin_key: str | None = None
    quant_kernel: str = "int8"
    """BATON_QUANT_KERNEL: ModelConfig.quant_kernel's default."""
    faults: dict[str, int] = field(default_factory=dict)
    """BATON_FAULTS="stage=token,...": tests' fault points (engine/faults.py); empty in service."""

    @classmethod
    def read(cls) -> EnvSettings:
        quant_kernel = os.environ.get("BATON_QUANT_KERNEL", "int8")
        if quant_kernel not in QUANT_KERNELS:
            raise ValueError(f"BATON_QUANT_KERNEL must be one of {', '.join(QUANT_KERNELS)}, not {quant_kernel!r}")
        threads = os.environ.get("BATON_NUM_THREADS")
        return cls(
            num_threads=int(threads) if threads else None,
            log_level=os.environ.get("BATON_LOG_LEVEL", "INFO"),
            cache_dir=Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton")),
            api_key=os.environ.get("BATON_API_KEY") or None,
            kv_secret=os.environ.get("BATON_KV_SECRET") or None,
            kv_tier_secret=os.environ.get("BATON_KV_TIER_SECRET") or None,
            router_admin_key=os.environ.get("BATON_ROUTER_ADMIN_KEY") or None,
            quant_kernel=quant_kernel,
            faults=parse_faults(os.environ.get("BATON_FAULTS", "")),
        )


def parse_faults(text: str) -> dict[str, int]:
    """Parse `forward=49000,export=49001` into {"forward": 49000, "export": 49001}."""
    faults = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        stage, _, token = item.partition("=")
        if not token.strip().isdigit():
            raise ValueError(f"BATON_FAULTS entries are stage=token_id, not {item!r}")
        faults[stage.strip()] = int(token)
    return faults


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_tier: KVTierConfig = field(default_factory=KVTierConfig)
    env: EnvSettings = field(default_factory=EnvSettings.read)
    seed: int = 0
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None and self.cache.kv_cache_dtype in FP8_KV_DTYPES:
            # a block's fp8 scale grows with every value written into it, rejected drafts' too: the
            # kept tokens' codes would then differ from an undrafted run's
            raise ValueError("speculative decoding needs a float KV cache (kv_cache_dtype float32/bfloat16/float16)")
        if self.parallel.world_size > 1 and self.speculative is not None and self.speculative.method == "mtp":
            raise ValueError("MTP drafting runs on one rank: use tensor_parallel_size 1, or the ngram method")
        if self.parallel.pipeline_parallel_size > 1 and self.kv_transfer.kv_role != "none":
            raise ValueError("a KV handoff from pipeline stages is not built: use kv_role none with pipeline parallel")
        if self.kv_tier.kv_tier:
            if self.parallel.world_size > 1:
                raise ValueError("a second KV tier runs on one rank: use --kv-tier without tensor or pipeline parallel")
            if not self.cache.enable_prefix_caching:
                raise ValueError("a second KV tier feeds the prefix cache: --kv-tier needs prefix caching")
            if self.speculative is not None and self.speculative.method == "mtp":
                raise ValueError("a second KV tier does not hold the MTP drafter's layer: use another method")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build the tree from flat keyword arguments (`LLM(model=..., block_size=...)`)."""
        sections = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "kv_transfer": KVTransferConfig,
            "parallel": ParallelConfig,
            "kv_tier": KVTierConfig,
        }
        parts: dict[str, dict] = {name: {} for name in sections}
        seed = kwargs.pop("seed", 0)
        speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        for key, value in kwargs.items():
            owner = next((s for s, c in sections.items() if key in {f.name for f in fields(c)}), None)
            if owner is None:
                known = sorted(f.name for c in sections.values() for f in fields(c))
                raise TypeError(f"unknown engine setting {key!r}; known: {', '.join(known)}")
            parts[owner][key] = value
        return cls(**{s: c(**parts[s]) for s, c in sections.items()}, seed=seed, speculative=speculative)

    def to_json(self) -> str:
        """The whole tree, for the other ranks of this engine (they read it from a pipe)."""
        tree = asdict(self)
        tree["env"]["cache_dir"] = str(self.env.cache_dir)
        return json.dumps(tree)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        tree = json.loads(text)
        env = EnvSettings(**{**tree["env"], "cache_dir": Path(tree["env"]["cache_dir"])})
        return cls(
            model=ModelConfig(**tree["model"]),
            cache=CacheConfig(**tree["cache"]),
            scheduler=SchedulerConfig(**tree["scheduler"]),
            kv_transfer=KVTransferConfig(**tree["kv_transfer"]),
            parallel=ParallelConfig(**tree["parallel"]),
            kv_tier=KVTierConfig(**tree["kv_tier"]),
            env=env,
            seed=tree["seed"],
            speculative=SpeculativeConfig(**tree["speculative"]) if tree["speculative"] else None,
        )

    def kv_secret_bytes(self) -> bytes | None:
        """The explicit shared secret (the flag, else BATON_KV_SECRET), or None."""
        secret = self.kv_transfer.kv_secret or self.env.kv_secret
        return secret.encode() if secret else None

    def kv_tier_secret_bytes(self, api_key: str | None = None) -> bytes:
        """The tier's signing key (the flag, else BATON_KV_TIER_SECRET): required, and not a key a
        client holds (`api_key`: the server's)."""
        secret = self.kv_tier.kv_tier_secret or self.env.kv_tier_secret
        if not secret:
            raise ValueError(
                "--kv-tier needs --kv-tier-secret (or BATON_KV_TIER_SECRET): tier objects are signed and "
                "checked with it, the same on every process that shares the tier"
            )
        if secret in (api_key, self.env.api_key, self.kv_transfer.kv_secret or self.env.kv_secret):
            raise ValueError("the kv tier secret must differ from the API key and the kv secret")
        return secret.encode()

    def internal_key(self, api_key: str | None = None) -> str | None:
        """The key of the internal routes: None for kv_role none. A role needs its own secret."""
        role = self.kv_transfer.kv_role
        if role == "none":
            return None
        secret = self.kv_transfer.kv_secret or self.env.kv_secret
        return check_kv_secret(secret, api_key or self.env.api_key, f"--kv-role {role}")
