"""hyserve: a serving engine for hybrid Mamba2 + attention language models (the NemotronH family)."""

from hyserve.engine.errors import RequestRejected
from hyserve.engine.llm import LLM
from hyserve.engine.outputs import RequestOutput, TokenLogprob
from hyserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "RequestRejected", "SamplingParams", "TokenLogprob"]
__version__ = "0.1.0"
