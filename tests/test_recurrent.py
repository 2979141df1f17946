"""The LSTM encoder-decoder (models/recurrent.py) against references: torch.nn.LSTM run directly, the LSTM and
Luong-attention formulas written out step by step, its own teacher-forced forward, an uncached argmax loop, an
exhaustive search, and its checkpoint read back; plus its config checks and a run of the real trainer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from conftest import make_model, tokens, uncached_greedy
from helpers import trainer, write_recipe

from tformer import ModelConfig, build_model, load
from tformer.checkpoints import resolve_checkpoint
from tformer.decoding.search import beam_search, greedy_search, length_penalty, translate_ids
from tformer.decoding.translator import Translator
from tformer.errors import ConfigError
from tformer.models import LSTMEncoderDecoder
from tformer.training import evaluate_checkpoint, load_recipe

PAD, BOS, EOS = 0, 1, 2
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def lstm_model(vocab_size: int = 97, seed: int = 0, **overrides: object) -> LSTMEncoderDecoder:
    config = ModelConfig.from_preset(
        "tiny-transformer",
        family="lstm-encoder-decoder",
        vocab_size=vocab_size,
        d_model=16,
        lstm_hidden=12,
        dropout=0.0,
        **overrides,
    )
    return make_model(config, seed=seed)


def padded_sources(lengths: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sources (B, max length) of random non-special tokens, and their masks (1 on real tokens)."""
    src = tokens(len(lengths), max(lengths), vocab_size - 3, seed=3) + 3
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return src.masked_fill(mask == 0, PAD), mask


def lstm_formula(x: torch.Tensor, weights: list[torch.Tensor], hidden: int) -> torch.Tensor:
    """One LSTM layer over x (T, D), a step at a time: i, f, o = sigma(.), g = tanh(.), c = f c + i g, h = o tanh(c)."""
    w_ih, w_hh, b_ih, b_hh = weights
    h, c, out = torch.zeros(hidden), torch.zeros(hidden), []
    for x_t in x:
        i, f, g, o = (w_ih @ x_t + b_ih + w_hh @ h + b_hh).split(hidden)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        out.append(h)
    return torch.stack(out)


