"""Model runners: one per model family, with the family's rules for a request and how one engine step turns a
batch of sequences into next-token logits. `RUNNERS` maps a model class to its runner; `make_runner` picks one.

A family's rules: how a request's prompt splits into the decoder's prompt and an encoder's source, how many
context tokens each takes, and whether a sequence's tokens alone determine its keys and values (prefix caching).

A step feeds each scheduled sequence's new tokens, padded into a (B, T) batch with positions of -1 on the
padding, through the decoder with the paged cache, and keeps the logits of each row's last real token. A decoder
whose layers all attend plainly takes a step's prompt chunks packed side by side in one row instead (packing.py).
An encoder-decoder model also runs its encoder once per request and keeps the cross-attention keys and
values of every decoder layer with the request, so later steps never touch the encoder again.

With `compile`, decode steps (one new token per row) run the decoder through `torch.compile(dynamic=True)`,
which fuses the small per-layer operations that dominate a decode step once the matmuls are cheap; prefill
chunks, whose widths vary and whose time goes to matmuls, stay eager. The first decode step compiles
(tens of seconds for SmolLM2 on 2 cores; docs/design-notes.md, "engine/runner.py"), and batch size 1 and larger
batches compile once each. The step compiles as one whole graph or not at all: a model whose step Dynamo cannot
trace whole decodes eagerly, with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from tformer.engine.packing import packed_views
from tformer.engine.paged import PagedKVCache, PagedLayerKV
from tformer.engine.scheduler import SequenceState
from tformer.layers.attention import Attention
from tformer.layers.kv_cache import CrossKV, LayerCache
from tformer.models import DecoderLM, EncoderDecoder, TransformerModel
from tformer.models.stack import StackInputs, engine_key_count

logger = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """The tensors of one step: tokens and positions (B, T) with -1 positions as padding, last_index (B,);
    `last_slots` when every row's tokens sit in the last columns of the keys: all rows start at one position
    and are padded on the right (whole prompts from 0; past one token a row, chunks after cached tokens).
    A `packed` step holds every sequence's tokens side by side in one row, (1, N), and last_index (B,) the
    column of each one's last token (packing.py)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    last_index: torch.Tensor
    last_slots: bool = False
    packed: bool = False

    @classmethod
    def build(cls, chunks: list[list[int]], starts: list[int], device: torch.device) -> StepBatch:
        """Row i holds chunks[i], the tokens at positions starts[i], starts[i] + 1, ..."""
        width = max(len(chunk) for chunk in chunks)
        rows = list(zip(chunks, starts, strict=True))  # whole rows built in Python, then one tensor each
        tokens = torch.tensor([chunk + [0] * (width - len(chunk)) for chunk, _ in rows])
        positions = torch.tensor(
            [[*range(start, start + len(chunk)), *[-1] * (width - len(chunk))] for chunk, start in rows]
        )
        last_index = torch.tensor([len(chunk) - 1 for chunk in chunks])
        last_slots = not any(starts) or (width > 1 and len(set(starts)) == 1)
        return cls(tokens.to(device), positions.to(device), last_index.to(device), last_slots)

    @classmethod
    def pack(cls, chunks: list[list[int]], starts: list[int], device: torch.device) -> StepBatch:
        """chunks[i], the tokens at positions starts[i], starts[i] + 1, ..., side by side in one row."""
        tokens = torch.tensor([[token for chunk in chunks for token in chunk]])
        spans = zip(chunks, starts, strict=True)
        positions = torch.cat([torch.arange(start, start + len(chunk)) for chunk, start in spans])
        last_index = torch.tensor(list(itertools.accumulate(len(chunk) for chunk in chunks))) - 1
        # last_slots: the stack's mask over the row stays plain causal (cheap); the cache attends, and never reads it
        return cls(tokens.to(device), positions[None].to(device), last_index.to(device), True, packed=True)

    def last_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden state (B, d) after each sequence's last token, of the stack's output (B|1, T, d)."""
        if self.packed:
            return hidden[0, self.last_index]
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), self.last_index]

    def stack_inputs(self, caches: list[LayerCache]) -> StackInputs:
        """Where the batch's tokens sit for the decoder stack: each row at its own positions over the cache."""
        view = caches[0].self_attn
        key_starts = getattr(view, "key_starts", None)
        n_keys = engine_key_count(caches, self.positions)
        return StackInputs.from_engine(self.positions, n_keys, key_starts, self.last_slots)


