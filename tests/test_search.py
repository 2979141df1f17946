"""Decoding: cached logits against the uncached forward, and the searches against plain reference searches."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from conftest import make_model, tiny_config, tokens

from tformer.decoding import beam_search, greedy_search, length_penalty, translate_ids
from tformer.decoding.search import beam_search_decoder
from tformer.errors import RequestError
from tformer.layers.kv_cache import CrossKV
from tformer.models import DecoderLM, EncoderDecoder

BOS, EOS, PAD = 1, 2, 0


pytestmark = pytest.mark.usefixtures("one_thread")

# ---- KV cache: prefill + one token at a time == the full forward ------------------------------------------------

DECODER_VARIANTS = {
    "gpt2-learned": ("tiny-gpt2", {}),
    "llama-rope-gqa": ("tiny-llama", {}),
    "alibi": ("tiny-gpt2", {"position": "alibi"}),
    "sliding-window": ("tiny-llama", {"sliding_window": 3}),
}


def left_padding_mask(batch: int, length: int) -> torch.Tensor:
    """Row 0 is unpadded; row b > 0 starts with 2 * b pad positions (as batched generation lays prompts out)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):
        mask[b, : 2 * b] = 0
    return mask


def decoder_incremental(model: DecoderLM, ids: torch.Tensor, mask: torch.Tensor | None, prefill: int) -> torch.Tensor:
    """Logits (B, T, V) from a prefill of `prefill` tokens, then one token per call on the KV cache."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]
    out = [model(ids[:, a:b], None if mask is None else mask[:, :b], cache=cache, start=a) for a, b in steps]
    return torch.cat(out, 1)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("variant", DECODER_VARIANTS)
def test_decoder_cached_logits_equal_the_full_forward(variant: str, backend: str, padded: bool) -> None:
    preset, overrides = DECODER_VARIANTS[variant]
    model = make_model(tiny_config(preset, attention_backend=backend, **overrides))
    ids = tokens(3, 10, model.config.vocab_size)
    mask = left_padding_mask(3, 10) if padded else None
    with torch.no_grad():
        full = model(ids, mask)
        cached = decoder_incremental(model, ids, mask, prefill=4)
    real = torch.ones(3, 10, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(cached[real], full[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("position", ["sinusoidal", "rope", "alibi"])
def test_encoder_decoder_cached_logits_equal_the_full_forward(position: str, backend: str) -> None:
    model = make_model(tiny_config("encoder-decoder", position=position, attention_backend=backend))
    src, tgt = tokens(2, 7, model.config.vocab_size, seed=2), tokens(2, 8, model.config.vocab_size)
    src_mask = torch.ones_like(src)
    src_mask[1, 5:] = 0  # the second source is two tokens shorter
    with torch.no_grad():
        full = model(src, tgt, src_mask)
        memory = model.encode(src, src_mask)
        cache = model.new_cache(2, 8)
        steps = [(0, 3)] + [(t, t + 1) for t in range(3, 8)]
        cached = torch.cat([model.decode(tgt[:, a:b], memory, src_mask, cache=cache, start=a) for a, b in steps], 1)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


# ---- greedy and beam search against plain references ------------------------------------------------------------


def seq2seq_model(vocab_size: int = 97, seed: int = 0) -> EncoderDecoder:
    return make_model(tiny_config("encoder-decoder", vocab_size=vocab_size), seed=seed)


def padded_sources(lengths: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sources (B, max length) of random non-special tokens, and their masks."""
    src = tokens(len(lengths), max(lengths), vocab_size - 3, seed=3) + 3
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return src.masked_fill(mask == 0, PAD), mask


