"""Prefix LM: a decoder whose first tokens see each other both ways (UniLM, T5's prefix-LM objective)."""

from __future__ import annotations

import torch
from conftest import make_model, tiny_config

from tformer.data import LMBatch
from tformer.layers import build_mask
from tformer.training.evaluate import forward_logits


def test_prefix_mask_is_bidirectional_in_the_prefix_and_causal_after() -> None:
    cpu, prefix = torch.device("cpu"), torch.tensor([3, 0])
    mask = build_mask(n_queries=5, n_keys=5, causal=True, dtype=torch.float32, device=cpu, prefix_lengths=prefix)
    allowed = (mask.bias == 0)[:, 0]  # (B, Tq, Tk)
    causal = torch.ones(5, 5).tril().bool()
    expected_first = causal.clone()
    expected_first[:3, :3] = True
    assert torch.equal(allowed[0], expected_first)
    assert torch.equal(allowed[1], causal)  # an empty prefix is a plain causal LM


def test_prefix_positions_see_the_whole_prefix_and_never_the_suffix() -> None:
    model = make_model(tiny_config("tiny-llama"))
    ids = torch.randint(1, 90, (1, 8))
    prefix = torch.tensor([4])
    with torch.no_grad():
        base = model(ids, prefix_lengths=prefix)
        in_prefix = ids.clone()
        in_prefix[0, 3] = (ids[0, 3] + 1) % 90  # the last prefix token
        changed = model(in_prefix, prefix_lengths=prefix)
        in_suffix = ids.clone()
        in_suffix[0, 6] = (ids[0, 6] + 1) % 90
        suffix_changed = model(in_suffix, prefix_lengths=prefix)
        causal = model(ids)
    assert not torch.allclose(changed[0, 0], base[0, 0])  # position 0 sees position 3 inside the prefix
    torch.testing.assert_close(suffix_changed[0, :6], base[0, :6], rtol=0, atol=0)  # nothing sees the future suffix
    assert not torch.allclose(base[0, 0], causal[0, 0])
    torch.testing.assert_close(model(ids, prefix_lengths=torch.tensor([0])), causal)


def test_training_forward_uses_the_prefix() -> None:
    model = make_model(tiny_config("tiny-llama"))
    ids = torch.randint(1, 90, (2, 6))
    batch = LMBatch(ids, torch.ones_like(ids), ids, prefix_len=torch.tensor([3, 2]))
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(model, batch), model(ids, prefix_lengths=batch.prefix_len))
        assert not torch.allclose(forward_logits(model, batch), model(ids))
