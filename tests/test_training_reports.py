"""What a training run reports: which checkpoint is the best, and its progress in a log that is not a terminal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu
import torch
from helpers import tformer_train, trainer, write_corpus, write_recipe

from tformer.checkpoints import checkpoint_dir, resolve_checkpoint
from tformer.training.checkpoint import STATE_FILE
from tformer.training.evaluate import TranslationResult


def scripted_translations(outputs: list[list[str]]):
    """A stand-in for evaluate_translation that scores the next scripted hypotheses with sacreBLEU."""
    scripted = iter(outputs)

    def evaluate(model, tokenizer, pairs, beam_size, alpha) -> TranslationResult:
        hypotheses = next(scripted)[: len(pairs)]
        references = [r for _, r in pairs]
        score = sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references]).score
        return TranslationResult(score, "scripted", [s for s, _ in pairs], hypotheses, references)

    return evaluate


def bleu(hypotheses: list[str], references: list[str]) -> float:
    return sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references]).score


@pytest.mark.parametrize("final_is_best", [False, True])
def test_the_best_checkpoint_is_chosen_on_the_same_dev_sentences(tmp_path: Path, monkeypatch, final_is_best) -> None:
    """Evaluations during training decode the first 2 of 6 dev sentences, the final one all 6. The final
    checkpoint must compete with its score on those 2 only; when it wins, the trainer state saved with it
    agrees with best.json."""
    recipe = write_recipe(tmp_path)
    dev = write_corpus(tmp_path / "dev.tsv", n=6)
    references = [line.split("\t")[1].strip() for line in dev.read_text().splitlines()]
    words = [r.split() for r in references]
    half = [" ".join(w[: (len(w) + 1) // 2] + ["x"] * (len(w) // 2)) for w in words]  # half the words right
    worse = [" ".join(["x"] * len(w)) for w in words]
    final = (references[:2] if final_is_best else worse[:2]) + references[2:]
    assert bleu(final, references) > bleu(half[:2], references[:2])  # the full set alone would crown the final
    monkeypatch.setattr("tformer.training.trainer.evaluate_translation", scripted_translations([half, worse, final]))
    run = trainer(
        recipe,
        f"train.dev_corpus={dev}",
        "train.max_steps=4",
        "train.save_every=2",
        "train.eval_every=2",
        "train.eval_sentences=2",
    )
    result = run.fit()
    assert result["dev_bleu"] == pytest.approx(bleu(final, references))  # the final score is the whole dev set's
    best_step = 4 if final_is_best else 2
    best_bleu = bleu(final[:2] if final_is_best else half[:2], references[:2])
    record = json.loads((run.run_dir / "best.json").read_text())
    assert record == {"step": best_step, "bleu": pytest.approx(best_bleu), "dev_sentences": 2}
    assert resolve_checkpoint(run.run_dir) == checkpoint_dir(run.run_dir, best_step)
    for step in (2, 4):  # each checkpoint's state knows the best score as of its step
        state = torch.load(checkpoint_dir(run.run_dir, step) / STATE_FILE, weights_only=True)
        expected = bleu(half[:2], references[:2]) if step == 2 or not final_is_best else best_bleu
        assert state["best_bleu"] == pytest.approx(expected), step


def test_progress_in_a_log_file_is_one_plain_line_every_log_every_steps(tmp_path: Path) -> None:
    """Not on a terminal (CI, `make main > log`): no carriage-return bar, one line per `log_every` steps."""
    recipe = write_recipe(tmp_path, max_steps=10, log_every=5, save_every=10)
    result = tformer_train(recipe)  # stdout and stderr are pipes
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ") and "loss" in line]
    assert [line.split(":")[0] for line in lines] == ["step 5", "step 10"]
    assert all("target tok/s" in line for line in lines)
