"""Model tests: causality, padding, backend and GQA equivalences, activation checkpointing, the headless encoder and
ALiBi in every layer. The references are the same output computed another way (alone instead of padded, the math
backend, MHA with repeated KV heads, no checkpointing) and gradients that vanish exactly where the mask says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import logits, make_model, tiny_config, tokens, with_config

from tformer import ModelConfig, TransformerModel
from tformer.config import ATTENTION_BACKEND_NAMES, NORM_PLACEMENTS, POSITION_NAMES

# ---- causality ----------------------------------------------------------------------------------------------------


def embedding_gradients(model: TransformerModel, tgt: torch.Tensor, src: torch.Tensor | None = None) -> torch.Tensor:
    """g[t, s] = sum |d logits[:, t].sum() / d e_s| over the batch, e_s the token embedding output at s.

    A forward hook hands back the token embedding's output, so gradients reach it whatever is added after.
    """
    decoder = model.decoder
    memory = model.encode(src) if src is not None else None  # before hooking: the embedding may be shared
    captured: list[torch.Tensor] = []
    handle = decoder.tokens.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        out = model(tgt) if src is None else model.decode(tgt, memory)
    finally:
        handle.remove()
    (embedded,) = captured
    rows = []
    for t in range(tgt.shape[1]):
        (grad,) = torch.autograd.grad(out[:, t].sum(), embedded, retain_graph=True)
        rows.append(grad.abs().sum(dim=(0, 2)))  # (T,)
    return torch.stack(rows)  # (T_out, T_in)


def causal_inputs(config: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    tgt = tokens(2, length, config.tgt_vocab_size)
    src = tokens(2, 5, config.vocab_size, seed=2) if config.family == "encoder-decoder" else None
    return tgt, src


@pytest.mark.parametrize("backend", ATTENTION_BACKEND_NAMES)
@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
@pytest.mark.parametrize("position", POSITION_NAMES)
@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_output_never_depends_on_later_inputs(family: str, position: str, placement: str, backend: str) -> None:
    config = tiny_config(family, position=position, norm_placement=placement, attention_backend=backend)
    model = make_model(config)
    grads = embedding_gradients(model, *causal_inputs(config, 7))
    future = torch.ones_like(grads, dtype=torch.bool).triu(1)
    assert (grads[future] == 0).all(), "an output depends on a later input"
    assert (grads[~future] > 0).all(), "an output ignores an earlier input"


@pytest.mark.parametrize("backend", ATTENTION_BACKEND_NAMES)
@pytest.mark.parametrize("position", POSITION_NAMES)
@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_sliding_window_limits_what_an_output_sees(family: str, n_layers: int, position: str, backend: str) -> None:
    window = 3
    config = tiny_config(
        family, position=position, sliding_window=window, n_decoder_layers=n_layers, attention_backend=backend
    )
    model = make_model(config)
    grads = embedding_gradients(model, *causal_inputs(config, 10))
    t, s = torch.arange(10)[:, None], torch.arange(10)[None, :]
    # one layer sees t-w+1..t; each further layer reaches w-1 positions further back
    visible = (s <= t) & (s > t - n_layers * (window - 1) - 1)
    assert (grads[~visible] == 0).all(), "an output depends on an input outside its window"
    assert (grads[visible] > 0).all(), "an output ignores an input inside its window"


# ---- padding ------------------------------------------------------------------------------------------------------


def pad(rows: list[torch.Tensor], length: int, side: str, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads 1-D token rows to `length` with random (not pad-id) tokens, so only the mask can hide them."""
    ids = tokens(len(rows), length, vocab_size, seed=99)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for b, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(length - len(row), length)
        ids[b, span], mask[b, span] = row, 1
    return ids, mask


def real(out: torch.Tensor, b: int, n: int, side: str) -> torch.Tensor:
    return out[b, :n] if side == "right" else out[b, out.shape[1] - n :]


