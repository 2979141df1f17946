"""The serving engine: continuous batching on a paged KV cache, sampling, beams, speculative decoding, structured
outputs, embeddings, and the async engine the server and the CLI run it behind. Never imports training or serve."""

from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.outputs import Completion, RequestOutput
from tformer.engine.requests import ContextLengthError
from tformer.engine.sampling import RequestError, SamplingParams
from tformer.engine.structured import StructuredOutput

__all__ = [
    "Completion",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]
