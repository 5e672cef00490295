"""pagedllm: an LLM inference and serving engine built around PagedAttention.

``from pagedllm import LLM, SamplingParams`` gives the offline API in vLLM's shape.
"""

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.llm import LLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
