"""The SSM's prefill: where the parallel scan is faster (a small state, a long prompt) the prompt goes through it,
and decoding from the state it leaves equals the uncached forward (the token loop), in fp32."""

from __future__ import annotations

import pytest
import torch

import tformer
from tformer import ModelConfig
from tformer.layers import ssm


def ssm_config() -> ModelConfig:
    return ModelConfig(
        family="ssm", vocab_size=97, d_model=32, n_decoder_layers=2, dropout=0.0, norm="rmsnorm", ssm_state_size=4
    )


def test_decoding_after_a_parallel_prefill_equals_the_uncached_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = tformer.build_model(ssm_config()).eval()
    ids = torch.randint(1, 97, (1, 300))
    scans: list[str] = []
    for name in ("parallel_scan", "sequential_scan"):
        scan = getattr(ssm, name)
        monkeypatch.setattr(ssm, name, lambda *args, _scan=scan, _name=name: scans.append(_name) or _scan(*args))
    monkeypatch.setitem(ssm.SCANS, "cpu", ssm.sequential_scan)  # the uncached forward: the CPU's token loop
    with torch.no_grad():
        full = model(ids)
        assert scans == ["sequential_scan"] * 2  # one per layer
        cache = model.new_cache(1)
        pieces = [model(ids[:, :280], cache=cache)]
        assert scans[2:] == ["parallel_scan"] * 2  # 280 tokens, one chunk of states is 16 KiB
        pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(280, 300)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "batch, length, d_inner, expected",
    [(1, 1024, 512, "parallel"), (1, 128, 512, None), (2, 1024, 512, None), (8, 1024, 64, "parallel")],
)
def test_the_prefill_takes_the_parallel_scan_only_where_it_measured_faster(
    batch: int, length: int, d_inner: int, expected: str | None
) -> None:
    """The measured rule: 1 MiB of states per chunk at most (batch 1 at d_inner 512, N 16), 256 tokens at least."""
    assert ssm.prefill_scan(batch, length, d_inner, 16, torch.device("cpu")) == expected
    assert ssm.prefill_scan(batch, length, d_inner, 16, torch.device("cuda")) is None  # the GPU's default: parallel