# The decode step's time at batch 1 is dispatch, not arithmetic, so these options cut per-call work: no size asserts;
# no guards on the modules; inductor's C++ launcher; and the graph's small kernels on one thread, since each opened an
# OpenMP region (matmuls and attention are custom ops, which keep torch's threads). Skipping the module guards is safe
# because a served model is frozen, each model's step has its own graph cache (`compiled_decode_step`), and the step
# compiles as one graph (`fullgraph`): a graph break would compile a layer's frame alone, shared by every layer with
# none of its modules or Python values checked (docs/design-notes.md, "engine/runner.py").
DECODE_COMPILE_OPTIONS = {
    "size_asserts": False,
    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    "cpp_wrapper": True,
    "cpp.threads": 1,
}


# Under `dynamic=True` Dynamo also makes every Python float it meets (norm epsilons, scales) a graph input, a 0-dim
# tensor built on every call. A served model's floats never change, so the step specializes on them
# (docs/design-notes.md, "engine/runner.py").
# Made on first use: `torch._dynamo` takes over a second to import, which only a compiling engine should pay.
@functools.cache
def _floats_as_constants() -> contextlib.AbstractContextManager:
    return torch._dynamo.config.patch(specialize_float=True)


def _decode_step(stack: nn.Module, tokens: torch.Tensor, inputs: StackInputs, **kwargs: object) -> torch.Tensor:
    return stack(tokens, inputs, **kwargs)


class OneGraphStep:
    """A decoder stack's decode step compiled as one whole graph, `step(stack, tokens, inputs, **kwargs)`; once Dynamo
    finds that the step does not compile as one graph (a construct it cannot trace, its recompile limit), the stack
    decodes eagerly from then on, with one warning. A user's request never fails for it, and no step runs as pieces
    of graphs that skip the module guards."""

    def __init__(self) -> None:
        # a code object of its own, since Dynamo keeps graphs and guards per code object
        code = _decode_step.__code__.replace()
        own = types.FunctionType(code, _decode_step.__globals__, _decode_step.__name__)
        self.compiled: Callable | None = torch.compile(
            own, dynamic=True, fullgraph=True, options=DECODE_COMPILE_OPTIONS
        )

    def __call__(self, stack: nn.Module, tokens: torch.Tensor, inputs: StackInputs, **kwargs: object) -> torch.Tensor:
        if self.compiled is None:
            return stack(tokens, inputs, **kwargs)
        try:
            with _floats_as_constants():
                return self.compiled(stack, tokens, inputs, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.FailOnRecompileLimitHit) as err:
            # Dynamo raises Unsupported too for an exception the model raised while traced (a bad input): the eager
            # step raises it again here, and the step stays compiled for the next inputs.
            hidden = stack(tokens, inputs, **kwargs)
            self.compiled = None
            logger.warning(
                "the model's decode step does not compile as one graph (%s); decoding continues uncompiled "
                "for this model",
                _dynamo_reason(err),
            )
            return hidden
        except torch._dynamo.exc.BackendCompilerFailed as err:
            raise RuntimeError(
                f"compiling the decode step failed ({type(err.inner_exception).__name__}: {err.inner_exception}); "
                "torch.compile on the CPU needs a working C++ compiler; install one, or run without --compile "
                "(EngineConfig(compile=False))"
            ) from None


def _dynamo_reason(err: Exception) -> str:
    """What Dynamo said it could not compile, and where in the model: "<what>: <explanation> at file:line in f"."""
    if not isinstance(err, torch._dynamo.exc.Unsupported) and isinstance(err.__cause__, Exception):
        err = err.__cause__  # the recompile limit: its own message only says that fullgraph made it an error
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reason = ": ".join(lines[:2]).replace("Explanation: ", "")
    frames = getattr(err, "real_stack", None)
    if frames:
        reason += f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
    return f"Dynamo: {reason}"


# The compiled step of each decoder stack, made once: engines over one model share its graphs.
_COMPILED_STEPS: weakref.WeakKeyDictionary[nn.Module, OneGraphStep] = weakref.WeakKeyDictionary()


def compiled_decode_step(stack: nn.Module) -> OneGraphStep:
    """`stack`'s compiled decode step. Each stack gets a step with a code object of its own, since Dynamo keeps graphs
    and guards per code object: another model never meets this one's graphs, and a new engine over the same model
    compiles nothing again (nor tries again once its step fell back to eager)."""
    step = _COMPILED_STEPS.get(stack)
    if step is None:
        step = _COMPILED_STEPS[stack] = OneGraphStep()
    return step


