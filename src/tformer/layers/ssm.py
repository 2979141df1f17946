"""The Mamba block (Gu & Dao, 2023): a selective state-space model, the SSM family's replacement for attention.

Per channel d of the expanded input and state dimension n, with input-dependent Δ_t, B_t and C_t:

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t          (B, d_inner, N)
    y_t = C_t · h_t + D x_t

`selective_scan` evaluates the recurrence for a whole sequence: chunk by chunk, each chunk with a parallel
(Hillis-Steele) prefix scan over the pairs (decay, input), which is exact and stable because it only ever multiplies
decays in (0, 1]; the state crosses chunk boundaries. `selective_step` is the same recurrence for one token: decoding
keeps a constant-size state (conv window plus h) instead of a KV cache that grows with the context.

The scan is written here rather than taken from `mambapy` (PyPI): mambapy's pscan materializes the state for the
whole sequence and has no cache object for stepping, and a scan of about 30 lines is easier to test against the
plain loop than a dependency is to pin (see docs/ssm-vs-transformer.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tformer.config import ModelConfig

SCAN_CHUNK = 32  # tokens per parallel-scan chunk: log2(32) = 5 combine steps on (B, chunk, d_inner, N) tensors


@dataclass
class SSMState:
    """One Mamba block's decoding state: the last conv_width - 1 conv inputs and the SSM state h.

    Its size does not depend on how many tokens came before (the KV cache's does).
    """

    conv: torch.Tensor  # (B, d_inner, conv_width - 1)
    ssm: torch.Tensor  # (B, d_inner, N), fp32

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


def _scan_chunk(decay: torch.Tensor, inputs: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """States h_1..h_T of h_t = decay_t ⊙ h_{t-1} + inputs_t from h_0, decay and inputs (B, T, d, N).

    Hillis-Steele scan: after the step with stride k, element t holds the composition of elements t-2k+1..t.
    """
    a, b = decay, inputs
    k, T = 1, decay.shape[1]
    while k < T:
        b = torch.cat([b[:, :k], a[:, k:] * b[:, :-k] + b[:, k:]], dim=1)
        a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], dim=1)
        k *= 2
    return a * h0.unsqueeze(1) + b


def parallel_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h: torch.Tensor,
    chunk: int = SCAN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C_t · h_t for every t (B, L, d) and h_L, chunk by chunk with a Hillis-Steele scan inside each chunk.

    Memory holds one chunk's states (B, chunk, d, N) at a time, not the whole sequence's.
    """
    ys = []
    for start in range(0, x.shape[1], chunk):
        piece = slice(start, start + chunk)
        dt = delta[:, piece].unsqueeze(-1)  # (B, T, d, 1)
        decay = torch.exp(dt * A)  # (B, T, d, N)
        inputs = dt * B[:, piece].unsqueeze(2) * x[:, piece].unsqueeze(-1)  # (B, T, d, N)
        states = _scan_chunk(decay, inputs, h)  # (B, T, d, N)
        ys.append(torch.einsum("btdn,btn->btd", states, C[:, piece]))
        h = states[:, -1]
    return torch.cat(ys, dim=1), h


def sequential_scan(
    x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `parallel_scan`, one token after another: each step touches only the state (B, d, N)."""
    ys = []
    for t in range(x.shape[1]):
        y, h = _recurrence(x[:, t], delta[:, t], A, B[:, t], C[:, t], h)
        ys.append(y)
    return torch.stack(ys, dim=1), h


# Which scan a device runs. On the CPU the token-by-token loop keeps the (B, d, N) state in cache and was far faster
# than the chunked parallel scan, whose (B, chunk, d, N) passes are memory-bound (docs/ssm-vs-transformer.md); a GPU
# gains from the parallel form's log2(chunk) wide steps instead of L narrow ones.
SCANS = {"cpu": sequential_scan}
# A prefill (the prompt into a decoding state, no backward) runs the parallel scan where it measured faster: on the
# CPU while one chunk's (B, chunk, d_inner, N) fp32 states fit in 1 MiB and the prompt has at least 256 tokens
# (docs/design-notes.md, "layers/ssm.py").
PARALLEL_PREFILL = {"cpu": (1 << 20, 256)}  # device -> (largest chunk of states in bytes, fewest prompt tokens)


def prefill_scan(batch: int, length: int, d_inner: int, state_size: int, device: torch.device) -> str | None:
    """The scan a prefill of `batch` prompts of `length` tokens runs: "parallel" where it measured faster, else
    None (the device's default, `SCANS`; a device without a rule, such as a GPU, already runs the parallel one)."""
    rule = PARALLEL_PREFILL.get(device.type)
    if rule is None:
        return None
    max_chunk_bytes, min_tokens = rule
    chunk_bytes = batch * SCAN_CHUNK * d_inner * state_size * 4  # fp32 states of one chunk
    return "parallel" if chunk_bytes <= max_chunk_bytes and length >= min_tokens else None


def selective_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h0: torch.Tensor | None = None,
    scan: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y (B, L, d) and the last state h_L (B, d, N) of the selective SSM, computed in fp32.

    x, delta: (B, L, d); A: (d, N), negative; B, C: (B, L, N); D: (d,); h0: (B, d, N) or None for zeros.
    `scan` is "parallel" or "sequential" (both exact); None picks the faster one for x's device (SCANS).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least, fp64 for gradcheck
    x, delta, A, B, C = x.to(dtype), delta.to(dtype), A.to(dtype), B.to(dtype), C.to(dtype)
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1]) if h0 is None else h0.to(dtype)
    run = {"parallel": parallel_scan, "sequential": sequential_scan}[scan] if scan else SCANS.get(x.device.type)
    y, h = (run or parallel_scan)(x, delta, A, B, C, h)
    return y + x * D.to(dtype), h


def _recurrence(
    x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = exp(Δ A) h + Δ B x and C · h for one token: x, delta (B, d); A (d, N); B, C (B, N); h (B, d, N)."""
    dt = delta.unsqueeze(-1)  # (B, d, 1)
    h = torch.exp(dt * A) * h + dt * B.unsqueeze(1) * x.unsqueeze(-1)  # (B, d, N)
    return torch.einsum("bdn,bn->bd", h, C), h


def selective_step(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence, O(1) in the context length: x, delta (B, d); B, C (B, N); h (B, d, N)."""
    x = x.float()
    y, h = _recurrence(x, delta.float(), A.float(), B.float(), C.float(), h)
    return y + x * D.float(), h


class MambaMixer(nn.Module):
    """in_proj -> causal depthwise conv1d -> SiLU -> selective scan (Δ, B, C from the input) -> gate -> out_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d_inner = config.ssm_expand * config.d_model
        self.d_inner, self.state_size, self.conv_width = d_inner, config.ssm_state_size, config.ssm_conv_width
        self.dt_rank = math.ceil(config.d_model / 16)
        self.in_proj = nn.Linear(config.d_model, 2 * d_inner, bias=False)  # x and the gate z
        self.conv = nn.Conv1d(
            d_inner, d_inner, config.ssm_conv_width, groups=d_inner, padding=config.ssm_conv_width - 1
        )
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * self.state_size, bias=False)  # Δ (low rank), B, C
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=False)
        # plain parameters, outside nn.Linear, so that the model-wide Linear initializers leave Mamba's init alone
        self.dt_bias = nn.Parameter(_dt_bias_init(d_inner))
        self.A_log = nn.Parameter(
            torch.log(torch.arange(1, self.state_size + 1, dtype=torch.float32)).repeat(d_inner, 1)
        )
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, config.d_model, bias=False)

    def params_without_weight_decay(self) -> list[nn.Parameter]:
        """What AdamW must not pull towards zero (Mamba's `_no_weight_decay`, extended to the conv): A_log sets each
        channel's decay rate, D the skip, dt_bias its time scale, and the depthwise conv mixes a few neighbours."""
        return [self.A_log, self.D, self.dt_bias, *self.conv.parameters()]

    def new_state(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> SSMState:
        """An empty decoding state for `batch_size` sequences."""
        conv = torch.zeros(batch_size, self.d_inner, self.conv_width - 1, dtype=dtype, device=device)
        return SSMState(conv, torch.zeros(batch_size, self.d_inner, self.state_size, device=device))

    def _ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Δ (softplus, > 0), B and C from the conv output x (..., d_inner)."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        delta = F.softplus(self.dt_proj(dt).float() + self.dt_bias.float())
        return delta, B, C

    def forward(self, hidden: torch.Tensor, state: SSMState | None = None) -> torch.Tensor:
        """Hidden states (B, L, d_model) -> (B, L, d_model); with `state`, continues from it and updates it."""
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # (B, L, d_inner) each
        if state is not None and hidden.shape[1] == 1:
            return self.out_proj(self._step(x[:, 0], state).unsqueeze(1).to(z.dtype) * F.silu(z))
        L = x.shape[1]
        x = x.transpose(1, 2)  # (B, d_inner, L)
        if state is not None:
            x = torch.cat([state.conv.to(x.dtype), x], dim=2)
            state.conv = x[:, :, -(self.conv_width - 1) :].detach().clone()
            x = self.conv(x)[:, :, self.conv_width - 1 : self.conv_width - 1 + L]
        else:
            x = self.conv(x)[:, :, :L]  # causal: drop the outputs that saw right padding
        x = F.silu(x.transpose(1, 2))  # (B, L, d_inner)
        delta, B, C = self._ssm_inputs(x)
        A = -torch.exp(self.A_log.float())
        if state is None:
            y, h = selective_scan(x, delta, A, B, C, self.D)
        else:
            scan = prefill_scan(x.shape[0], L, self.d_inner, self.state_size, x.device)
            y, h = selective_scan(x, delta, A, B, C, self.D, state.ssm, scan=scan)
            state.ssm = h.detach()
        return self.out_proj(y.to(z.dtype) * F.silu(z))

    def _step(self, x: torch.Tensor, state: SSMState) -> torch.Tensor:
        """One token x (B, d_inner) through conv and scan, updating `state` in place; returns y (B, d_inner)."""
        window = torch.cat([state.conv.to(x.dtype), x.unsqueeze(-1)], dim=2)  # (B, d_inner, conv_width)
        state.conv = window[:, :, 1:]
        x = (window * self.conv.weight[:, 0].to(x.dtype)).sum(-1)
        if self.conv.bias is not None:
            x = x + self.conv.bias.to(x.dtype)
        x = F.silu(x)
        delta, B, C = self._ssm_inputs(x)
        y, state.ssm = selective_step(x, delta, -torch.exp(self.A_log.float()), B, C, self.D, state.ssm)
        return y


def _dt_bias_init(d_inner: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """Mamba's Δ bias: softplus(bias) log-uniform in [dt_min, dt_max], so each channel starts at its own time scale."""
    dt = torch.exp(torch.rand(d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + torch.log(-torch.expm1(-dt))  # the inverse of softplus
