"""Timing the register-tiled micro-kernel against BLAS on this machine.

Which of the two runs a product faster flips by shape and by CPU
(:mod:`latte.compiler.passes.pack` asks where it matters): a product is timed both ways on
one thread, once per machine (:func:`~latte.compiler.machine.measured`, cached beside the
peak), and one process keeps one answer; processes that measure at once take the first
answer written. A product is named by its sizes, its leading dimensions and whether A is
read transposed: ``(m, n, k, lda, ldb, ldc, trans_a)``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import time
from pathlib import Path

import numpy as np

from latte.aligned import aligned_zeros
from latte.compiler import microkernel
from latte.compiler.codegen import ModuleBuilder
from latte.compiler.fingerprint import compiler_digest
from latte.compiler.ir import Affine, Block, Buffer, Gemm, Kernel
from latte.compiler.jit import compile_jobs, side_by_side, target
from latte.compiler.machine import measured, one_blas_thread, recorded
from latte.compiler.microkernel import in_place_tile

IN_PLACE = "in-place-speedup"   # the cache files' prefix for products timed by their shape
#: The product timed for a transposed A (m, n, k): a 3x3 convolution's input gradient, its
#: filters (256 x 1152 stored) read transposed times 196 pixels' gradients
TRANSPOSED_A_TRIAL = (1152, 196, 256)


@functools.lru_cache(maxsize=None)
def beats_blas(product: tuple, vector: tuple[int, int], l2: int) -> bool:
    """Does the micro-kernel, reading B in place, run ``product`` faster than BLAS here?"""
    return measured(_name(product), lambda: time_in_place([product], vector, l2)[0],
                    IN_PLACE) > 1.0


@functools.lru_cache(maxsize=None)
def transposed_a_beats_blas(vector: tuple[int, int], l2: int) -> bool:
    """Does the micro-kernel run :data:`TRANSPOSED_A_TRIAL`, A read transposed, faster than
    BLAS here (``transposed-a-speedup-<key>.json``)?"""
    m, n, k = TRANSPOSED_A_TRIAL
    return measured(f"transposed-a-speedup kernel {_kernel_revision()}",
                    lambda: time_in_place([(m, n, k, m, n, n, True)], vector, l2)[0],
                    "transposed-a-speedup") > 1.0


def measure(products: list[tuple], vector: tuple[int, int], l2: int) -> None:
    """Time those of ``products`` (as :func:`beats_blas` takes them) this machine has not
    answered yet, in one compiled module (a net's first compile here)."""
    new = [p for p in dict.fromkeys(products) if speedup(p) is None]
    for product, ratio in zip(new, time_in_place(new, vector, l2) if new else []):
        measured(_name(product), lambda r=ratio: r, IN_PLACE)


def key(g: Gemm) -> tuple:
    """How the trials name ``g``'s product: m, n, k, the leading dimensions of A, B and C,
    and whether A is read transposed."""
    return g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.trans_a


def speedup(product: tuple) -> float | None:
    """BLAS's time over the micro-kernel's for ``product`` (as :func:`beats_blas` takes it),
    if this machine has timed it; nothing is timed here."""
    return recorded(_name(product), IN_PLACE)


def _name(product: tuple) -> str:
    m, n, k, lda, ldb, ldc, trans_a = product
    a = " A transposed" if trans_a else ""
    return f"{IN_PLACE} {m}x{n}x{k}{a} lda={lda} ldb={ldb} ldc={ldc} kernel {_kernel_revision()}"


@functools.lru_cache(maxsize=None)
def _kernel_revision() -> str:
    """A digest of the micro-kernel's source and of this module's: a product is timed again
    when the kernel or the way it is timed changes."""
    sources = Path(microkernel.__file__).read_bytes() + Path(__file__).read_bytes()
    return hashlib.sha256(sources).hexdigest()[:12]


def time_in_place(products: list[tuple], vector: tuple[int, int], l2: int,
                  budget: float = 0.02, runs: int = 15) -> list[float]:
    """Per product (as :func:`key` names it; B read in place along its rows), BLAS's time
    over the micro-kernel's on one thread: the best of up to ``runs``
    runs each (the first of each warms up), taken in turns, fewer where they pass
    ``budget`` seconds; the products dealt out to the cores, each timed on one. The
    micro-kernels are compiled as a program is, in modules built and compiled side by side,
    one per core."""
    gemms = [tiled_gemm(product, i, vector, l2) for i, product in enumerate(products)]
    made_of = hashlib.sha256(repr((products, vector, l2, compiler_digest())).encode())
    library = target().library(made_of.hexdigest(), lambda parts: [
        lambda part=part: trial_module(gemms, range(part, len(gemms), parts))
        for part in range(min(parts, len(gemms)))])

    def race(share: range) -> bytes:
        ratios = []
        with one_blas_thread() as sgemm:
            for i in share:
                a, b, c = operands(products[i])
                table = (ctypes.c_void_p * 3)(*(x.ctypes.data for x in (a, b, c)))
                tiled = functools.partial(
                    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(library.address(f"trial{i}")),
                    ctypes.addressof(table))
                ratios.append(_race(blas_call(sgemm, products[i], a, b, c), tiled, budget, runs))
        return np.array(ratios, np.float64).tobytes()

    # the products dealt out to the cores, each process timing its own on one thread
    parts = min(compile_jobs(), len(products))
    dealt = [range(part, len(products), parts) for part in range(parts)]
    out = [0.0] * len(products)
    for share, data in zip(dealt, side_by_side([lambda t=t: race(t) for t in dealt])):
        for i, ratio in zip(share, np.frombuffer(data, np.float64)):
            out[i] = float(ratio)
    return out


def tiled_gemm(product: tuple, i: int, vector: tuple[int, int], l2: int) -> Gemm:
    """``product`` (as :func:`key` names it) as the compiler tiles it with B read in place,
    over buffers of its own (``i`` tells them apart)."""
    m, n, k, lda, ldb, ldc, trans_a = product
    lanes = vector[0] // 32
    a, b, c = (Buffer((x, i), x, (size,)) for x, size in
               zip("ABC", ((k if trans_a else m) * lda, k * ldb, m * ldc)))
    rows, cols, block = in_place_tile(m, n, k, lanes, vector[1], l2 // 2, trans_a, ldb)
    return Gemm(m, n, k, a, Affine(), lda, trans_a, b, Affine(), ldb, False, c, Affine(), ldc,
                beta=0.0, panel=(rows, cols, lanes), packed=False, k_block=block)


def trial_module(gemms: list[Gemm], which) -> str:
    """The LLVM IR of the products ``gemms[i]`` for ``i`` in ``which``, each the exported
    ``trial<i>(ptr* operands)`` over its A, B and C."""
    builder = ModuleBuilder({})
    for i in which:
        g = gemms[i]
        builder.buffer_index.update({g.a_buf: 0, g.b_buf: 1, g.c_buf: 2})
        builder.add_segment(f"trial{i}", [Kernel(f"trial{i}", Block((g,)))])
    return str(builder.module)


def operands(product: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A, B and C of ``product`` (:func:`_operand`)."""
    m, n, k, lda, ldb, ldc, trans_a = product
    return tuple(_operand(*block) for block in (
        (k, m, lda) if trans_a else (m, k, lda), (k, n, ldb), (m, n, ldc)))


def blas_call(sgemm, product: tuple, a: np.ndarray, b: np.ndarray, c: np.ndarray):
    """``sgemm`` (CBLAS's) running ``product`` over ``a``, ``b`` and ``c``, as a function of
    no arguments."""
    m, n, k, lda, ldb, ldc, trans_a = product
    return functools.partial(sgemm, 101, 112 if trans_a else 111, 111, m, n, k, 1.0,
                             a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, c.ctypes.data, ldc)


def _operand(rows: int, cols: int, ld: int) -> np.ndarray:
    """``rows`` rows of ``ld`` floats, 64-byte aligned as a program's buffers are (numpy's
    own arrays start 16 bytes past a line, where the micro-kernel's vectors would split
    lines), whose first ``cols`` (what a product reads or writes) are 0.5. The rest stays
    zero and untouched: VGG-16's first fully connected layer, in slices of columns, reads
    an eighth of its 400 MB of weights per product, and the other pages are never mapped."""
    out = aligned_zeros((rows, ld), np.float32)
    out[:, :cols] = 0.5
    return out


def _race(blas, tiled, budget: float, runs: int) -> float:
    """``blas``'s best time over ``tiled``'s, run in turns (see :func:`time_in_place`)."""
    best = {blas: math.inf, tiled: math.inf}
    spent = 0.0
    for run in range(runs + 1):
        for fn in (blas, tiled):
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            spent += took
            if run:
                best[fn] = min(best[fn], took)
        if run >= 2 and spent > budget:
            break
    return best[blas] / best[tiled]