class CompiledDecode:
    """The decoder stack for decode steps: compiled on first use when asked to, else the module itself."""

    def __init__(self, stack: nn.Module, compile: bool) -> None:
        self.stack = stack
        self.compiled = compiled_decode_step(stack) if compile else None

    def __call__(self, tokens: torch.Tensor, inputs: StackInputs, **kwargs: object) -> torch.Tensor:
        # A step over one key (an encoder-decoder's first decoder token) runs eager: Dynamo specializes sizes of 1,
        # so it would compile a graph of its own for each batch size just for that step.
        if self.compiled is None or tokens.shape[1] != 1 or inputs.n_keys == 1:
            return self.stack(tokens, inputs, **kwargs)
        # The rotary (cos, sin) are computed here, once a step: inside the graph inductor recomputed them in each
        # layer's kernel (its reuse heuristic realizes shared buffers only for ops such as exp and tanh), far more
        # than once eagerly (docs/design-notes.md, "engine/runner.py").
        inputs = replace(inputs, rotary=self.stack.positions.rotary(inputs.positions))
        return self.compiled(self.stack, tokens, inputs, **kwargs)


class ModelRunner(Protocol):
    """What the engine asks of a family: its rules for a request, and the logits of one step."""

    prefix_caching: bool  # whether a sequence's tokens alone determine its keys and values

    def split_prompt(self, ids: list[int], bos_id: int) -> tuple[list[int], list[int] | None]:
        """(the decoder's prompt, the encoder's source or None) of a request's prompt tokens."""
        ...

    def context_lengths(self, prompt_len: int) -> tuple[int, int]:
        """(the positions a prompt of prompt_len tokens takes from its output's room in the context, its source
        tokens)."""
        ...

    def start(self, seq: SequenceState) -> None:
        """Prepares a sequence's per-request state before its first step (an encoder's output)."""
        ...

    def packs(self) -> bool:
        """Whether a step's prompt chunks may run packed in one row (packing.py)."""
        ...

    def logits(
        self, seqs: list[SequenceState], batch: StepBatch, views: list[PagedLayerKV], every_position: bool = False
    ) -> torch.Tensor:
        """Each row's next-token logits (B, V); with `every_position`, those after every token (B, T, V)."""
        ...


class DecoderRunner:
    """Decoder-only models: the prompt is the start of the sequence itself."""

    prefix_caching = True

    def __init__(self, model: DecoderLM, compile: bool = False) -> None:
        self.model = model
        self.decoder = CompiledDecode(model.decoder, compile)

    def split_prompt(self, ids: list[int], bos_id: int) -> tuple[list[int], list[int] | None]:
        return ids, None

    def context_lengths(self, prompt_len: int) -> tuple[int, int]:
        return prompt_len, 0

    def start(self, seq: SequenceState) -> None:
        """Nothing to prepare: a decoder has no per-request state besides its KV blocks."""

    def packs(self) -> bool:
        """Whether prompt chunks may run packed in one row: every layer's self-attention attends plainly (what the
        packed cache computes per sequence), with no sliding window or position bias. Other attentions (Longformer's,
        Performer's, a layer keeping its weights) decline; embeddings, norms and FFNs treat each token alone."""
        stack = self.model.decoder
        if any(stack.windows) or stack.positions.has_attention_bias:
            return False
        return all(isinstance(attn := layer.self_attn, Attention) and attn.attends_plainly() for layer in stack.layers)

    def logits(
        self, seqs: list[SequenceState], batch: StepBatch, views: list[PagedLayerKV], every_position: bool = False
    ) -> torch.Tensor:
        """Each row's next-token logits (B, V); with `every_position`, those after every token (B, T, V)."""
        caches = [LayerCache(view) for view in views]
        hidden = self.decoder(batch.tokens, batch.stack_inputs(caches), cache=caches)
        if every_position:
            return self.model.output_logits(hidden).float()
        return self.model.output_logits(batch.last_hidden(hidden)).float()  # (B, V)


