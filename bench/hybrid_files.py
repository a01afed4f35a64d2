"""Hybrid GGUF files at the sizes CPU users run, made as a user makes them: a random-weight
checkpoint of the family's shape (SmolLM2's tokenizer and vocabulary), converted by llama.cpp's own
convert_hf_to_gguf.py to bf16 and quantized by its llama-quantize. Made once under the cache
directory; random weights make no sense as text but cost what a trained model of that shape costs.

    python -m bench.hybrid_files qwen3.5-1.5b:Q4_K_M qwen3.5-0.4b:Q8_0 ...   (prints the paths)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from baton.bench.hf_export import export_hf_dir
from bench.peer_servers import CORES, llama_cpp_binary, llama_cpp_sources

_QWEN35 = dict(  # Qwen3.5's text shape: 3 Gated DeltaNet layers to 1 gated attention layer
    vocab_size=49152,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
SHAPES: dict[str, tuple[str, dict]] = {
    # ~1.5B parameters: hidden 2048, 24 layers (18 Gated DeltaNet, 6 attention), MLP 6144
    "qwen3.5-1.5b": (
        "Qwen3_5ForCausalLM",
        dict(
            _QWEN35,
            hidden_size=2048,
            num_hidden_layers=24,
            intermediate_size=6144,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
        ),
    ),
    # ~0.4B: the same pattern at half the width, for quick runs
    "qwen3.5-0.4b": (
        "Qwen3_5ForCausalLM",
        dict(
            _QWEN35,
            hidden_size=1024,
            num_hidden_layers=16,
            intermediate_size=3072,
            linear_num_key_heads=8,
            linear_num_value_heads=8,
        ),
    ),
    # Granite-4.0-H-shaped MoE, ~3.0B total / ~0.95B active: 32 layers (every 8th NoPE attention,
    # the rest Mamba2 of 48 heads x 64), 32 experts of 512 (4 used) beside a shared 1024, IBM's multipliers
    "granite-4.0-h-3b-moe": (
        "GraniteMoeHybridForCausalLM",
        dict(
            vocab_size=49152,
            hidden_size=1536,
            num_hidden_layers=32,
            layer_types=["attention" if i % 8 == 7 else "mamba" for i in range(32)],
            num_attention_heads=12,
            num_key_value_heads=4,
            mamba_n_heads=48,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=128,
            mamba_d_conv=4,
            num_local_experts=32,
            num_experts_per_tok=4,
            intermediate_size=512,
            shared_intermediate_size=1024,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=6.0,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # LFM2-1.2B's shape: 16 layers (6 attention, 10 gated short convolutions), MLP 12288 -> 8192
    "lfm2-1.2b": (
        "Lfm2ForCausalLM",
        dict(
            vocab_size=49152,
            hidden_size=2048,
            num_hidden_layers=16,
            layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=12288,
            block_auto_adjust_ff_dim=True,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            conv_L_cache=3,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}
# The other hybrid families llama.cpp writes, at 0.3-0.6B (vocabulary 49152: the converter wants the
# tokenizer's whole vocabulary): for the quantization-error rows, where each file is converted,
# quantized and scored by both engines in a few minutes
_MOE = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512)
_QWEN_SMALL = dict(_QWEN35, hidden_size=1024, num_hidden_layers=12, linear_num_key_heads=8, linear_num_value_heads=8)
_NEMOTRON = dict(
    vocab_size=49152,
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=3072,
    mamba_num_heads=32,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
SHAPES.update(
    {
        "qwen3.5-moe-0.4b": ("Qwen3_5MoeForCausalLM", dict(_QWEN_SMALL, intermediate_size=3072, **_MOE)),
        "qwen3-next-0.4b": ("Qwen3NextForCausalLM", dict(_QWEN_SMALL, intermediate_size=3072, **_MOE)),
        # Nemotron-H's pattern: Mamba2 (M), attention (*), experts (E) layers
        "nemotron-h-moe-0.3b": (
            "NemotronHForCausalLM",
            dict(
                _NEMOTRON,
                hybrid_override_pattern="MEMEM*EMEMEM*EME",
                n_routed_experts=32,
                num_experts_per_tok=4,
                n_group=1,
                topk_group=1,
                routed_scaling_factor=2.5,
                moe_intermediate_size=256,
                moe_shared_expert_intermediate_size=512,
            ),
        ),
        # tied and unscaled, as LiquidAI's (the converter maps no untied lfm2moe lm_head)
        "lfm2-moe-0.4b": (
            "Lfm2MoeForCausalLM",
            dict(
                vocab_size=49152,
                hidden_size=1024,
                num_hidden_layers=12,
                layer_types=["full_attention" if i % 3 == 2 else "conv" for i in range(12)],
                num_attention_heads=16,
                num_key_value_heads=8,
                intermediate_size=3072,
                moe_intermediate_size=256,
                num_experts=32,
                num_experts_per_tok=4,
                num_dense_layers=2,
                routed_scaling_factor=1.0,
                conv_L_cache=3,
                max_position_embeddings=32768,
                tie_word_embeddings=True,
                bos_token_id=1,
                eos_token_id=2,
            ),
        ),
        # untied: a tied file's lm_head is the embedding the converter scaled
        "falcon-h1-0.4b": (
            "FalconH1ForCausalLM",
            dict(
                vocab_size=49152,
                hidden_size=1024,
                num_hidden_layers=16,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=128,
                intermediate_size=3072,
                mamba_d_ssm=1536,
                mamba_n_heads=24,
                mamba_d_head=64,
                mamba_n_groups=1,
                mamba_d_state=128,
                mamba_d_conv=4,
                mamba_rms_norm=True,
                max_position_embeddings=32768,
                tie_word_embeddings=False,
                bos_token_id=1,
                eos_token_id=2,
            ),
        ),
        # Granite-4.0-H's MoE pattern at a third of its width (its 3B file's float32 reference does
        # not fit this machine's memory beside the quantized model)
        "granite-4.0-h-moe-0.6b": (
            "GraniteMoeHybridForCausalLM",
            dict(
                SHAPES["granite-4.0-h-3b-moe"][1],
                hidden_size=1024,
                num_hidden_layers=16,
                layer_types=["attention" if i % 8 == 7 else "mamba" for i in range(16)],
                num_attention_heads=8,
                num_key_value_heads=2,
                mamba_n_heads=32,
                intermediate_size=256,
                shared_intermediate_size=512,
            ),
        ),
    }
)
QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "BF16", "F32")
CONVERTER_TYPES = ("BF16", "F32")  # written by the converter; the others by llama-quantize from BF16


def converter_config(arch: str, config: dict) -> dict:
    """A saved transformers config.json as llama.cpp's converter reads it: IBM's layer type names for
    Granite; Bamba's rotary width, which its checkpoints say and transformers' do not; Qwen3.5-MoE as
    qwen3_5_text (for qwen3_5_moe_text AutoTokenizer gives Qwen's own pre-tokenizer in place of the
    files', whose hash the converter knows); a dense Nemotron-H as NVIDIA's; Kimi Linear's router."""
    if arch == "GraniteMoeHybridForCausalLM":
        ibm = {"linear_attention": "mamba", "full_attention": "attention"}
        return {**config, "layer_types": [ibm.get(t, t) for t in config["layer_types"]]}
    if arch == "BambaForCausalLM":
        head = config["hidden_size"] // config["num_attention_heads"]
        return {**config, "attn_rotary_emb": int(head * config["rope_parameters"]["partial_rotary_factor"])}
    if arch == "Qwen3_5MoeForCausalLM":
        return {**config, "model_type": "qwen3_5_text"}
    if arch == "KimiLinearForCausalLM":  # llama.cpp requires the router activation
        return {**config, "moe_router_activation_func": "sigmoid"}
    if arch == "NemotronHForCausalLM" and "moe" not in config.get("layers_block_type", ["moe"]):
        # NVIDIA's dense config as the converter reads it without transformers 5: the pattern as a
        # string, no MoE keys. Through AutoConfig (which the converter tries first) transformers 5
        # adds its MoE defaults, the converter then writes nemotron_h_moe, and a layer list counts
        # no "mlp" layer: their feed_forward_length is 0, and llama.cpp reads them as Mamba2 and
        # fails to load its own file. An unknown model_type sends the converter to config.json.
        letters = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}
        pattern = "".join(letters[t] for t in config["layers_block_type"])
        dense = {k: v for k, v in config.items() if k not in ("num_experts_per_tok", "layers_block_type")}
        return {
            **dense,
            "model_type": "nemotron_h_dense",
            "hybrid_override_pattern": pattern,
            "num_hidden_layers": len(pattern),
        }
    return config


