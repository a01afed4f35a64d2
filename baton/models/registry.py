"""The one place that maps an architecture name (HF's, or a GGUF file's) to its model class."""

from __future__ import annotations

from torch import nn

from baton.models import (
    falcon_h1,
    gemma3,
    granite_hybrid_gguf,
    kimi_linear_gguf,
    lfm2,
    llama,
    nemotron_h_gguf,
    qwen3_next_gguf,
)
from baton.models.dsa import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from baton.models.falcon_h1 import FalconH1ForCausalLM
from baton.models.gemma3 import Gemma3ForCausalLM
from baton.models.gguf_arch import GGUFArch
from baton.models.glm4_moe import Glm4MoeForCausalLM
from baton.models.glm5_flash import Glm5FlashForCausalLM
from baton.models.granite_hybrid import BambaForCausalLM, GraniteMoeHybridForCausalLM
from baton.models.kimi_linear import KimiLinearForCausalLM
from baton.models.lfm2 import Lfm2ForCausalLM
from baton.models.llama import LlamaForCausalLM
from baton.models.nemotron_h import NemotronHForCausalLM
from baton.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,  # the same program with Qwen3-Next's MoE layers
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2ForCausalLM,  # the same program with experts after the dense layers
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "Glm5NextForConditionalGeneration": Glm5FlashForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    **llama.GGUF_ARCHS,
    **gemma3.GGUF_ARCHS,
    **qwen3_next_gguf.GGUF_ARCHS,
    **nemotron_h_gguf.GGUF_ARCHS,
    **granite_hybrid_gguf.GGUF_ARCHS,
    **lfm2.GGUF_ARCHS,
    **falcon_h1.GGUF_ARCHS,
    **kimi_linear_gguf.GGUF_ARCHS,
}
"""llama.cpp's architecture names (a GGUF file's general.architecture), each as its family declares it."""