PADDING_CASES = [
    ("tiny-gpt2", "right"),
    ("tiny-gpt2", "left"),
    ("tiny-llama", "right"),
    ("tiny-llama", "left"),
    ("tiny-bert", "right"),
    ("tiny-transformer", "right"),
]


@pytest.mark.parametrize("backend", ATTENTION_BACKEND_NAMES)
@pytest.mark.parametrize("position", POSITION_NAMES)
@pytest.mark.parametrize(("preset", "side"), PADDING_CASES)
def test_padding_leaves_real_positions_unchanged(preset: str, side: str, position: str, backend: str) -> None:
    model = make_model(tiny_config(preset, position=position, attention_backend=backend))
    check_padding(model, side)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_with_sliding_window_and_gqa(side: str) -> None:
    model = make_model(tiny_config("tiny-llama", sliding_window=3, n_kv_heads=1))
    check_padding(model, side)


def check_padding(model: TransformerModel, side: str) -> None:
    config = model.config
    tgt_rows = [tokens(1, 7, config.tgt_vocab_size, 2)[0], tokens(1, 4, config.tgt_vocab_size, 3)[0]]
    src_rows = [tokens(1, 6, config.vocab_size, 4)[0], tokens(1, 3, config.vocab_size, 5)[0]]
    tgt, tgt_mask = pad(tgt_rows, 9, side, config.tgt_vocab_size)
    src, src_mask = pad(src_rows, 8, side, config.vocab_size)
    with torch.no_grad():
        padded = logits(model, tgt, tgt_mask, src, src_mask)
        for b, row in enumerate(tgt_rows):
            alone = logits(model, row[None], src=src_rows[b][None])[0]
            torch.testing.assert_close(real(padded, b, len(row), side), alone, atol=1e-5, rtol=1e-5)


# ---- attention backends -------------------------------------------------------------------------------------------

BACKEND_CASES = {
    "gpt2": ("tiny-gpt2", {}),
    "transformer": ("tiny-transformer", {}),
    "bert": ("tiny-bert", {}),
    "alibi": ("tiny-gpt2", {"position": "alibi"}),
    "alibi-encoder": ("tiny-bert", {"position": "alibi"}),
    "window": ("tiny-llama", {"sliding_window": 3}),
    "gqa": ("tiny-llama", {}),
    "mqa": ("tiny-llama", {"n_kv_heads": 1}),
    "gqa-cross": ("tiny-transformer", {"n_kv_heads": 2}),
    "alibi-window-gqa": ("tiny-llama", {"position": "alibi", "sliding_window": 4}),
}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", BACKEND_CASES)
def test_sdpa_backend_equals_math_backend(case: str, padded: bool) -> None:
    preset, overrides = BACKEND_CASES[case]
    sdpa = make_model(tiny_config(preset, attention_backend="sdpa", **overrides)).train()
    math_model = with_config(sdpa, attention_backend="math")
    config = sdpa.config
    tgt, src = tokens(2, 8, config.tgt_vocab_size), tokens(2, 6, config.vocab_size, seed=2)
    tgt_mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3]) if padded else None
    src_mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4]) if padded else None
    outputs, grads = [], []
    for model in (sdpa, math_model):
        out = logits(model, tgt, tgt_mask, src, src_mask)
        loss = out[tgt_mask.bool()].sum() if padded else out.sum()
        loss.backward()
        outputs.append(out if not padded else out[tgt_mask.bool()])
        grads.append({name: p.grad for name, p in model.named_parameters()})
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-4, rtol=1e-4, msg=name)


# ---- grouped-query attention --------------------------------------------------------------------------------------