def converter_source(hf_dir: Path, arch: str) -> Path:
    """The directory llama.cpp's converter reads for a transformers checkpoint: hf_dir itself, or a copy
    beside it put as the converter expects (converter_config; a Kimi Linear's dense MLPs under
    Moonshot's `mlp.`, where transformers saves them under `block_sparse_moe.`)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    fixed = converter_config(arch, cfg)
    if fixed == cfg:
        return hf_dir
    source = hf_dir.with_name(hf_dir.name + "-for-converter")
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(hf_dir, source)
    (source / "config.json").write_text(json.dumps(fixed))
    if arch == "KimiLinearForCausalLM":
        from safetensors.torch import load_file, save_file

        dense = tuple(f"model.layers.{i}.block_sparse_moe." for i in range(cfg["first_k_dense_replace"]))
        renamed = {}
        for shard in source.glob("*.safetensors"):
            weights = load_file(shard)
            for name in [n for n in weights if n.startswith(dense)]:
                renamed[name] = name.replace(".block_sparse_moe.", ".mlp.")
                weights[renamed[name]] = weights.pop(name)
            save_file(weights, shard, metadata={"format": "pt"})
        index = source / "model.safetensors.index.json"
        if index.exists():
            meta = json.loads(index.read_text())
            meta["weight_map"] = {renamed.get(k, k): v for k, v in meta["weight_map"].items()}
            index.write_text(json.dumps(meta))
    return source


def converted(path: Path, arch: str, config: dict) -> Path:
    """The converter's file put right where it cannot be: a Kimi Linear's expert groups, which it
    reads under the name (n_group) transformers renames (a file beside it)."""
    if arch != "KimiLinearForCausalLM":
        return path
    import gguf

    from bench.gguf_rewrite import rewrite

    groups = (config["num_expert_group"], gguf.GGUFValueType.UINT32, None)
    out = path.with_name(path.stem + "-groups.gguf")
    return rewrite(path, out, {"kimi-linear.expert_group_count": groups})


def hf_dir(cache: Path, name: str) -> Path:
    out = cache / "bench" / f"{name}-hf"
    if (out / "config.json").exists():
        return out
    import transformers

    arch, config = SHAPES[name]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "TextConfig"), None)
    config_cls = config_cls or getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_cls(**config)).to(torch.bfloat16)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer_dir = export_hf_dir("smollm2-135m")  # its tokenizer files, chat template and vocabulary
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, tmp / file)
    tmp.rename(out)
    return out


def gguf_file(cache: Path, name: str, quant: str) -> Path:
    """`name` in llama-quantize's `quant`: the checkpoint to bf16 (or f32) by the converter, then quantized."""
    if name not in SHAPES or quant not in QUANTS:
        raise ValueError(f"unknown {name}:{quant}; shapes {', '.join(SHAPES)}, types {', '.join(QUANTS)}")
    out = cache / "bench" / "gguf" / f"{name}-{quant.lower()}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    source = out if quant in CONVERTER_TYPES else out.with_name(f"{name}-bf16.gguf")
    if not source.exists():
        arch, config = SHAPES[name]
        script = llama_cpp_sources(cache) / "convert_hf_to_gguf.py"
        tmp = source.with_name(source.name + ".tmp")
        checkpoint = converter_source(hf_dir(cache, name), arch)
        outtype = (quant if quant in CONVERTER_TYPES else "BF16").lower()
        cmd = [sys.executable, str(script), str(checkpoint), "--outtype", outtype, "--outfile", str(tmp)]
        no_mtp = ["--no-mtp"] if arch.startswith("Qwen") else []  # the others refuse the flag
        done = subprocess.run([*cmd, *no_mtp], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
        converted(tmp, arch, config).rename(source)
        tmp.unlink(missing_ok=True)
    if quant in CONVERTER_TYPES:
        return out
    tmp = out.with_suffix(".tmp")
    cmd = [str(llama_cpp_binary(cache, "llama-quantize")), str(source), str(tmp), quant, str(CORES)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    import argparse

    from baton.config import EnvSettings

    ap = argparse.ArgumentParser(description="Make hybrid GGUF files once (printing their paths).")
    ap.add_argument("files", nargs="+", metavar="NAME:TYPE", help=f"shapes {', '.join(SHAPES)}; types {QUANTS}")
    for spec in ap.parse_args().files:
        name, _, quant = spec.partition(":")
        try:
            print(gguf_file(EnvSettings.read().cache_dir, name, quant or "Q4_K_M"), flush=True)
        except ValueError as e:
            ap.error(str(e))