@dataclass
class EncoderState:
    """A request's encoder output, as cross-attention keys and values (1, Hkv, S, D) per decoder layer."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


class Seq2SeqRunner:
    """Encoder-decoder models: the request's prompt is the source, which goes through the encoder once; the decoder
    starts from <s> alone. No prefix caching: the decoder's keys and values depend on the source too."""

    prefix_caching = False

    def __init__(self, model: EncoderDecoder, compile: bool = False) -> None:
        self.model = model
        self.decoder = CompiledDecode(model.decoder, compile)

    def split_prompt(self, ids: list[int], bos_id: int) -> tuple[list[int], list[int] | None]:
        return [bos_id], ids

    def context_lengths(self, prompt_len: int) -> tuple[int, int]:
        # the target's positions are the decoder's own, whatever the source's length: <s> takes position 0, the
        # output tokens 1.., and the last one is never fed back, so max_model_len of them fit, as translate_ids allows
        return 0, prompt_len

    def packs(self) -> bool:
        """Never: each row's cross-attention reads its own source."""
        return False

    def start(self, seq: SequenceState) -> None:
        if seq.encoder_state is not None:
            return
        source = torch.tensor([seq.source], device=self.model.decoder.tokens.weight.device)  # (1, S)
        memory = self.model.encode(source)
        pairs = [layer.cross_attn.project_kv(memory) for layer in self.model.decoder.layers]
        seq.encoder_state = EncoderState([k for k, _ in pairs], [v for _, v in pairs])

    def logits(
        self, seqs: list[SequenceState], batch: StepBatch, views: list[PagedLayerKV], every_position: bool = False
    ) -> torch.Tensor:
        if every_position:
            raise NotImplementedError("speculative decoding serves decoder-only models")
        states: list[EncoderState] = [seq.encoder_state for seq in seqs]
        width = max(state.length for state in states)
        padding = torch.zeros(len(seqs), width, dtype=torch.bool, device=batch.tokens.device)
        for row, state in enumerate(states):
            padding[row, : state.length] = True
        caches = []
        for layer, view in enumerate(views):
            keys = _pad_stack([state.keys[layer] for state in states], width)
            values = _pad_stack([state.values[layer] for state in states], width)
            caches.append(LayerCache(view, CrossKV(keys, values)))
        hidden = self.decoder(batch.tokens, batch.stack_inputs(caches), memory_padding=padding, cache=caches)
        return self.model.lm_head(batch.last_hidden(hidden)).float()


def _pad_stack(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """(1, H, S_i, D) tensors -> (B, H, width, D), zero-padded along S."""
    first = tensors[0]
    out = first.new_zeros(len(tensors), first.shape[1], width, first.shape[3])
    for row, t in enumerate(tensors):
        out[row, :, : t.shape[2]] = t[0]
    return out


RUNNERS: dict[type[nn.Module], Callable[..., ModelRunner]] = {
    DecoderLM: DecoderRunner,
    EncoderDecoder: Seq2SeqRunner,
}


def make_runner(model: TransformerModel, compile: bool = False) -> ModelRunner:
    """The runner of the model's family: the first class in its method resolution order that `RUNNERS` holds."""
    for cls in type(model).__mro__:
        if cls in RUNNERS:
            return RUNNERS[cls](model, compile)
    families = ", ".join(sorted(cls.__name__ for cls in RUNNERS))
    raise TypeError(
        f"the engine generates with {families} models, not {type(model).__name__} "
        "(an encoder has no next-token distribution); register a runner in tformer.engine.runner.RUNNERS"
    )


def step_inputs(
    kv: PagedKVCache, tables: list[list[int]], chunks: list[list[int]], starts: list[int], pack: bool
) -> tuple[StepBatch, list[PagedLayerKV]]:
    """The batch and every layer's cache view for one forward over chunks[i] from position starts[i] through block
    table tables[i]: prompt chunks packed in one row when `pack` (a single one too, for the attention kernel packed
    steps use), else padded (B, T)."""
    device = kv.k[0].device
    if pack and min(len(chunk) for chunk in chunks) > 1:
        return StepBatch.pack(chunks, starts, device), packed_views(kv, tables, starts, [len(c) for c in chunks])
    batch = StepBatch.build(chunks, starts, device)
    return batch, kv.step_views(tables, batch.positions)


def group_by_width(
    scheduled: list[tuple[SequenceState, int]], max_padding: float = 0.1, pack: bool = False
) -> list[list[tuple[SequenceState, int]]]:
    """Splits a step into forwards: decode rows (one new token) run together; prompt chunks run together when
    padding them to the widest of their group wastes at most `max_padding` of the group's tokens, or all in one
    packed row with `pack` (no padding at all; see packing.py).

    A batch is padded to its widest row, so one 500-token chunk among 32 decodes would cost 32 x 500 tokens;
    chunks of similar widths, though, share one forward and its larger matmuls, and each forward has a cost of its
    own (an eager prefill launches some 40 ops a layer whatever its width). The default 0.1 prefilled
    engine_vs_hf.py's workload faster than 0.25 or no padding at all (docs/design-notes.md, "engine/runner.py").
    """
    decodes = [item for item in scheduled if item[1] == 1]
    if pack:
        prompts = [item for item in scheduled if item[1] > 1]
        return [group for group in (decodes, prompts) if group]
    groups: list[list[tuple[SequenceState, int]]] = []
    for item in sorted((item for item in scheduled if item[1] > 1), key=lambda item: -item[1]):
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * group[0][1] <= (1 + max_padding) * (
            sum(n for _, n in group) + item[1]
        ):
            group.append(item)
        else:
            groups.append([item])
    return ([decodes] if decodes else []) + groups
