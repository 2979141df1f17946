"""The reordering-free beam search (decoding/search.py) against today's search (tests/reference_search.py): the same
hypotheses, token for token in fp32, on tiny random models; its caches against plain indexing; CTranslate2's
patience against the reference with that stopping rule; batching by tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tokens
from reference_search import legacy_attention, reference_beam_search

from tformer import ModelConfig
from tformer.decoding import beam_search, translate_ids
from tformer.decoding.search import MAX_WORKERS, default_workers, length_batches
from tformer.layers.kv_cache import KVCache
from tformer.models import EncoderDecoder

PAD, BOS, EOS = 0, 1, 2

pytestmark = pytest.mark.usefixtures("one_thread")

# encoder-decoder variants: the paper's model, grouped KV heads (two query heads per cross-attention KV head),
# rotary positions, T5 (relative position bias, unscaled scores), and the LSTM baseline (memory per beam row)
VARIANTS = {
    "paper": ("tiny-transformer", {}),
    "gqa": ("tiny-transformer", {"n_kv_heads": 2}),
    "rope": ("tiny-transformer", {"position": "rope"}),
    "t5": ("tiny-t5", {}),
    "lstm": ("tiny-transformer", {"family": "lstm-encoder-decoder", "d_model": 16, "lstm_hidden": 12}),
}
LENGTHS = [7, 3, 11, 5, 1, 9]  # sources of different lengths in one batch, so that sources finish at different steps


def sharp_model(variant: str, vocab_size: int, seed: int) -> EncoderDecoder:
    """A tiny random model with its output logits scaled up: a fresh one is nearly uniform, so that the search would
    have nothing to choose; a small vocabulary and a louder </s> row make </s> often a candidate, so that hypotheses
    end at many lengths."""
    preset, overrides = VARIANTS[variant]
    config = ModelConfig.from_preset(
        preset, vocab_size=vocab_size, dropout=0.0, attn_dropout=0.0, tie_embeddings=False, **overrides
    )
    model = make_model(config, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
        model.lm_head.weight[EOS].mul_(3.0)
    return model


def padded_sources(lengths: list[int], vocab_size: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sources (B, max length) of random non-special tokens ending in </s>, and their masks."""
    src = tokens(len(lengths), max(lengths) + 1, vocab_size - 3, seed=seed) + 3
    src[torch.arange(len(lengths)), torch.tensor(lengths)] = EOS
    mask = (torch.arange(max(lengths) + 1)[None] <= torch.tensor(lengths)[:, None]).long()
    return src.masked_fill(mask == 0, PAD), mask


