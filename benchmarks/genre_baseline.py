"""The genre task (bible:genre, books held out) scored by a bag-of-words logistic regression and, with
--checkpoint, by a fine-tuned tformer classifier, on the same dev and test books.

The baseline is multinomial logistic regression on binary word-presence features (lower-cased \\w+ words seen
at least twice in the training books), an L2 penalty chosen on the dev books from a grid, fitted to convergence
with L-BFGS in plain torch (scikit-learn's LogisticRegression on a CountVectorizer(binary=True), without the
dependency). The majority class of the training books is the floor.

    python benchmarks/genre_baseline.py [--checkpoint runs/minilm-genre/checkpoints/step-...] [--no-baseline]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import Counter

import torch
import torch.nn.functional as F

from tformer import load
from tformer.data import Tokenizer
from tformer.data.genre import GENRES, bible_genres
from tformer.training.evaluate import classification_scores, evaluate_classification
from tformer.training.init_from import vocab_of

WORD = re.compile(r"\w+")
PENALTIES = (1e-5, 1e-4, 1e-3, 1e-2)  # L2 weight per example, as sklearn's 1 / (C * n)


def bags(texts: list[str], vocabulary: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(word ids, offsets) of each text's distinct known words, for nn.functional.embedding_bag."""
    ids, offsets = [], []
    for text in texts:
        offsets.append(len(ids))
        ids.extend(sorted({vocabulary[w] for w in WORD.findall(text.lower()) if w in vocabulary}))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)


class BagOfWordsRegression:
    """Multinomial logistic regression on word presence: logits = sum of the present words' weight rows + bias."""

    def __init__(self, train: list[tuple[str, int]], min_count: int = 2) -> None:
        counts = Counter(w for text, _ in train for w in set(WORD.findall(text.lower())))
        self.vocabulary = {w: i for i, w in enumerate(sorted(w for w, n in counts.items() if n >= min_count))}
        self.weight = torch.zeros(len(self.vocabulary), len(GENRES))
        self.bias = torch.zeros(len(GENRES))

    def logits(self, bag: tuple[torch.Tensor, torch.Tensor], weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.embedding_bag(bag[0], weight, bag[1], mode="sum") + bias

    def fit(self, train: list[tuple[str, int]], penalty: float) -> None:
        bag, labels = bags([t for t, _ in train], self.vocabulary), torch.tensor([y for _, y in train])
        weight = torch.zeros_like(self.weight, requires_grad=True)
        bias = torch.zeros_like(self.bias, requires_grad=True)
        optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, tolerance_grad=1e-6, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.cross_entropy(self.logits(bag, weight, bias), labels) + penalty / 2 * weight.square().sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        self.weight, self.bias = weight.detach(), bias.detach()

    def predict(self, examples: list[tuple[str, int]]) -> torch.Tensor:
        bag = bags([t for t, _ in examples], self.vocabulary)
        return self.logits(bag, self.weight, self.bias).argmax(-1)


def per_genre_recall(predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {g: (predicted[labels == c] == c).float().mean().item() for c, g in enumerate(GENRES)}


def baseline(splits: dict[str, list[tuple[str, int]]]) -> dict:
    started = time.perf_counter()
    model = BagOfWordsRegression(splits["train"])
    dev_labels = torch.tensor([y for _, y in splits["dev"]])
    tried = {}
    for penalty in PENALTIES:
        model.fit(splits["train"], penalty)
        tried[penalty] = classification_scores(model.predict(splits["dev"]), dev_labels, len(GENRES))["accuracy"]
    best = max(tried, key=tried.get)
    model.fit(splits["train"], best)
    result = {"method": "bag-of-words logistic regression", "penalty": best, "dev_accuracy_by_penalty": tried}
    for split in ("dev", "test"):
        labels = torch.tensor([y for _, y in splits[split]])
        predicted = model.predict(splits[split])
        result[split] = classification_scores(predicted, labels, len(GENRES))
        result[split]["recall"] = per_genre_recall(predicted, labels)
    result["features"], result["seconds"] = len(model.vocabulary), time.perf_counter() - started
    return result


def majority(splits: dict[str, list[tuple[str, int]]]) -> dict:
    top = Counter(y for _, y in splits["train"]).most_common(1)[0][0]
    result = {"method": f"majority class ({GENRES[top]})"}
    for split in ("dev", "test"):
        labels = torch.tensor([y for _, y in splits[split]])
        result[split] = classification_scores(torch.full_like(labels, top), labels, len(GENRES))
    return result


def fine_tuned(checkpoint: str, splits: dict[str, list[tuple[str, int]]], max_len: int, scored: list[str]) -> dict:
    model, tokenizer = load(checkpoint), Tokenizer.load(checkpoint)
    vocab, result = vocab_of(tokenizer), {"method": f"tformer classifier {checkpoint}"}
    for split in scored:
        started = time.perf_counter()
        result[split] = evaluate_classification(model, tokenizer, vocab, splits[split], max_len)
        result[split]["seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a fine-tuned sequence classifier's checkpoint directory")
    parser.add_argument("--max-len", type=int, default=128, help="tokens per verse for the checkpoint")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--no-baseline", action="store_true", help="score only the checkpoint (and the majority)")
    parser.add_argument("--splits", default="dev,test", help="the held-out splits to score the checkpoint on")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # L-BFGS to convergence: float64 keeps its line search honest
    splits = {split: bible_genres(split) for split in ("train", "dev", "test")}
    results = [majority(splits)] + ([] if args.no_baseline else [baseline(splits)])
    torch.set_default_dtype(torch.float32)
    if args.checkpoint:
        results.append(fine_tuned(args.checkpoint, splits, args.max_len, args.splits.split(",")))
    print(f"{'method':<60} {'dev acc':>8} {'dev F1':>8} {'test acc':>8} {'test F1':>8}")
    for r in results:
        scores = [
            r[split][key] if split in r else math.nan for split in ("dev", "test") for key in ("accuracy", "macro_f1")
        ]
        print(f"{r['method'][:60]:<60} " + " ".join(f"{x:8.4f}" for x in scores))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"sizes": {s: len(v) for s, v in splits.items()}, "results": results}, f, indent=1)
    print(json.dumps(results[1:], indent=1))


if __name__ == "__main__":
    main()
