"""Other projects' checkpoints in and out: Hugging Face directories and GGUF files.

Only this package knows foreign weight names; everything else speaks tformer's.
"""

from tformer.interop.gguf import GGUFError, from_gguf
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf
from tformer.interop.hf import from_hf, to_hf

__all__ = ["GGUFError", "from_gguf", "from_hf", "to_hf", "tokenizer_from_gguf"]
