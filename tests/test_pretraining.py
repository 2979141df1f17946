"""Pretraining: packed causal-LM blocks, the warmup-cosine schedule and the held-out LM scores of `tformer eval`,
each against a direct computation."""

from __future__ import annotations

import math
import random

import pytest
import torch
import yaml
from conftest import make_model, tiny_config
from helpers import LINES

from tformer.cli import main
from tformer.config import ConfigError
from tformer.data import IGNORE_INDEX, Tokenizer, Vocab, causal_lm, masked_lm
from tformer.data.packing import pack_sequences, packed_causal_lm, token_stream
from tformer.training.config import TrainConfig
from tformer.training.corpus import batch_objective, prepare_data
from tformer.training.lm_eval import score_lm
from tformer.training.optim import adamw_cosine

VOCAB = Vocab(97)


def random_lines(n: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 97) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_packed_batches_hold_every_token_once_in_order(block_size: int) -> None:
    lines = random_lines()
    stream = [t for line in lines for t in [VOCAB.bos_id, *line, VOCAB.eos_id]]  # written out, not token_stream
    blocks = pack_sequences(lines, block_size, VOCAB.bos_id, VOCAB.eos_id)
    assert all(len(b) == block_size + 1 for b in blocks[:-1])
    inputs, labels = [], []
    for start in range(0, len(blocks), 5):  # batches of 5 blocks, as the trainer takes them
        batch = packed_causal_lm(blocks[start : start + 5], VOCAB)
        inputs += batch.input_ids[batch.attention_mask.bool()].tolist()
        labels += batch.labels[batch.attention_mask.bool()].tolist()
    assert inputs == stream[:-1]  # every token once, in order (the last has nothing to predict)
    expected = [IGNORE_INDEX if t == VOCAB.bos_id else t for t in stream[1:]]
    assert labels == expected  # each label is the next token; <s> takes no loss
    trained = [t for t in labels if t != IGNORE_INDEX]
    assert len(trained) == sum(len(line) + 1 for line in lines)  # the targets of causal_lm: each x and its </s>


def test_one_packed_line_is_the_causal_lm_batch() -> None:
    line = random_lines(1)[0]
    packed = packed_causal_lm(pack_sequences([line], len(line) + 1, VOCAB.bos_id, VOCAB.eos_id), VOCAB)
    plain = causal_lm([line], VOCAB)
    for name in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(getattr(packed, name), getattr(plain, name)), name


def test_pack_trains_on_the_packed_stream(tmp_path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    config = TrainConfig(corpus=str(corpus), objective="clm", pack=True, vocab_size=300, max_len=16, max_tokens=64)
    data = prepare_data(config, tmp_path)
    encoded = data.tokenizer.encode_batch(LINES, add_bos=False)
    stream = token_stream(encoded, data.tokenizer.bos_id, data.tokenizer.eos_id)
    assert [t for block in data.examples for t in block[:-1]] == stream[:-1]
    assert data.lengths == [len(block) for block in data.examples] and max(data.lengths) == 17
    assert batch_objective(config) is packed_causal_lm
    with pytest.raises(ConfigError, match="train.pack packs text for the clm objective, not 'mlm'"):
        TrainConfig(objective="mlm", pack=True)


def test_adamw_cosine_follows_warmup_then_cosine() -> None:
    model = make_model(tiny_config())
    peak, warmup, total, floor = 3e-3, 10, 60, 0.1
    optimizer, scheduler = adamw_cosine(model, peak, warmup, total, min_ratio=floor)
    for step in range(80):
        if step < warmup:
            expected = peak * (step + 1) / warmup
        else:
            progress = min(step - warmup, total - warmup) / (total - warmup)
            expected = floor * peak + (peak - floor * peak) * (1 + math.cos(math.pi * progress)) / 2
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12), step
        optimizer.step()
        scheduler.step()


def direct_perplexity(model: torch.nn.Module, lines: list[list[int]]) -> float:
    """exp of the mean NLL, one line at a time, from the log-softmax of each next token."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for line in lines:
            ids = [VOCAB.bos_id, *line, VOCAB.eos_id]
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).float()[0], dim=-1)
            nll -= sum(logp[t, ids[t + 1]].item() for t in range(len(ids) - 1))
            count += len(ids) - 1
    return math.exp(nll / count)


def test_decoder_perplexity_matches_a_direct_computation() -> None:
    model = make_model(tiny_config("tiny-llama"))
    lines = random_lines(12) + [[7] * 70]  # the last is longer than the model's 64 positions: skipped
    score = score_lm(model, lines, VOCAB, batch_size=5)
    assert score.skipped == 1 and score.lines == 12
    assert score.perplexity == pytest.approx(direct_perplexity(model, lines[:12]), rel=1e-5)
    packed = score_lm(model, lines[:12], VOCAB, block_size=8)  # blocks of 8: a context across lines
    blocks = pack_sequences(lines[:12], 8, VOCAB.bos_id, VOCAB.eos_id)
    nll, count = 0.0, 0
    with torch.no_grad():
        for block in blocks:
            logp = torch.log_softmax(model(torch.tensor([block[:-1]])).float()[0], dim=-1)
            scored = [(t, y) for t, y in enumerate(block[1:]) if y != VOCAB.bos_id]
            nll -= sum(logp[t, y].item() for t, y in scored)
            count += len(scored)
    assert packed.tokens == count and packed.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_mlm_accuracy_and_loss_match_a_direct_computation() -> None:
    model = make_model(tiny_config("tiny-bert"))
    lines = [line[:10] + [5] * (10 - len(line)) for line in random_lines(8)]  # equal lengths: one batch, same order
    score = score_lm(model, lines, VOCAB, seed=3)
    batch = masked_lm(lines, VOCAB, torch.Generator().manual_seed(3))
    nll, hits, count = 0.0, 0, 0
    with torch.no_grad():
        logits = model(batch.input_ids, batch.attention_mask).float()
    for row, t in (batch.labels != IGNORE_INDEX).nonzero().tolist():
        label = int(batch.labels[row, t])
        nll -= torch.log_softmax(logits[row, t], dim=-1)[label].item()
        hits += int(int(logits[row, t].argmax()) == label)
        count += 1
    assert score.tokens == count > 0
    assert score.loss == pytest.approx(nll / count, rel=1e-5) and score.accuracy == hits / count


def test_eval_command_prints_a_decoder_checkpoints_perplexity(pretrained, tmp_path, capsys) -> None:
    text = tmp_path / "held_out.txt"
    text.write_text("\n".join(LINES[:6]) + "\n")
    assert main(["eval", "--model", str(pretrained), "--data", str(text)]) == 0
    printed = capsys.readouterr().out
    from tformer.models import load

    model, tokenizer = load(pretrained), Tokenizer.from_file(pretrained)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (VOCAB.bos_id, VOCAB.eos_id)
    expected = direct_perplexity(model, tokenizer.encode_batch(LINES[:6], add_bos=False))
    assert f"perplexity {expected:.2f} on " in printed and "of 6 lines, each line on its own" in printed
    assert yaml.safe_load((pretrained / "config.yaml").read_text())["family"] == "decoder"