def layer_weights(lstm: torch.nn.LSTM, layer: int) -> list[torch.Tensor]:
    return [getattr(lstm, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


@torch.no_grad()
def test_the_encoder_equals_a_bidirectional_torch_lstm_run_on_each_unpadded_sentence() -> None:
    model = lstm_model()
    encoder, (n_layers, half) = model.encoder, (model.config.n_encoder_layers, model.config.lstm_hidden // 2)
    reference = torch.nn.LSTM(model.config.d_model, half, n_layers, batch_first=True, bidirectional=True)
    for layer in range(n_layers):
        for suffix, lstm in (("", encoder.forward_lstms[layer]), ("_reverse", encoder.backward_lstms[layer])):
            for name, value in lstm.named_parameters():
                getattr(reference, name.replace("_l0", f"_l{layer}{suffix}")).copy_(value)
    src, mask = padded_sources([7, 3, 5, 1], model.config.vocab_size)
    memory = model.encode(src, mask)  # (B, S, H)
    for row, length in enumerate(mask.sum(1).tolist()):
        embedded = model.src_tokens(src[row : row + 1, :length]) * model.embed_scale
        expected, _ = reference(embedded)
        torch.testing.assert_close(memory[row, :length], expected[0], rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_teacher_forced_logits_equal_the_lstm_and_luong_formulas_step_by_step() -> None:
    model = lstm_model(lm_head_bias=True)
    hidden = model.config.lstm_hidden
    src, src_mask = padded_sources([6, 2], model.config.vocab_size)
    tgt = tokens(2, 5, model.config.vocab_size, seed=4)
    logits = model(src, tgt, src_mask)
    memory = model.encode(src, src_mask)  # the encoder's own reference is the test above
    w_a, w_c = model.attention.score_proj.weight.T, model.attention.combine.weight
    for row in range(2):
        x = model.tgt_tokens(tgt[row]) * model.embed_scale  # (T, E)
        for layer in range(model.config.n_decoder_layers):
            x = lstm_formula(x, layer_weights(model.decoder, layer), hidden)
        m = memory[row, : int(src_mask[row].sum())]  # (S_b, H): only real source tokens
        for t, h_t in enumerate(x):
            a = torch.softmax(torch.stack([h_t @ w_a @ m_s for m_s in m]), 0)  # score(h_t, m_s) = h_t^T W_a m_s
            context = (a[:, None] * m).sum(0)
            attentional = torch.tanh(w_c @ torch.cat([context, h_t]))
            expected = model.lm_head.weight @ attentional + model.lm_head.bias  # tied: the target embedding
            torch.testing.assert_close(logits[row, t], expected, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_cached_step_by_step_decoding_equals_the_teacher_forced_forward() -> None:
    model = lstm_model()
    src, src_mask = padded_sources([6, 2, 4], model.config.vocab_size)
    tgt = tokens(3, 7, model.config.vocab_size, seed=5)
    full = model(src, tgt, src_mask)
    memory, cache = model.encode(src, src_mask), model.new_cache(3, 8)
    steps = [model.decode(tgt[:, :2], memory, src_mask, cache=cache, start=0)]  # a two-token first call
    steps += [model.decode(tgt[:, t : t + 1], None, src_mask, cache=cache, start=t) for t in range(2, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="start=3"):
        model.decode(tgt[:, :1], None, src_mask, cache=cache, start=3)


def test_greedy_translation_through_translate_ids_equals_an_uncached_argmax_loop() -> None:
    model = lstm_model(vocab_size=12, seed=1)
    sources = [[5, 7, 3, 9], [4], [8, 8, 6], [11, 3, 5, 7, 10, 6]]
    # A random model rarely picks </s>; call </s> the third token row 0 would choose, so that rows end early.
    eos = uncached_greedy(model, sources[:1], BOS, EOS, max_extra=4)[0][2]
    expected = uncached_greedy(model, sources, BOS, eos, max_extra=4)
    assert any(len(hyp) < len(src) + 5 for hyp, src in zip(expected, sources, strict=True)), "some stop on </s>"
    assert translate_ids(model, sources, BOS, eos, PAD, beam_size=1, extra_len=4) == expected
    src, src_mask = padded_sources([4, 2], 12)
    one_beam = beam_search(model, src, src_mask, 6, BOS, EOS, beam_size=1, alpha=0.0)
    assert one_beam == greedy_search(model, src, src_mask, 6, BOS, EOS)


def brute_force_best(model: LSTMEncoderDecoder, source: torch.Tensor, max_len: int, alpha: float) -> tuple:
    """The best length-penalised hypothesis over every y_1..y_k </s> (k < max_len) and every max_len tokens, with
    its margin over the runner-up: what beam search must return when it is wide enough to keep everything."""
    vocab = [v for v in range(model.config.vocab_size) if v != EOS]
    scored = []
    with torch.no_grad():
        for k in range(max_len + 1):
            for body in itertools.product(vocab, repeat=k):
                sequence = [*body, EOS] if k < max_len else list(body)
                log_probs = torch.log_softmax(model(source, torch.tensor([[BOS, *sequence[:-1]]]))[0], -1)
                logp = sum(log_probs[t, token].item() for t, token in enumerate(sequence))
                scored.append((logp / length_penalty(k + 1, alpha), list(body)))
    scored.sort(key=lambda s: s[0], reverse=True)
    return scored[0][1], scored[0][0] - scored[1][0]


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_wide_beam_finds_the_best_hypothesis(alpha: float) -> None:
    model = lstm_model(vocab_size=7, seed=3)
    src, src_mask = padded_sources([4, 2], 7)
    beam = beam_search(model, src, src_mask, 3, BOS, EOS, beam_size=126, alpha=alpha)
    for b in range(2):
        expected, margin = brute_force_best(model, src[b : b + 1, : int(src_mask[b].sum())], 3, alpha)
        assert margin > 1e-4, "the test needs a unique best hypothesis"
        assert beam[b] == expected


def test_beam_search_on_a_batch_equals_beam_search_on_each_source_alone() -> None:
    """Sources finish at different steps and leave the batch, so the state and the memory shrink with it; this
    is the test that fails when the recurrent state does not follow its beam (the exhaustive one above finds
    the empty hypothesis best for these tiny random models, which the first step decides)."""
    model = lstm_model(vocab_size=12, seed=2)
    sources = [[5, 7, 3, 9], [4], [8, 8, 6], [11, 3, 5, 7, 10, 6]]
    batched = translate_ids(model, sources, BOS, EOS, PAD, beam_size=3, extra_len=6)
    assert batched == [translate_ids(model, [s], BOS, EOS, PAD, beam_size=3, extra_len=6)[0] for s in sources]
    assert len({len(hyp) for hyp in batched}) > 1, "rows should end at different steps"


def test_the_transformer_only_keys_do_not_apply_and_contradictions_say_what_to_change() -> None:
    model_config, _ = load_recipe(CONFIGS / "lstm-en-de.yaml")  # preset transformer-base: heads, d_ff, norms
    assert model_config.family == "lstm-encoder-decoder" and model_config.n_heads == 8
    with pytest.raises(ConfigError, match="sliding_window, activation_checkpointing .* remove sliding_window, act"):
        ModelConfig(family="lstm-encoder-decoder", sliding_window=8, activation_checkpointing=True)
    with pytest.raises(ConfigError, match="even lstm_hidden"):
        ModelConfig(family="lstm-encoder-decoder", lstm_hidden=455)
    with pytest.raises(ConfigError, match="lstm_hidden applies to family 'lstm-encoder-decoder' only"):
        ModelConfig(lstm_hidden=456)


def test_the_recipe_has_the_main_transformers_parameter_count_within_two_percent() -> None:
    def count(recipe: str) -> int:
        config, train = load_recipe(CONFIGS / recipe, [f"model.vocab_size={4000}"])
        assert train.vocab_size == 4000  # the trainer sets the model's vocabulary to the tokenizer's
        return build_model(config, initialize=False).num_parameters()

    transformer, lstm = count("en-de-10min.yaml"), count("lstm-en-de.yaml")
    assert abs(lstm / transformer - 1) <= 0.02, (lstm, transformer)


def test_the_trainer_trains_it_and_its_checkpoint_translates_and_evaluates(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, max_steps=12, save_every=12, log_every=4)
    run = trainer(recipe, "model.family=lstm-encoder-decoder", "model.lstm_hidden=24", "model.dropout=0.0")
    result = run.fit()
    assert result["step"] == 12 and isinstance(run.model, LSTMEncoderDecoder)
    checkpoint = resolve_checkpoint(run.run_dir)
    restored = load(checkpoint)
    for name, value in run.model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name
    sentences, tok = ["three one four", "two"], run.data.tokenizer
    ids = translate_ids(run.model.eval(), tok.encode_batch(sentences), tok.bos_id, tok.eos_id, tok.pad_id, 2)
    in_memory = tok.decode_batch(ids)
    assert Translator.load(run.run_dir).translate_batch(sentences, 2) == in_memory
    scored = evaluate_checkpoint(run.run_dir, data=run.config.corpus, beam_size=2, limit=4)
    assert len(scored.hypotheses) == 4 and scored.bleu >= 0.0
