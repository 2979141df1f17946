"""tformer's W8A8 matmul (`w8a8.cpp`, AVX512-VNNI) against fbgemm's dynamic int8 matmul (tformer's W8A8 until
2026-12-02) and `torch._int_mm` (oneDNN), on SmolLM2-135M's layer shapes.

All three quantize each row (token) of a bf16 activation to 8 bits by its largest magnitude, multiply by the same
per-output-channel int8 weight, and scale the int32 result back to bf16. fbgemm quantizes a whole input over one
range: a row holding +1 and -1 appended to the scaled rows pins that range to [-1, 1], which makes it per token (as
tformer's W8A8 did). `torch._int_mm` needs more than 16 rows, so fewer are padded to 17. Per shape (fused q/k/v
576 -> 960, gate/up 576 -> 3072, down 1536 -> 576, the head 576 -> 49152) and rows (1: batch-1 decode, 32: a decode
batch under load, 450: a prefill chunk), the three alternate and the medians of 5 timings are printed with the
peers' time over tformer's and the largest difference from tformer's outputs.

    flock /tmp/tformer-cpu.lock .venv/bin/python benchmarks/w8a8_vs_int_mm.py
"""

from __future__ import annotations

import warnings

import torch
from common import kernel_paths, load_report, machine_info, median_seconds, set_threads, uptime

from tformer.kernels.w8a8 import W8A8Linear, per_channel_scales

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]  # (in, out) of SmolLM2's fused layers and head
ROWS = [1, 32, 450]


def fbgemm_linear(weight: torch.Tensor):
    """y = s_x (q_x q_w^T) s_w through fbgemm's `quantized::linear_dynamic`, per token as described above."""
    scales = per_channel_scales(weight)
    with warnings.catch_warnings():  # quantize_per_channel warns about a future dtype change of its scales
        warnings.simplefilter("ignore")
        zero = torch.zeros(len(scales), dtype=torch.long)
        q_weight = torch.quantize_per_channel(weight, scales.double(), zero, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q_weight, None)
    range_row = torch.zeros(1, weight.shape[1])
    range_row[0, :2] = torch.tensor([1.0, -1.0])

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.float()
        scale = flat.abs().amax(1, keepdim=True).clamp(min=1e-12)
        out = torch.ops.quantized.linear_dynamic(torch.cat([flat / scale, range_row]), packed, False)[:-1]
        return (out * scale).to(x.dtype)

    return forward


def int_mm_linear(weight: torch.Tensor):
    """y = s_x (q_x q_w^T) s_w through torch._int_mm, with per-row activation and per-channel weight scales."""
    scales = per_channel_scales(weight)
    q_weight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).t().contiguous()  # (in, out)

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.float()
        row_scales = flat.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        q_x = torch.round(flat / row_scales).to(torch.int8)
        rows = q_x.shape[0]
        if rows <= 16:
            q_x = torch.nn.functional.pad(q_x, (0, 0, 0, 17 - rows))
        return (torch._int_mm(q_x, q_weight)[:rows].float() * row_scales * scales).to(x.dtype)

    return forward


def main() -> None:
    threads = set_threads(2)
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    torch.manual_seed(0)
    sides = ["tformer", "fbgemm", "_int_mm"]
    header = [*(f"{side} us" for side in sides), "fbgemm / tformer", "_int_mm / tformer", "max diff"]
    print(f"{'in x out':>12s} {'rows':>5s} " + " ".join(f"{h:>17s}" for h in header))
    for n_in, n_out in SHAPES:
        linear = torch.nn.Linear(n_in, n_out, bias=False)
        weight = linear.weight.detach()
        layers = {"tformer": W8A8Linear(linear), "fbgemm": fbgemm_linear(weight), "_int_mm": int_mm_linear(weight)}
        for rows in ROWS:
            x = torch.randn(rows, n_in).bfloat16()
            ours = layers["tformer"](x).float()
            diff = max((layers[side](x).float() - ours).abs().max().item() for side in sides[1:])
            timings: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(5):  # alternate the sides, 20 calls a timing
                for side in sides:
                    layer = layers[side]
                    timings[side].append(median_seconds(lambda f=layer, x=x: [f(x) for _ in range(20)], 1) / 20)
            us = [sorted(timings[side])[2] * 1e6 for side in sides]
            ratios = " ".join(f"{t / us[0]:16.2f}x" for t in us[1:])
            times = " ".join(f"{t:17.0f}" for t in us)
            print(f"{n_in:>5d} x {n_out:<5d} {rows:5d} {times} {ratios} {diff:17.3f}")
    print(f"{threads} threads; ratios above 1: tformer's kernel is faster")
    print(load_report("after"))
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