@torch.no_grad()
def reference_greedy(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor, max_len: int, eos: int) -> list:
    """Arg-max decoding one sentence at a time, unpadded, recomputing the whole decoder at every step."""
    results = []
    for row, row_mask in zip(src, src_mask, strict=True):
        source = row[row_mask.bool()][None]  # (1, S_b)
        prefix = [BOS]
        for _ in range(max_len):
            token = model(source, torch.tensor([prefix])).argmax(-1)[0, -1].item()
            if token == eos:
                break
            prefix.append(token)
        results.append(prefix[1:])
    return results


def test_greedy_search_equals_an_uncached_argmax_loop() -> None:
    model = seq2seq_model()
    src, src_mask = padded_sources([6, 3, 5], model.config.vocab_size)
    max_len = 9
    # A random model rarely picks </s>; call the third token row 0 would choose </s>, so that rows end early.
    eos = reference_greedy(model, src, src_mask, max_len, eos=-1)[0][2]
    expected = reference_greedy(model, src, src_mask, max_len, eos)
    assert any(len(hyp) < max_len for hyp in expected) and any(len(hyp) > 0 for hyp in expected)
    assert greedy_search(model, src, src_mask, max_len, BOS, eos) == expected


@pytest.mark.parametrize("seed", range(4))
def test_beam_search_with_one_beam_is_greedy_search(seed: int) -> None:
    # A vocabulary of 8 makes </s> often the runner-up, which a one-wide beam must not finish on. alpha = 0:
    # with a length penalty a one-wide beam may rightly go on after greedy stops, to a better-scored hypothesis.
    model = seq2seq_model(vocab_size=8, seed=seed)
    src, src_mask = padded_sources([6, 3, 5, 4], 8)
    greedy = greedy_search(model, src, src_mask, 12, BOS, EOS)
    assert beam_search(model, src, src_mask, 12, BOS, EOS, beam_size=1, alpha=0.0) == greedy