def expand_kv_heads(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The MHA weights equal to a GQA model: each KV head's rows repeated for every query head of its group."""
    n_rep = config.n_heads // config.n_kv_heads
    expanded = {}
    for name, value in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            heads = value.reshape(config.n_kv_heads, config.head_dim, -1)  # (Hkv, D, d_model | 1)
            value = heads.repeat_interleave(n_rep, dim=0).reshape(config.n_heads * config.head_dim, *value.shape[1:])
        expanded[name] = value
    return expanded


GQA_CASES = [
    ("tiny-llama", {"n_kv_heads": 2}),
    ("tiny-llama", {"n_kv_heads": 1}),
    ("tiny-llama", {"n_kv_heads": 2, "attn_bias": True, "position": "alibi", "sliding_window": 4}),
    ("tiny-transformer", {"n_kv_heads": 2}),
    ("tiny-transformer", {"n_kv_heads": 1}),
    ("tiny-bert", {"n_kv_heads": 1}),
]


@pytest.mark.parametrize("backend", ATTENTION_BACKEND_NAMES)
@pytest.mark.parametrize(("preset", "overrides"), GQA_CASES)
def test_gqa_equals_mha_with_repeated_kv_heads(preset: str, overrides: dict, backend: str) -> None:
    gqa = make_model(tiny_config(preset, attention_backend=backend, **overrides))
    config = gqa.config
    assert config.n_kv_heads < config.n_heads
    mha = make_model(ModelConfig.from_dict({**config.to_dict(), "n_kv_heads": config.n_heads}), seed=1)
    mha.load_state_dict(expand_kv_heads(gqa.state_dict(), config))
    tgt, src = tokens(2, 8, config.tgt_vocab_size), tokens(2, 6, config.vocab_size, seed=2)
    mask = torch.tensor([[1] * 8, [0] * 2 + [1] * 6]) if config.family == "decoder" else None
    with torch.no_grad():
        torch.testing.assert_close(logits(gqa, tgt, mask, src), logits(mha, tgt, mask, src), atol=1e-5, rtol=1e-5)


# ---- activation checkpointing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-transformer", "tiny-llama", "tiny-bert"])
def test_activation_checkpointing_gives_same_loss_and_gradients(preset: str, monkeypatch) -> None:
    import tformer.models.stack as stack_module

    calls = []
    real_checkpoint = stack_module.checkpoint
    monkeypatch.setattr(stack_module, "checkpoint", lambda *a, **k: calls.append(1) or real_checkpoint(*a, **k))
    plain = make_model(tiny_config(preset)).train()
    checkpointed = with_config(plain, activation_checkpointing=True)
    config = plain.config
    tgt, src = tokens(2, 8, config.tgt_vocab_size), tokens(2, 6, config.vocab_size, seed=2)
    results = []
    for model in (plain, checkpointed):
        out = logits(model, tgt, src=src)
        loss = F.cross_entropy(out.flatten(0, 1), tgt.roll(-1, dims=1).flatten())
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    n_layers = config.n_encoder_layers * config.has_encoder + config.n_decoder_layers * config.has_decoder
    assert len(calls) == n_layers, "checkpointing was not used"
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], atol=1e-6, rtol=1e-5, msg=name)


# ---- the encoder without its head, ALiBi in every layer --------------------------------------------------------


def test_encoder_without_head_returns_the_hidden_states() -> None:
    mlm = make_model(tiny_config("tiny-bert"))
    headless = make_model(tiny_config("tiny-bert", encoder_head="none"), seed=1)
    missing, unexpected = headless.load_state_dict(mlm.state_dict(), strict=False)
    assert not missing and all(name.startswith("mlm_head.") for name in unexpected)
    ids, mask = tokens(2, 10, 97), torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    with torch.no_grad():
        torch.testing.assert_close(headless(ids, mask), mlm.encode(ids, mask), atol=0, rtol=0)


def test_alibi_bias_reaches_every_layer() -> None:
    model = make_model(tiny_config("tiny-gpt2", position="alibi"))
    masks = []
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda module, args: masks.append(args[1]))
    with torch.no_grad():
        model(tokens(1, 5, 97))
    slopes = torch.tensor([2**-2, 2**-4, 2**-6, 2**-8])
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    expected = (-slopes[:, None, None] * (i - j).abs()).masked_fill(j > i, torch.finfo(torch.float32).min)
    assert len(masks) == 2
    for mask in masks:
        torch.testing.assert_close(mask.bias[0], expected, atol=1e-7, rtol=0)
