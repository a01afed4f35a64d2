"""baton: an LLM serving engine for hybrid models."""

from baton.outputs import CompletionOutput, Logprob, RequestOutput
from baton.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code: a process that only routes (`baton router`) never pays for it
    if name == "LLM":
        from baton.llm import LLM

        return LLM
    raise AttributeError(f"module 'baton' has no attribute {name!r}")