def brute_force_best(
    log_probs: Callable[[tuple[int, ...]], torch.Tensor], vocab_size: int, max_len: int, alpha: float
) -> tuple[list[int], float]:
    """The hypothesis beam_search should return if it searched everything, and its margin over the runner-up.

    Candidates are every y_1..y_k </s> (k < max_len, no </s> inside), scored log p / lp(k + 1), and every
    max_len tokens without </s> (beam_search stops them there), scored log p / lp(max_len + 1).
    """
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def cached(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in memo:
            memo[prefix] = log_probs(prefix)
        return memo[prefix]

    scored = []
    for k in range(max_len + 1):
        for body in itertools.product([v for v in range(vocab_size) if v != EOS], repeat=k):
            ends = [EOS] if k < max_len else [None]
            for end in ends:
                sequence = body if end is None else (*body, end)
                logp = sum(cached(sequence[:t])[token].item() for t, token in enumerate(sequence))
                scored.append((logp / length_penalty(k + 1, alpha), list(body)))
    scored.sort(key=lambda s: s[0], reverse=True)
    return scored[0][1], scored[0][0] - scored[1][0]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_a_wide_beam_finds_the_best_length_penalised_hypothesis(alpha: float) -> None:
    vocab_size, max_len = 7, 3
    # Seed 26: not every winner follows the top-ranked beam at each step (most random tiny models repeat one
    # token), so a cache that did not follow its beam's reordering would give a wrong answer.
    model = seq2seq_model(vocab_size=vocab_size, seed=26)
    src, src_mask = padded_sources([4, 2], vocab_size)
    # Every K-wide beam keeps all 6^2 live prefixes and its 2K candidates hold all 36 * 7 last-step extensions.
    beam = beam_search(model, src, src_mask, max_len, BOS, EOS, beam_size=126, alpha=alpha)
    for b in range(2):
        source = src[b : b + 1, : int(src_mask[b].sum())]

        @torch.no_grad()
        def log_probs(prefix: tuple[int, ...], source: torch.Tensor = source) -> torch.Tensor:
            return torch.log_softmax(model(source, torch.tensor([[BOS, *prefix]]))[0, -1], -1)

        expected, margin = brute_force_best(log_probs, vocab_size, max_len, alpha)
        assert margin > 1e-4, "the test needs a unique best hypothesis"
        assert beam[b] == expected


class TableModel:
    """A fake encoder-decoder whose next-token log-probabilities are looked up by target prefix."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], vocab_size: int) -> None:
        self.table, self.vocab_size = table, vocab_size

    def eval(self) -> TableModel:
        return self

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(src.shape[0], 1, 1)

    def new_cache(self, batch_size: int, max_len: int) -> list[PrefixCache]:
        return [PrefixCache(batch_size)]

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: list, start: int):
        (history,) = cache
        history.tokens = torch.cat([history.tokens, tgt], 1)
        return torch.stack([self.log_probs(tuple(row[1:])) for row in history.tokens.tolist()])[:, None]

    def log_probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """Given probabilities for some tokens, the rest of the mass spread evenly over the others."""
        given = self.table.get(prefix, {})
        rest = (1 - sum(given.values())) / (self.vocab_size - len(given))
        return torch.tensor([given.get(v, rest) for v in range(self.vocab_size)]).log()


class PrefixCache:
    """The target tokens so far, as a layer's cache: beam search reorders it like self-attention keys."""

    def __init__(self, batch_size: int) -> None:
        self.tokens = torch.zeros(batch_size, 0, dtype=torch.long)
        self.self_attn, self.cross_attn = self, CrossKV()

    def reorder(self, index: torch.Tensor, length: int | None = None) -> None:
        self.tokens = self.tokens[index]


def test_beam_search_does_not_stop_while_a_live_beam_can_still_win() -> None:
    # </s> first (p = e^-1) beats x (p = e^-1.2) and stays ahead of x/lp(max_len); but x x is near-certain and
    # is stopped at max_len = 2 with lp(3), where -1.2 / lp(3) > -1 / lp(1): it wins under beam_search's own rule.
    x, alpha, max_len = 3, 1.0, 2
    model = TableModel(
        {(): {EOS: torch.tensor(-1.0).exp().item(), x: torch.tensor(-1.2).exp().item()}, (x,): {x: 0.999}}, vocab_size=5
    )
    expected, margin = brute_force_best(model.log_probs, 5, max_len, alpha)
    assert expected == [x, x] and margin > 1e-3
    src = torch.tensor([[5, 6]])
    assert beam_search(model, src, torch.ones_like(src), max_len, BOS, EOS, beam_size=1, alpha=alpha) == [expected]


def test_the_length_penalty_counts_the_end_of_sentence_token() -> None:
    # [] </s> has log p -1 and [x] </s> -1.18: with lp(|y| + 1), the rule above, [] wins (-1 against -1.011);
    # with lp(|y|) [x] would (-1.18 against -1.2).
    x, alpha = 3, 1.0
    e = torch.tensor([-1.0, -0.5, -0.68]).exp().tolist()
    model = TableModel({(): {EOS: e[0], x: e[1]}, (x,): {EOS: e[2]}}, vocab_size=5)
    expected, margin = brute_force_best(model.log_probs, 5, 3, alpha)
    assert expected == [] and margin > 1e-3
    src = torch.tensor([[5, 6]])
    assert beam_search(model, src, torch.ones_like(src), 3, BOS, EOS, beam_size=2, alpha=alpha) == [expected]


# ---- beam search for decoder-only models ----------------------------------------------------------------------


def sharp_decoder(variant: str, vocab_size: int, seed: int = 0) -> DecoderLM:
    """A tiny decoder with its output logits scaled up: a fresh one is nearly uniform over the vocabulary, so
    </s> right away would beat every longer continuation and the searches would have nothing to choose."""
    preset, overrides = DECODER_VARIANTS[variant]
    # untied: a random model whose output head is its input embedding mostly predicts the token it was fed
    config = tiny_config(preset, vocab_size=vocab_size, tie_embeddings=False, **overrides)
    model = make_model(config, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def decoder_prompts(lengths: list[int], vocab_size: int) -> list[list[int]]:
    """Prompts of the given lengths, of tokens other than <pad>, <s> and </s>."""
    return [(tokens(1, n, vocab_size - 3, seed=20 + i)[0] + 2).tolist() for i, n in enumerate(lengths)]


@torch.no_grad()
def reference_greedy_decoder(model: DecoderLM, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Arg-max continuation of one unpadded prompt, recomputing the whole sequence at every step."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        token = model(torch.tensor([ids]))[0, -1].argmax().item()
        if token == eos:
            break
        ids.append(token)
    return ids[len(prompt) :]


@pytest.mark.parametrize("variant", DECODER_VARIANTS)
def test_decoder_beam_search_with_one_beam_is_uncached_greedy(variant: str) -> None:
    # alpha = 0, as for the seq2seq search: with a length penalty a one-wide beam may rightly outlast greedy.
    model = sharp_decoder(variant, vocab_size=8, seed=5)
    prompts, limits = decoder_prompts([5, 1, 8, 3], 8), [8, 6, 9, 7]
    # Call </s> the third token greedy picks after the first prompt, so that rows stop at different steps.
    eos = reference_greedy_decoder(model, prompts[0], 3, eos=-1)[2]
    expected = [reference_greedy_decoder(model, p, n, eos) for p, n in zip(prompts, limits, strict=True)]
    assert any(len(e) < n for e, n in zip(expected, limits, strict=True)) and len({len(e) for e in expected}) >= 3
    assert beam_search_decoder(model, prompts, limits, eos, beam_size=1, alpha=0.0) == expected


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_wide_decoder_beam_finds_the_best_length_penalised_continuation(alpha: float) -> None:
    vocab_size, max_new_tokens = 6, 3
    # Seed 6 and these prompts: the winners, [] and [1, 1, 1] for the first prompt as alpha grows and [5] for
    # the second, do not start with greedy's first token ([3, 0, 5] and [0, 5]), so they come from a beam other
    # than the top one, whose KV cache rows must have followed it.
    model = sharp_decoder("llama-rope-gqa", vocab_size, seed=6)
    prompts = [[5, 4, 1, 4], [4, 3]]
    # Every K-wide beam keeps all 5^2 live prefixes and its 2K candidates hold all 25 * 6 last-step extensions.
    beam = beam_search_decoder(model, prompts, max_new_tokens, EOS, beam_size=75, alpha=alpha)
    beats_greedy = False
    for prompt, found in zip(prompts, beam, strict=True):

        @torch.no_grad()
        def log_probs(prefix: tuple[int, ...], prompt: list[int] = prompt) -> torch.Tensor:
            return torch.log_softmax(model(torch.tensor([[*prompt, *prefix]]))[0, -1], -1)

        expected, margin = brute_force_best(log_probs, vocab_size, max_new_tokens, alpha)
        assert margin > 1e-4, "the test needs a unique best continuation"
        assert found == expected
        beats_greedy |= expected != reference_greedy_decoder(model, prompt, max_new_tokens, EOS)
    assert beats_greedy, "greedy search would pass this test"


@pytest.mark.parametrize("variant", DECODER_VARIANTS)
def test_decoder_beam_search_does_not_depend_on_the_batch(variant: str) -> None:
    model = sharp_decoder(variant, vocab_size=8, seed=5)
    prompts, limits = decoder_prompts([6, 1, 9, 3], 8), [7, 5, 9, 6]
    batched = beam_search_decoder(model, prompts, limits, EOS, beam_size=3, alpha=0.6)
    alone = [
        beam_search_decoder(model, [p], n, EOS, beam_size=3, alpha=0.6)[0] for p, n in zip(prompts, limits, strict=True)
    ]
    assert batched == alone
    assert any(len(b) < n for b, n in zip(batched, limits, strict=True)), (
        "some search must stop on </s> before its limit"
    )
    assert len({tuple(b) for b in batched}) >= 3, "outputs must differ, or a mix-up of the rows could pass"


def test_decoder_beam_search_rejects_prompts_it_cannot_continue() -> None:
    model = sharp_decoder("gpt2-learned", vocab_size=8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        beam_search_decoder(model, [[3, 4], []], 4, EOS)
    with pytest.raises(ValueError, match="max_seq_len of 64"):
        beam_search_decoder(model, [[3] * 60], 5, EOS)
    with pytest.raises(ValueError, match="2 length limits for a batch of 1"):
        beam_search_decoder(model, [[3]], [4, 4], EOS)
    with pytest.raises(ValueError, match="beam_size is 0"):
        beam_search_decoder(model, [[3]], 4, EOS, beam_size=0)


# ---- translate_ids -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_ids_returns_results_in_input_order(beam_size: int) -> None:
    model = seq2seq_model(seed=3)
    lengths = [5, 1, 7, 3, 6]
    sources = [tokens(1, n, 90, seed=10 + i)[0].add(3).tolist() for i, n in enumerate(lengths)]
    extra_len = 4
    out = translate_ids(model, sources, BOS, EOS, PAD, beam_size=beam_size, alpha=0.6, extra_len=extra_len)
    # Each sentence gets its own limit, its source + </s> + extra_len, whatever it is batched with.
    search = greedy_search if beam_size == 1 else lambda *a: beam_search(*a, beam_size=beam_size, alpha=0.6)
    for source, hypothesis in zip(sources, out, strict=True):
        src = torch.tensor([[*source, EOS]])
        assert hypothesis == search(model, src, torch.ones_like(src), len(source) + 1 + extra_len, BOS, EOS)[0]
    one_by_one = translate_ids(model, sources, BOS, EOS, PAD, beam_size, 0.6, batch_size=1, extra_len=extra_len)
    assert out == one_by_one
    assert len({tuple(h) for h in out}) >= 3, "outputs must differ, or a mix-up of the order could pass"


def test_batched_beam_search_gives_each_sentence_its_own_hypothesis_as_sources_finish() -> None:
    """Sources leave the batch as their searches end (fairseq's shrinking batch): every hypothesis must still be
    exactly what beam search over that sentence alone gives (fp32), with some ending by </s> early and others
    running to their limits."""
    model = seq2seq_model(seed=5)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= -3  # the tied </s> row: some searches end at once, others run to the limit
    lengths = [6, 2, 9, 4, 7, 3, 8, 5, 1, 6, 4]
    sources = [tokens(1, n, 90, seed=40 + i)[0].add(3).tolist() for i, n in enumerate(lengths)]
    out = translate_ids(model, sources, BOS, EOS, PAD, beam_size=4, alpha=0.6, batch_size=6, extra_len=6)
    alone = [
        translate_ids(model, [source], BOS, EOS, PAD, beam_size=4, alpha=0.6, extra_len=6)[0] for source in sources
    ]
    assert out == alone
    limits = [n + 1 + 6 for n in lengths]
    assert any(len(h) < limit for h, limit in zip(out, limits, strict=True)), (
        "no search ended by </s>: nothing left the batch"
    )
    assert any(len(h) == limit for h, limit in zip(out, limits, strict=True)), "every search ended early"


def test_a_source_longer_than_the_positions_is_refused_by_name() -> None:
    model = make_model(tiny_config("encoder-decoder", position="sinusoidal", max_seq_len=16))
    fits, too_long = list(range(3, 18)), list(range(3, 19))  # 15 and 16 tokens, plus </s>
    assert len(translate_ids(model, [fits], 1, 2, 0, beam_size=1, extra_len=2)[0]) <= 16
    with pytest.raises(RequestError, match=r"source 1 has 16 tokens \(\+ </s>\), more than this model's max_seq_len"):
        translate_ids(model, [fits, too_long], 1, 2, 0, beam_size=1)
