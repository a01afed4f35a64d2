"""baton: an LLM serving engine for hybrid models."""

from baton.llm import LLM
from baton.outputs import CompletionOutput, Logprob, RequestOutput
from baton.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
