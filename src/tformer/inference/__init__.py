"""Inference: decoding (greedy, beam search) and the serving engine. Never imports tformer.training."""

from tformer.inference.engine import Engine, EngineConfig
from tformer.inference.outputs import Completion, RequestOutput
from tformer.inference.requests import ContextLengthError
from tformer.inference.sampling import RequestError, SamplingParams
from tformer.inference.search import beam_search, beam_search_decoder, greedy_search, length_penalty, translate_ids
from tformer.inference.structured import StructuredOutput

__all__ = [
    "Completion",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "beam_search",
    "beam_search_decoder",
    "greedy_search",
    "length_penalty",
    "translate_ids",
]
