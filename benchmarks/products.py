"""Register-tiled products on one thread: the micro-kernel reading B in place as it is, the
same with B copied to realigned rows where the compiler copies it, and OpenBLAS.

    python benchmarks/products.py [M,N,K[,LDA,LDB,LDC][,T] ...] [--repeat 300]

Each product (``T``: A read transposed, stored K x LDA; leading dimensions K, N, N or M,
N, N by default) is built as the compiler builds it (``microkernel.in_place_tile``), once
with the copy switched off while it is emitted and once as it is, and runs on operands
aligned as a program's buffers are; the three take turns, and the table gives each one's
median GFLOP/s and the copy's speedup. Without products: those the README's session 37
section quotes (a 1x1 and a 3x3 convolution of a 14x14 image, a 13x13 one, an MLP's input
gradient with B's rows 4 KiB apart, its weight gradient, a 7x7 image left in place).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine, table  # noqa: E402

DEFAULT = ["64,196,1024", "128,196,2304", "64,196,4608", "256,169,1152",
           "128,128,1024,1024,1024,1024", "1024,128,128,1024,1024,1024,T", "64,49,2048"]


def _product(text: str) -> tuple:
    parts = text.split(",")
    trans_a = parts[-1] == "T"
    m, n, k, *lds = (int(x) for x in parts[:len(parts) - trans_a])
    return (m, n, k, *(lds or ((m if trans_a else k), n, n)), trans_a)


def _library(products: list[tuple], copies: bool):
    """The products' tiled functions, ``trial0``..., compiled with or without the copy."""
    from latte.compiler import microkernel, trials
    from latte.compiler.jit import target
    from latte.compiler.machine import cache_sizes, vector_registers

    realigned = microkernel.realigned
    if not copies:
        microkernel.realigned = lambda *args: 0
    try:
        gemms = [trials.tiled_gemm(p, i, vector_registers(), cache_sizes()[2])
                 for i, p in enumerate(products)]
        text = trials.trial_module(gemms, range(len(gemms)))
    finally:
        microkernel.realigned = realigned
    lib = target().library(hashlib.sha256(text.encode()).hexdigest(), lambda parts: [lambda: text])
    return lib, gemms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("products", nargs="*", default=DEFAULT)
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args()
    from latte.compiler.machine import one_blas_thread
    from latte.compiler.microkernel import copied_rows
    from latte.compiler.trials import blas_call, operands

    products = [_product(p) for p in args.products]
    (plain, _), (copied, gemms) = _library(products, False), _library(products, True)
    rows = []
    with one_blas_thread() as sgemm:
        for i, (product, g) in enumerate(zip(products, gemms)):
            m, n, k, lda, ldb, ldc, trans_a = product
            a, b, c = operands(product)   # 64-byte aligned, as a program's buffers are
            table_ = (ctypes.c_void_p * 3)(*(x.ctypes.data for x in (a, b, c)))
            call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
            runs = {
                "in place": functools.partial(call(plain.address(f"trial{i}")),
                                              ctypes.addressof(table_)),
                "copied": functools.partial(call(copied.address(f"trial{i}")),
                                            ctypes.addressof(table_)),
                "blas": blas_call(sgemm, product, a, b, c)}
            times: dict = {name: [] for name in runs}
            for _ in range(args.repeat + 2):   # two warm-up turns
                for name, fn in runs.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            gflops = {name: 2 * m * n * k / statistics.median(ts[2:]) / 1e9
                      for name, ts in times.items()}
            width = copied_rows(g)
            rows.append([f"{m} x {n} over {k}" + (" (A^T)" if trans_a else ""),
                         f"{lda}, {ldb}, {ldc}", f"{g.panel[0]} x {g.panel[1]}",
                         f"{width} ({g.k_block or k} of k)" if width else "-",
                         f"{gflops['in place']:.1f}", f"{gflops['copied']:.1f}",
                         f"{gflops['blas']:.1f}", f"{gflops['copied'] / gflops['in place']:.2f}x"])
    print(f"tiled products on one thread, median of {args.repeat} runs each in turn; {machine()}")
    print(table(rows, ["product", "lda, ldb, ldc", "tile", "copied rows", "in place GFLOP/s",
                       "copied GFLOP/s", "OpenBLAS GFLOP/s", "copied / in place"]))


if __name__ == "__main__":
    main()
