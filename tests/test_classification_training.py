"""The trainer's classification objective on a tiny encoder: it learns a trivially separable task, resumes bit for
bit, and its checkpoints hold a classifier; fine-tuning puts a new head on pretrained weights; the genre corpus
holds out whole books. References: the model before training, an uninterrupted run, the pretrained weights, and
the definition of macro-F1 computed by hand."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from helpers import interrupt_and_resume, losses, trainer
from safetensors.torch import load_file

from tformer import build_model
from tformer.checkpoints import list_checkpoints
from tformer.config import ConfigError, ModelConfig
from tformer.data import Tokenizer
from tformer.data.genre import BOOK_GENRE, GENRE_SPLIT_BOOKS, GENRES, bible_genres, genre_split_of
from tformer.models import WEIGHTS_FILE, load
from tformer.training.evaluate import classification_scores, evaluate_classification

pytestmark = pytest.mark.usefixtures("one_thread")

ANIMALS = ["cat", "dog", "horse", "sheep", "goat", "camel", "lion", "bear"]
COLOURS = ["red", "blue", "green", "white", "black", "purple", "gold", "grey"]
MODEL = {"preset": "tiny-bert", "encoder_head": "sequence-classification", "num_labels": 2, "dropout": 0.1}


def write_labelled(path: Path, n: int, seed: int) -> Path:
    """Class 0: a line of animal words; class 1: a line of colour words (a bag of words separates them)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        label = rng.randint(0, 1)
        words = [rng.choice(COLOURS if label else ANIMALS) for _ in range(rng.randint(2, 6))]
        lines.append(f"{' '.join(words)}\t{label}\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def write_classification_recipe(directory: Path, model: dict | None = None, **train: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    train = {
        "corpus": str(write_labelled(directory / "train.tsv", 200, seed=0)),
        "dev_corpus": str(write_labelled(directory / "dev.tsv", 40, seed=1)),
        "objective": "classification",
        "vocab_size": 300,
        "max_len": 16,
        "max_tokens": 256,
        "max_steps": 20,
        "save_every": 5,
        "eval_every": 10_000,
        "log_every": 5,
        "optimizer": "adamw-cosine",
        "lr": 3e-3,
        "warmup": 2,
        "label_smoothing": 0.0,
        "out_dir": str(directory / "run"),
        **train,
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": model or MODEL, "train": train}))
    return path


def test_classification_trains_a_separable_task(tmp_path: Path) -> None:
    run = trainer(write_classification_recipe(tmp_path, max_steps=80))
    before = evaluate_classification(run.model, run.data.tokenizer, run.vocab, run.data.dev, 16)
    final = run.fit()
    curve = losses(run.run_dir)
    assert curve[-1] < 0.5 * curve[0]
    assert final["dev_accuracy"] >= 0.95 > before["accuracy"] + 0.2
    assert final["dev_examples"] == 40
    checkpoint = list_checkpoints(run.run_dir)[-1]
    model = load(checkpoint)  # an ordinary checkpoint that holds the classifier and scores the same
    assert model.config.encoder_head == "sequence-classification" and model.config.num_labels == 2
    tokenizer = Tokenizer.load(checkpoint)
    again = evaluate_classification(model, tokenizer, run.vocab, run.data.dev, 16)
    assert again["accuracy"] == final["dev_accuracy"]


def test_classification_resumes_bit_for_bit(tmp_path: Path) -> None:
    whole, resumed = interrupt_and_resume(write_classification_recipe(tmp_path / "recipe"), tmp_path)
    a = load_file(list_checkpoints(whole.run_dir)[-1] / WEIGHTS_FILE)
    b = load_file(list_checkpoints(resumed.run_dir)[-1] / WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(whole.run_dir) == losses(resumed.run_dir)


def test_fine_tuning_puts_a_new_head_on_pretrained_weights(tmp_path: Path) -> None:
    """init_from an MLM checkpoint with a classification head in the recipe: the encoder's weights are the
    pretrained ones, the MLM head is dropped, and the new head is the same in every run."""
    lines = [line.split("\t")[0] for line in write_labelled(tmp_path / "text.tsv", 200, seed=2).read_text().split("\n")]
    tokenizer = Tokenizer.train(lines, 300)
    config = ModelConfig.from_preset("tiny-bert", vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id)
    pretrained = build_model(config)
    pretrained.save(tmp_path / "mlm")
    tokenizer.save(tmp_path / "mlm")
    runs = []
    for name in ("a", "b"):
        recipe = write_classification_recipe(tmp_path / name, init_from=str(tmp_path / "mlm"), max_steps=1)
        runs.append(trainer(recipe))
    model = runs[0].model
    assert model.config.encoder_head == "sequence-classification"
    assert torch.equal(model.encoder.tokens.weight, pretrained.encoder.tokens.weight)
    assert torch.equal(model.encoder.layers[1].ffn.up_proj.weight, pretrained.encoder.layers[1].ffn.up_proj.weight)
    assert not any(name.startswith("mlm_head.") for name in model.state_dict())
    assert torch.equal(model.task_head.classifier.weight, runs[1].model.task_head.classifier.weight)


def test_classification_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a sequence-classification head"):
        trainer(write_classification_recipe(tmp_path / "a", model={"preset": "tiny-bert"}))
    genre = {**MODEL, "num_labels": 2}
    with pytest.raises(ConfigError, match="bible:genre has 6 classes"):
        trainer(write_classification_recipe(tmp_path / "b", model=genre, corpus="bible:genre"))


def test_macro_f1_is_the_mean_of_per_class_f1() -> None:
    predicted, labels = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 1, 2, 2, 0])
    # class 0: tp 1, fp 1, fn 1 -> 1/2; class 1: tp 1, fn 1 -> 2/3; class 2: tp 2, fp 1 -> 4/5; class 3: none -> 0
    scores = classification_scores(predicted, labels, 4)
    assert scores["accuracy"] == pytest.approx(4 / 6)
    assert scores["macro_f1"] == pytest.approx((1 / 2 + 2 / 3 + 4 / 5 + 0) / 4)


def test_genre_corpus_holds_out_whole_books_of_every_genre() -> None:
    assert sorted(BOOK_GENRE) == list(range(1, 67))
    for split in ("dev", "test"):  # one held-out book per genre in each split
        assert sorted(BOOK_GENRE[b] for b in GENRE_SPLIT_BOOKS[split]) == list(range(len(GENRES)))
    assert genre_split_of(43) == "test" and genre_split_of(40) == "train"
    dev = bible_genres("dev")
    assert len(dev) == 3101 and len(bible_genres("test")) == 5288
    assert {label for _, label in dev[:200]} == set(range(len(GENRES)))  # shuffled: a prefix holds every genre
    train = {text for text, _ in bible_genres("train")}
    assert "In the beginning God created the heavens and the earth." in train
    for split in ("dev", "test"):  # the same text in two books (gospel parallels, repeated formulas) is rare
        held_out = {text for text, _ in bible_genres(split)}
        assert len(held_out & train) < 0.1 * len(held_out)