@pytest.mark.parametrize("beam_size", [1, 2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_new_search_gives_todays_hypotheses(variant: str, beam_size: int) -> None:
    """Token-identical hypotheses in fp32, the reference on today's attention routing (fused kernel for one query)."""
    outputs = []
    for seed in range(3):
        model = sharp_model(variant, vocab_size=12, seed=seed)
        src, src_mask = padded_sources(LENGTHS, 12, seed=seed + 3)
        limits = [n + 4 for n in LENGTHS]
        with legacy_attention(model):
            expected = reference_beam_search(model, src, src_mask, limits, BOS, EOS, beam_size, alpha=0.6)
        assert beam_search(model, src, src_mask, limits, BOS, EOS, beam_size, alpha=0.6) == expected
        outputs += expected
    lengths = {len(hypothesis) for hypothesis in outputs}
    assert len(lengths) >= 4, f"hypotheses should end at many lengths, got {sorted(lengths)}"
    assert any(len(h) < limit for h, limit in zip(outputs, [n + 4 for n in LENGTHS] * 3, strict=True))


def test_translate_ids_gives_todays_translations_in_input_order() -> None:
    from reference_search import reference_translate_ids

    model = sharp_model("paper", vocab_size=12, seed=1)
    generator = torch.Generator().manual_seed(0)
    sources = [(torch.randint(3, 12, (n,), generator=generator)).tolist() for n in [9, 2, 14, 5, 5, 1, 12, 7, 3, 10]]
    with legacy_attention(model):
        expected = reference_translate_ids(model, sources, BOS, EOS, PAD, beam_size=4, batch_size=3, extra_len=5)
    assert translate_ids(model, sources, BOS, EOS, PAD, beam_size=4, batch_size=3, extra_len=5) == expected
    by_tokens = translate_ids(model, sources, BOS, EOS, PAD, beam_size=4, batch_size=32, batch_tokens=24, extra_len=5)
    assert by_tokens == expected  # other batches, the same translations


@pytest.mark.parametrize("patience", [0.5, 1.0, 2.0])
def test_patience_stops_a_source_at_beam_size_times_patience_finished_hypotheses(patience: float) -> None:
    model = sharp_model("paper", vocab_size=12, seed=2)
    src, src_mask = padded_sources(LENGTHS, 12, seed=5)
    limits = [n + 6 for n in LENGTHS]
    expected = reference_beam_search(model, src, src_mask, limits, BOS, EOS, 4, alpha=0.6, patience=patience)
    assert beam_search(model, src, src_mask, limits, BOS, EOS, 4, alpha=0.6, patience=patience) == expected
    with pytest.raises(ValueError, match="patience is 0"):
        beam_search(model, src, src_mask, limits, BOS, EOS, 4, patience=0.0)


def test_patience_changes_some_hypotheses_on_a_model_that_keeps_searching() -> None:
    """The reference check above could pass with patience ignored if no source ever differs: here some do."""
    differs = 0
    for seed in range(4):
        model = sharp_model("paper", vocab_size=12, seed=seed)
        src, src_mask = padded_sources(LENGTHS, 12, seed=seed + 3)
        limits = [n + 6 for n in LENGTHS]
        exact = beam_search(model, src, src_mask, limits, BOS, EOS, 4, alpha=0.6)
        early = beam_search(model, src, src_mask, limits, BOS, EOS, 4, alpha=0.6, patience=0.25)
        differs += sum(a != b for a, b in zip(exact, early, strict=True))
    assert differs > 0


@pytest.mark.parametrize("variant", ["paper", "gqa", "t5"])
def test_per_source_cross_attention_keys_give_the_per_beam_logits(variant: str) -> None:
    """decode on a cache built from the memory (keys once per source, K beams as K queries, the mask built once)
    gives the logits of the per-beam memory and mask, step after step, as sources leave the batch."""
    model = sharp_model(variant, vocab_size=20, seed=0)
    K, lengths = 3, [6, 2, 9]
    src, src_mask = padded_sources(lengths, 20)
    tgt = tokens(len(lengths) * K, 5, 20, seed=7)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        grouped = model.new_cache(len(lengths) * K, 8, memory=memory, src_mask=src_mask)
        plain = model.new_cache(len(lengths) * K, 8)
        per_beam, beam_mask = memory.repeat_interleave(K, 0), src_mask.repeat_interleave(K, 0)
        assert grouped[0].cross_attn.k.shape[0] == len(lengths)
        for t in range(5):
            if t == 3:  # the second source leaves the batch: rows 3..5 go, the others keep their places
                keep = torch.tensor([0, 1, 2, 6, 7, 8])
                for cache in (grouped, plain):
                    for layer in cache:
                        layer.self_attn.reorder(keep, t)
                        layer.cross_attn.reorder(keep)
                beam_mask, tgt = beam_mask[keep], tgt[keep]
                assert grouped[0].cross_attn.k.shape[0] == 2
            got = model.decode(tgt[:, t : t + 1], None, None, cache=grouped, start=t)
            want = model.decode(tgt[:, t : t + 1], per_beam if t == 0 else None, beam_mask, cache=plain, start=t)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_kv_cache_reorder_copies_only_the_rows_that_change() -> None:
    torch.manual_seed(0)
    cache = KVCache(6, 2, 4, 10, torch.float32, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    version = cache.k._version
    cache.reorder(torch.arange(6), 7)  # every beam kept its parent: nothing is written
    assert cache.k._version == version
    index = torch.tensor([0, 0, 2, 1, 4, 4])
    cache.reorder(index, 7)
    torch.testing.assert_close(cache.k[:, :, :7], before_k[index, :, :7], rtol=0, atol=0)
    torch.testing.assert_close(cache.v[:, :, :7], before_v[index, :, :7], rtol=0, atol=0)
    torch.testing.assert_close(cache.k[:, :, 7:], before_k[:, :, 7:], rtol=0, atol=0)  # positions not yet written
    shrunk_from = cache.k.clone()
    cache.reorder(torch.tensor([2, 5, 4]), 7)  # a batch that drops rows keeps its first rows' storage
    assert cache.k.shape[0] == 3
    torch.testing.assert_close(cache.k[:, :, :7], shrunk_from[[2, 5, 4], :, :7], rtol=0, atol=0)
    grown = KVCache(2, 2, 4, 10, torch.float32, torch.device("cpu"))
    grown.k.normal_()
    rows = grown.k.clone()
    grown.reorder(torch.tensor([0, 0, 1, 1]))  # a prompt's cache copied to its beams
    torch.testing.assert_close(grown.k, rows[[0, 0, 1, 1]], rtol=0, atol=0)


def test_length_batches_cut_sorted_lengths_by_count_and_padded_tokens() -> None:
    lengths = [5, 1, 9, 3, 3, 12, 2]

    def plain(batch_size: int, batch_tokens: int) -> list[list[int]]:
        order, batches = sorted(range(len(lengths)), key=lambda i: lengths[i]), []
        for i in order:
            fits = batches and len(batches[-1]) < batch_size
            fits = fits and (not batch_tokens or (len(batches[-1]) + 1) * lengths[i] <= batch_tokens)
            batches[-1].append(i) if fits else batches.append([i])
        return batches

    for batch_size, batch_tokens in [(32, 0), (3, 0), (32, 10), (2, 12), (32, 5)]:
        batches = length_batches(lengths, batch_size, batch_tokens)
        assert batches == plain(batch_size, batch_tokens)
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert length_batches(lengths, 32, 10) == [[1, 6, 3], [4, 0], [2], [5]]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("in_place", [True, False])
def test_beam_caches_read_each_beams_keys_through_their_tables(dtype: torch.dtype, atol: float, in_place: bool) -> None:
    """BeamKVCache after writes and reorders, and BeamMemory over padded sources, against the plain formula on keys
    gathered one by one: beam row r's key at position t is the one that the row it continues wrote at t (query heads
    2h and 2h+1 read KV head h), and a beam reads its own source's real keys only. `in_place` False: the kernel's
    torch path (the keys gathered), which the caches take off the CPU."""
    from tformer.decoding.beam_cache import BeamKVCache, BeamMemory

    generator = torch.Generator().manual_seed(0)
    R, H, Hkv, L, D, T, K = 6, 4, 2, 12, 32, 5, 3

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    def formula(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # (H, D), (n, Hkv, D)
        out = torch.empty(H, D)
        for h in range(H):
            weights = torch.softmax(keys[:, h // 2].double() @ q[h].double() / D**0.5, dim=0)
            out[h] = (weights @ values[:, h // 2].double()).float()
        return out

    cache = BeamKVCache(R, Hkv, D, L, dtype, torch.device("cpu"))
    cache.beams = K  # rows 0-2 and 3-5 read as two sentences' beams
    written = [[] for _ in range(R)]  # row r's beam: the (k, v) of each position
    for t in range(T):
        k, v = randn(R, Hkv, 1, D), randn(R, Hkv, 1, D)
        q = randn(R, H, 1, D)
        if in_place:
            got = cache.attend_in_place(torch.tensor([[t]]), q, k, v)
        else:
            keys, values = cache.update(torch.tensor([[t]]), k, v)  # (R, Hkv, t + 1, D)
            got = torch.stack(
                [formula(q[r, :, 0], keys[r].transpose(0, 1), values[r].transpose(0, 1)) for r in range(R)]
            )
        written = [beam + [(k[r, :, 0], v[r, :, 0])] for r, beam in enumerate(written)]
        for r in range(R):
            keys = torch.stack([key for key, _ in written[r]])
            values = torch.stack([value for _, value in written[r]])
            torch.testing.assert_close(
                got[r].reshape(H, D).float(), formula(q[r, :, 0], keys, values), rtol=0, atol=atol
            )
        parents = torch.randint(0, R, (R,), generator=generator)
        cache.reorder(parents)
        written = [list(written[p]) for p in parents.tolist()]

    lengths = torch.tensor([4, 1, 6])
    S = int(lengths.max())
    src_mask = (torch.arange(S)[None] < lengths[:, None]).long()
    src_mask[1] = src_mask[1].flip(0)  # a left-padded source too: its one real key last
    mk, mv = randn(3, Hkv, S, D), randn(3, Hkv, S, D)
    memory = BeamMemory(mk, mv, src_mask, K)
    q = randn(3 * K, H, 1, D)
    got = memory.attend(q)
    for r in range(3 * K):
        real = src_mask[r // K].bool()
        expected = formula(q[r, :, 0], mk[r // K][:, real].transpose(0, 1), mv[r // K][:, real].transpose(0, 1))
        torch.testing.assert_close(got[r].reshape(H, D).float(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("variant", ["paper", "gqa", "rope"])
def test_beams_that_share_keys_through_a_table_give_the_copying_caches_hypotheses(variant: str, monkeypatch) -> None:
    """The search on BeamKVCache (keys never copied, read through the table) and on KVCache (each moved row copied):
    the same hypotheses, and the table is what the search used."""
    from tformer.decoding import beam_cache

    model = sharp_model(variant, vocab_size=12, seed=2)
    src, src_mask = padded_sources(LENGTHS, 12, seed=5)
    limits = [n + 4 for n in LENGTHS]
    reorders = []
    reorder = beam_cache.BeamKVCache.reorder
    monkeypatch.setattr(beam_cache.BeamKVCache, "reorder", lambda self, *a: reorders.append(1) or reorder(self, *a))
    shared = beam_search(model, src, src_mask, limits, BOS, EOS, 4, alpha=0.6)
    assert len(reorders) >= max(limits) * model.config.n_decoder_layers // 2
    monkeypatch.setattr(beam_cache, "applies", lambda device, dtype: False)  # the search keeps KVCache
    reorders.clear()
    assert beam_search(model, src, src_mask, limits, BOS, EOS, 4, alpha=0.6) == shared
    assert not reorders


def test_batches_searched_side_by_side_give_the_same_translations_in_input_order() -> None:
    model = sharp_model("paper", vocab_size=12, seed=3)
    generator = torch.Generator().manual_seed(1)
    sources = [torch.randint(3, 12, (n,), generator=generator).tolist() for n in [9, 2, 14, 5, 5, 1, 12, 7, 3, 10]]
    one = translate_ids(model, sources, BOS, EOS, PAD, beam_size=3, batch_size=3, workers=1)
    threads = torch.get_num_threads()
    done = []
    two = translate_ids(model, sources, BOS, EOS, PAD, beam_size=3, batch_size=3, workers=2, progress=done.append)
    assert two == one and sorted(done) == [1, 3, 3, 3] and torch.get_num_threads() == threads
    # the default: one batch per thread on the CPU (at most MAX_WORKERS), one on an accelerator
    assert default_workers(torch.device("cpu")) == min(threads, MAX_WORKERS)
    assert default_workers(torch.device("meta")) == 1
    assert translate_ids(model, sources, BOS, EOS, PAD, beam_size=3, batch_size=3) == one
    with pytest.raises(ValueError, match="workers"):
        translate_ids(model, sources, BOS, EOS, PAD, workers=0)
