"""Weight-only int8 matmul kernel vs float matmuls, one layer, side by side.

Why engine/quant.py feeds bf16 activations to `aten._weight_int8pack_mm`.

Usage: .venv/bin/python bench/int8_matmul.py [--n 2048 --k 2048 --iters 50]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch


def bench(f, iters: int) -> float:
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    torch.manual_seed(0)
    from pagefleet.engine.quant import quantize_int8

    w = torch.randn(args.n, args.k)
    q, scale = quantize_int8(w)
    print(f"{args.n}x{args.k} layer, torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call")
    print("| batch | fp32 matmul | bf16 matmul | int8 kernel, fp32 activations | int8 kernel, bf16 activations |")
    print("|---:|---:|---:|---:|---:|")
    for m in (1, 16):
        x = torch.randn(m, args.k)
        xb, wb = x.bfloat16(), w.bfloat16()
        int8_mm = torch.ops.aten._weight_int8pack_mm
        row = [bench(partial(torch.matmul, x, w.T), args.iters), bench(partial(torch.matmul, xb, wb.T), args.iters),
               bench(partial(int8_mm, x, q, scale), args.iters),
               bench(partial(int8_mm, xb, q, scale.bfloat16()), args.iters)]
        print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in row) + " |")


if __name__ == "__main__":
    main()
