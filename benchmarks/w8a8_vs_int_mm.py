"""W8A8's int8 matmul (fbgemm, `W8A8Linear`) against `torch._int_mm` (oneDNN), on SmolLM2-135M's layer shapes.

Both sides quantize each row (token) of a bf16 activation to int8 by its largest magnitude, multiply by the same
per-output-channel int8 weight, and scale the int32 result back to bf16; `torch._int_mm` needs more than 16 rows,
so a single row is padded to 17. Per shape (fused q/k/v 576 -> 960, gate/up 576 -> 3072, down 1536 -> 576, the head
576 -> 49152) and rows (1: batch-1 decode, 32: a decode batch under load, 450: a prefill chunk), the two alternate
and the medians of 5 timings are printed with their ratio and the largest difference between their outputs.

    flock /tmp/tformer-cpu.lock .venv/bin/python benchmarks/w8a8_vs_int_mm.py
"""

from __future__ import annotations

import torch
from common import load_report, machine_info, median_seconds, set_threads, uptime

from tformer.inference.quantize import W8A8Linear, per_channel_scales

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]  # (in, out) of SmolLM2's fused layers and head
ROWS = [1, 32, 450]


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
    print(load_report("before"))
    torch.manual_seed(0)
    header = ["fbgemm us", "_int_mm us", "_int_mm / fbgemm", "max diff"]
    print(f"{'in x out':>12s} {'rows':>5s} " + " ".join(f"{h:>17s}" for h in header))
    for n_in, n_out in SHAPES:
        linear = torch.nn.Linear(n_in, n_out, bias=False)
        ours, theirs = W8A8Linear(linear), int_mm_linear(linear.weight.detach())
        for rows in ROWS:
            x = torch.randn(rows, n_in).bfloat16()
            diff = (ours(x).float() - theirs(x).float()).abs().max().item()
            timings: dict[str, list[float]] = {"fbgemm": [], "_int_mm": []}
            for _ in range(5):  # alternate the sides, 20 calls a timing
                for name, layer in (("fbgemm", ours), ("_int_mm", theirs)):
                    timings[name].append(median_seconds(lambda f=layer, x=x: [f(x) for _ in range(20)], 1) / 20)
            a, b = (sorted(timings[name])[2] * 1e6 for name in ("fbgemm", "_int_mm"))
            print(f"{n_in:>5d} x {n_out:<5d} {rows:5d} {a:17.0f} {b:17.0f} {b / a:16.2f}x {diff:17.3f}")
    print(f"{threads} threads; ratio above 1: fbgemm (tformer's W8A8) is faster")
    print(load_report("after"))
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
