"""Weights packed once before a time loop, and the register-tiled product that reads them:
the micro-kernel against numpy (packed B and B in place, partial tiles, transposed A, alpha
and beta, a bias per column, both vector widths), the tile against the register file, an LSTM at opt level 3
against level 0, and a convolution's window tiles multiplied in place."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest
from helpers import assert_scaled_close, vector_registers

from latte import Net
from latte.compiler import Segment, TimeSteps
from latte.compiler.codegen import ModuleBuilder
from latte.compiler.explain import explain_program
from latte.compiler.ir import (
    EPI_C,
    EPI_COL,
    EPI_ROW,
    Affine,
    Assign,
    BinOp,
    Block,
    Buffer,
    Const,
    Gemm,
    Kernel,
    Load,
    Ref,
    Var,
    walk,
)
from latte.compiler.jit import target
from latte.compiler.microkernel import (
    DOT_COPY,
    MAX_ROWS,
    busy,
    dot_columns,
    dot_tile,
    in_place_tile,
    realigned,
    tile,
)
from latte.compiler.passes.epilogue import epilogue
from latte.compiler.passes.pack import _dot
from latte.compiler.printer import fmt_stmt
from latte.stdlib import FullyConnectedLayer, LSTMLayer, MemoryDataLayer, SoftmaxLossLayer


def _packed(b: np.ndarray, cols: int) -> np.ndarray:
    """``b`` (k, n) as ``[ceil(n / cols)][k][cols]``, the last panel zero-padded."""
    k, n = b.shape
    panels = -(-n // cols)
    padded = np.zeros((k, panels * cols), np.float32)
    padded[:, :n] = b
    return np.ascontiguousarray(padded.reshape(k, panels, cols).transpose(1, 0, 2))


def _run_tiled(m, n, k, rows, cols, lanes, trans_a, alpha, beta, packed=True, seed=0, k_block=0,
               past=2):
    rng = np.random.default_rng(seed)
    lda, ldc = (m if trans_a else k) + 3, n + 5        # leading dimensions wider than the block
    a = rng.standard_normal(((k if trans_a else m), lda)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = rng.standard_normal((m, ldc)).astype(np.float32)
    # B in place: rows ``past`` floats wider than the block, the columns past it NaN
    p = _packed(b, cols) if packed else np.pad(b, ((0, 0), (0, past)), constant_values=np.nan)
    ldb = cols if packed else n + past
    op_a = (a[:, :m].T if trans_a else a[:, :k]).astype(np.float64)
    expected = c.astype(np.float64)
    expected[:, :n] = alpha * op_a @ b.astype(np.float64) + beta * expected[:, :n]
    _multiply(lambda bufs: Gemm(m, n, k, bufs[0], Affine(), lda, trans_a, bufs[1], Affine(), ldb,
                                False, bufs[2], Affine(), ldc, alpha=alpha, beta=beta,
                                panel=(rows, cols, lanes), packed=packed, k_block=k_block), a, p, c)
    return c, expected


def _multiply(gemm, *arrays) -> None:
    """Compile and run ``gemm(buffers)`` over ``arrays`` (A, B, C in place, then its
    epilogue's)."""
    bufs = [Buffer((x,), x, arr.shape) for x, arr in zip("ABCDEF", arrays)]
    mb = ModuleBuilder({buf: i for i, buf in enumerate(bufs)})
    mb.add_segment("seg", [Kernel("product", Block((gemm(bufs),)))])
    lib = target().compile(str(mb.module))
    table = (ctypes.c_void_p * len(arrays))(*(x.ctypes.data for x in arrays))
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lib.address("seg"))(ctypes.addressof(table))


@pytest.mark.parametrize("m,n,k,rows,cols,lanes", [
    (32, 1024, 64, 4, 64, 16),    # whole tiles
    (13, 150, 37, 4, 48, 16),     # a partial row tile and a partial panel (a partial vector)
    (5, 7, 3, 2, 16, 8),          # n below one vector
    (9, 40, 20, 6, 16, 8),        # AVX2-sized tiles
    (1, 33, 11, 1, 32, 16),       # one row
    (50, 40, 30, 4, 32, 16),      # more rows than columns: row block by row block
    (37, 20, 9, 5, 16, 8),        # the same, AVX2-sized, partial rows and panels
    (20, 49, 300, 8, 48, 16),     # 7x7 pixels: in place, 3 vectors and a column of dot products
    (11, 70, 40, 3, 32, 16),      # in place, 4 vectors and 6 columns of dot products
])
@pytest.mark.parametrize("trans_a,alpha,beta", [(False, 1.0, 0.0), (True, 1.0, 1.0),
                                                (False, 0.5, -2.0)])
@pytest.mark.parametrize("packed", [True, False])
def test_tiled_gemm_matches_numpy(m, n, k, rows, cols, lanes, trans_a, alpha, beta, packed):
    c, expected = _run_tiled(m, n, k, rows, cols, lanes, trans_a, alpha, beta, packed)
    # columns past n (a partial panel's padding) are left as they were
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-4 * max(1, k) ** 0.5)
    np.testing.assert_array_equal(c[:, n:], expected[:, n:])


@pytest.mark.parametrize("m,n,k,k_block,rows,cols,past", [
    (20, 49, 300, 64, 8, 48, 2),     # 4 blocks of 64 and one of 44, a column of dot products
    (30, 40, 256, 128, 5, 32, 2),    # 2 whole blocks, 8 columns of dot products
    (9, 7, 50, 16, 4, 16, 2),        # n below one vector
    (64, 196, 300, 128, 5, 80, 2),   # rows 198 floats apart copied to rows of 208, 3 blocks
    (40, 150, 37, 0, 4, 48, 2),      # the same, all of k in one copy
    (40, 128, 100, 32, 5, 80, 384),  # rows 2 KiB apart copied to rows of 128 floats
    (40, 500, 70, 48, 5, 80, 12),    # rows of 512 floats copied to rows of 528
])
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.5, -2.0)])
def test_b_in_place_in_blocks_of_k_adds_up(m, n, k, k_block, rows, cols, past, alpha, beta):
    """B read in place ``k_block`` rows at a time: the first block with beta, the others
    adding to C, every column's sum over all of ``k``."""
    c, expected = _run_tiled(m, n, k, rows, cols, 16, False, alpha, beta, False, k_block=k_block,
                             past=past)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-4 * k ** 0.5)
    np.testing.assert_array_equal(c[:, n:], expected[:, n:])


def test_b_in_place_off_vector_boundaries_is_copied_to_realigned_rows():
    """B's rows starting off a vector's boundary or a multiple of 2 KiB apart, wider than one
    panel and read by at least 4 row blocks are copied, blocks of k at a time, to rows of
    whole vectors: 196 floats (a 14x14 image) to 208, an MLP's 128 columns of 1024 to 128
    (512 columns to 528: not 2 KiB apart); not rows a vector apart, one panel of 3 vectors
    (a 7x7 image's 49 floats), 3 row blocks, or rows too long for a copy a vector deep."""
    assert realigned(64, 196, 196, (5, 80), 16) == 208
    assert realigned(64, 196, 196, (5, 80), 8) == 200
    assert realigned(128, 1024, 128, (5, 80), 16) == 128
    assert realigned(128, 512, 500, (5, 80), 16) == 528
    assert realigned(128, 1040, 128, (5, 80), 16) == 0
    assert realigned(64, 208, 196, (5, 80), 16) == 0
    assert realigned(64, 49, 49, (8, 48), 16) == 0
    assert realigned(15, 196, 196, (5, 80), 16) == 0
    assert realigned(64, 2050, 2050, (5, 80), 16) == 0
    # a 1x1 convolution of a 14x14 image: 128 rows of 208 floats at a time (157 fit)
    assert in_place_tile(64, 196, 1024, 16, 32, 1 << 20, ldb=196) == (5, 80, 128)
    assert in_place_tile(64, 196, 1024, 16, 32, 1 << 20, ldb=208) == (5, 80, 0)
    # a 3x3 one over 4608 window elements: the panel sized for the copy's blocks of 144
    assert in_place_tile(64, 196, 4608, 16, 32, 1 << 20)[1:] == (80, 144)
    assert in_place_tile(64, 196, 4608, 16, 32, 1 << 20, ldb=208)[1] == 48
    # latte explain names the copy
    a, b, c = (Buffer((x,), x, (1 << 20,)) for x in "ABC")
    g = Gemm(64, 196, 1024, a, Affine(), 1024, False, b, Affine(), 196, False, c, Affine(), 196,
             panel=(5, 80, 16), packed=False, k_block=128)
    assert "ldb=196, copied to rows of 208 (k in blocks of 128)" in fmt_stmt(g)[0]
    assert "copied" not in fmt_stmt(replace(g, ldb=208))[0]


def test_a_large_b_in_place_runs_in_blocks_of_k_that_stay_in_cache():
    """Row block by row block, each reads all of B: 4608 rows of 49 pixels (882 KiB, a
    7x7 layer's windows) run in two blocks of 2304 rows (at most 2672 fit 512 KiB), 4000
    in two of 2000, 4001 (no divisor near) in 2672 and a shorter last one; with fewer rows than
    columns, or A transposed, the tiles go panel by panel and k stays whole."""
    assert in_place_tile(64, 49, 4608, 16, 32, 512 << 10) == (8, 48, 2304)
    assert in_place_tile(64, 49, 4000, 16, 32, 512 << 10)[2] == 2000
    assert in_place_tile(64, 49, 4001, 16, 32, 512 << 10)[2] == 2672
    assert in_place_tile(64, 49, 2304, 16, 32, 512 << 10)[2] == 0
    assert in_place_tile(32, 49, 4608, 16, 32, 512 << 10, ldb=64)[2] == 0
    assert in_place_tile(64, 49, 4608, 16, 32, 512 << 10, trans_a=True, ldb=64)[2] == 0


@pytest.mark.parametrize("m,n,k,lanes,dots", [
    (64, 64, 112, 16, True),      # ResNet's 64-channel Winograd weight gradient: 7 vectors
    (64, 64, 63, 16, False),      # under 64 floats
    (128, 128, 98, 16, False),    # 128 channels: 6 vectors, under 8
    (128, 128, 128, 16, True),    # 8 vectors
    (64, 64, 112, 8, True),       # AVX2: 14 vectors
    (64, 64, 40, 8, False),       # AVX2: 5 vectors (under 64 floats)
    (64, 576, 112, 16, False),    # a 3x3 layer's 576 window elements: more than 64 rows
])
def test_dot_products_take_short_sums_over_few_rows(m, n, k, lanes, dots):
    """A product of both operands along ``k`` runs as dot products from 8 vectors of ``k``,
    or from 64 floats where neither operand has more than 64 rows (BLAS's packing then
    costs more than the dot products' sums across lanes)."""
    a, b, c = (Buffer((name,), name, (4096,)) for name in "abc")
    g = Gemm(m, n, k, a, Affine(), k, False, b, Affine(), k, True, c, Affine(), n, beta=1.0)
    assert (_dot(g, (lanes * 32, 32), 1 << 20) is not None) == dots


@pytest.mark.parametrize("m,n,k,rows,cols,lanes", [
    (64, 576, 448, 4, 6, 16),     # a 3x3 weight gradient over 448 pixels: whole tiles
    (13, 37, 77, 4, 6, 16),       # partial row and column tiles, a partial vector of k
    (5, 9, 7, 2, 3, 16),          # k below one vector
    (9, 40, 100, 3, 4, 8),        # AVX2-sized tiles
    (37, 3, 50, 5, 5, 8),         # fewer columns than a tile: rows outside
])
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (1.0, 1.0), (0.5, -2.0)])
def test_dot_products_match_numpy(m, n, k, rows, cols, lanes, alpha, beta):
    """``C = alpha * A @ B^T + beta * C`` with both operands along ``k`` (a weight gradient:
    output gradient times gathered windows), computed as ``rows x cols`` dot products."""
    rng = np.random.default_rng(3)
    lda, ldb, ldc = k + 3, k + 1, n + 5
    a = rng.standard_normal((m, lda)).astype(np.float32)
    b = rng.standard_normal((n, ldb)).astype(np.float32)
    a[:, k:], b[:, k:] = np.nan, np.nan                  # past k: never read
    c = rng.standard_normal((m, ldc)).astype(np.float32)
    expected = c.astype(np.float64)
    expected[:, :n] = (alpha * a[:, :k].astype(np.float64) @ b[:, :k].T.astype(np.float64)
                       + beta * expected[:, :n])
    _multiply(lambda bufs: Gemm(m, n, k, bufs[0], Affine(), lda, False, bufs[1], Affine(), ldb,
                                True, bufs[2], Affine(), ldc, alpha=alpha, beta=beta,
                                panel=(rows, cols, lanes), packed=False), a, b, c)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-4 * k ** 0.5)
    np.testing.assert_array_equal(c[:, n:], expected[:, n:])


@pytest.mark.parametrize("m,n,k,rows,cols,lanes", [
    (32, 1024, 64, 4, 64, 16),    # whole tiles
    (13, 150, 37, 4, 48, 16),     # a partial row tile and a partial panel
    (9, 40, 20, 6, 16, 8),        # AVX2-sized tiles
    (50, 40, 30, 4, 32, 16),      # row block by row block
])
@pytest.mark.parametrize("form,per", [   # after blocks of k, the last one runs the epilogue
    (f, p) for f in ("packed", "in place", "in place, blocks of k", "dot products")
    for p in ("column", "row", "row, then max(x, 0)", "batch norm, add, max(x, 0)")])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_tiled_gemm_runs_its_epilogue_on_each_element(m, n, k, rows, cols, lanes, form, beta,
                                                       per):
    """``C = A @ B + beta * C``, then the epilogue on each element
    (:mod:`latte.compiler.passes.epilogue`): ``C += bias[j]`` (``bias[i]`` per row; then,
    with the ReLU, ``C = max(C, 0)``), the bias read from an offset into its buffer; or a
    batch norm per row into another buffer, a residual added and the ReLU taken there,
    C keeping the product. Rounded as the product, then each operation in turn."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = rng.standard_normal((m, n + 3)).astype(np.float32)
    bias = rng.standard_normal(max(m, n) + 5).astype(np.float32)
    res = rng.standard_normal((m, n + 3)).astype(np.float32)
    out = rng.standard_normal((m, n + 3)).astype(np.float32)
    expected, after = c.astype(np.float64), out.astype(np.float64)
    expected[:, :n] = a.astype(np.float64) @ b.astype(np.float64) + beta * expected[:, :n]
    i, j = Affine.of(EPI_ROW), Affine.of(EPI_COL)
    x, zero = Var(EPI_C), Const(0.0)

    def body(bias_buf, res_buf, out_buf) -> list:
        at = lambda row: Ref(bias_buf, (row + 2,), (bias_buf.size,))   # noqa: E731
        if not per.startswith("batch norm"):
            add = Assign(Var(EPI_C), BinOp("+", x, Load(at(j if per == "column" else i))))
            return [add] + [Assign(Var(EPI_C), BinOp("max", x, zero))] * per.endswith("0)")
        here = lambda buf: Ref(buf, (i * (n + 3) + j,), (buf.size,))   # noqa: E731
        y = Load(here(out_buf))
        return [Assign(here(out_buf), BinOp("+", BinOp("*", Load(at(i)), BinOp(
                    "-", x, Load(at(i + 1)))), Load(at(i + 2)))),
                Assign(here(out_buf), BinOp("+", Load(here(res_buf)), y)),
                Assign(here(out_buf), BinOp("max", y, zero))]

    if per.startswith("batch norm"):
        scale, mean, shift = (bias[2 + s:m + 2 + s, None] for s in range(3))
        after[:, :n] = np.maximum(res[:, :n] + (scale * (expected[:, :n] - mean) + shift), 0.0)
    else:
        expected[:, :n] += bias[2:n + 2] if per == "column" else bias[2:m + 2, None]
        if per.endswith("max(x, 0)"):
            expected[:, :n] = np.maximum(expected[:, :n], 0.0)
    trans_b = form == "dot products"
    op_b = {"packed": _packed(b, cols), "dot products": np.ascontiguousarray(b.T)}.get(form, b)
    ldb = {"packed": cols, "dot products": k}.get(form, n)
    panel = (min(rows, 3), 4, lanes) if trans_b else (rows, cols, lanes)
    _multiply(lambda bufs: Gemm(m, n, k, bufs[0], Affine(), k, False, bufs[1], Affine(), ldb,
                                trans_b, bufs[2], Affine(), n + 3, beta=beta, panel=panel,
                                packed=form == "packed", epilogue=epilogue(m, n, body(*bufs[3:])),
                                k_block=16 * (form == "in place, blocks of k")),
              a, op_b, c, bias, res, out)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-4 * k ** 0.5)
    np.testing.assert_array_equal(c[:, n:], expected[:, n:])
    np.testing.assert_allclose(out, after, rtol=1e-5, atol=1e-4 * k ** 0.5)
    np.testing.assert_array_equal(out[:, n:], after[:, n:])


@pytest.mark.parametrize("lanes,registers", [(16, 32), (8, 16)])
@pytest.mark.parametrize("m,n", [(64, 576), (128, 1152), (3, 5), (1, 40), (13, 2)])
def test_dot_tile_fits_the_register_file(lanes, registers, m, n):
    rows, cols = dot_tile(m, n, lanes, registers)
    assert 1 <= rows <= min(m, MAX_ROWS) and 1 <= cols <= n
    assert rows * cols + rows + 1 <= registers   # accumulators, A's vectors, one of B


@pytest.mark.parametrize("bits,registers", [(256, 16), (512, 32), (128, 16)])
@pytest.mark.parametrize("m,n,k", [(1, 10, 3), (5, 3, 7), (13, 150, 37), (32, 1024, 512),
                                   (32, 256, 2048), (256, 512, 64), (7, 2048, 100)])
def test_tile_fits_the_register_file_and_the_cache(bits, registers, m, n, k):
    lanes, budget = bits // 32, 256 << 10
    rows, cols = tile(m, n, k, lanes, registers, budget)
    vecs = cols // lanes
    assert cols % lanes == 0 and 1 <= rows <= min(m, MAX_ROWS)
    assert rows * vecs + vecs + 1 <= registers   # accumulators, B's vectors, a broadcast
    assert 4 * k * cols <= budget


def test_b_in_place_gets_the_most_accumulators():
    """Read in place, a last partial panel loads only the vectors that hold B's columns: its
    width costs no padded work, so a Winograd product (512 channels x 98 tiles) gets a
    tile of 24 or more accumulators, where 98 columns in panels of 80 would count as 160."""
    rows, cols = tile(512, 98, 512, 16, 32, 1 << 20, in_place=True)
    assert rows * cols // 16 >= 24
    assert tile(512, 98, 512, 16, 32, 1 << 20) != (rows, cols)


def test_columns_past_the_last_vector_are_dot_products_where_they_fill_half_of_one():
    """In place, a 7x7 image's 49 columns are three vectors and a dot product (tiles of 8
    rows x 3 vectors, not 5 x 4 of which 15 lanes a row are wasted); 57 columns (9 past the
    vector) and a transposed A keep a partial vector, and so does a copy past DOT_COPY."""
    assert dot_columns(49, 4608, 16) == 1 and dot_columns(98, 256, 16) == 2
    assert dot_columns(196, 1152, 16) == 0   # 12 lanes empty of 208: as fast as a vector
    assert dot_columns(57, 100, 16) == 0 and dot_columns(49, 100, 16, trans_a=True) == 0
    assert dot_columns(48, 100, 16) == 0 and dot_columns(5, 100, 16) == 0
    assert dot_columns(49, DOT_COPY + 1, 16) == 0
    assert tile(512, 49, 4608, 16, 32, 1 << 20, in_place=True) == (8, 48)
    assert tile(512, 57, 512, 16, 32, 1 << 20, in_place=True) == (6, 64)


def test_no_tile_where_no_panel_fits_the_cache():
    assert tile(32, 64, 5000, 16, 32, 256 << 10) is None


def test_an_lstm_step_gets_whole_tiles_on_avx512():
    rows, cols = tile(32, 1024, 512, 16, 32, 512 << 10)
    assert 32 % rows == 0 and 1024 % cols == 0 and rows * cols // 16 >= 16


@pytest.mark.parametrize("n,k", [(1024, 512), (512, 2048)])
def test_packed_panels_get_the_tallest_tiles_that_keep_the_fma_pipes_busy(n, k):
    """A packed panel is read from L2 again for every block of rows: with AVX-512's 32
    registers an LSTM step's 32-row products (forward and input gradient) take the tallest
    tiles, with no padding. AVX2's 16 registers hold 8 rows of one vector only: 8
    accumulators, each waiting on the FMA before it, so tiles of 12 accumulators there."""
    rows, cols = tile(32, n, k, 16, 32, 512 << 10)
    assert rows == MAX_ROWS and n % cols == 0
    rows, cols = tile(32, n, k, 8, 16, 512 << 10)
    assert rows * cols // 8 == 12 and rows < MAX_ROWS


def test_busy_counts_the_fma_pipes_loads_and_latency():
    assert busy(4, 3, 8) == busy(6, 2, 8) == busy(8, 2, 16) == busy(8, 3, 16) == 1.0
    assert busy(8, 1, 8) == busy(4, 2, 8) == 4 / 6               # latency: 8 accumulators
    assert busy(1, 6, 16) == 3 / 12                                # L2: the panel's vectors
    assert busy(2, 1, 8) < busy(8, 1, 8)


def _lstm(level: int, threads: int, batch: int = 13, hidden: int = 150) -> Net:
    net = Net(batch, time_steps=3, opt_level=level, num_threads=threads, seed=5)
    x = MemoryDataLayer(net, "x", (9,))
    label = MemoryDataLayer(net, "label", (1,))
    h = LSTMLayer("lstm", net, x, hidden)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, h, 6), label)
    net.init()
    return net


def _tiled(net: Net) -> list[Gemm]:
    loops = [s for s in (*net.program.forward, *net.program.backward) if isinstance(s, TimeSteps)]
    return [g for loop in loops for s in loop.steps for k in s.kernels for g in walk(k.body)
            if isinstance(g, Gemm) and g.panel]


@pytest.mark.parametrize("threads", [1, 2])
def test_recurrent_products_read_weights_packed_before_the_loop(threads):
    base, opt = _lstm(0, 1), _lstm(3, threads)
    tiled = _tiled(opt)
    # forward and backward, and with 2 threads each thread's slice (a partial last one)
    assert len(tiled) >= (2 if threads == 1 else 4)
    assert any(g.n % g.panel[1] for g in tiled) and any(g.m % g.panel[0] for g in tiled)
    packs = {k.name for s in opt.program.forward + opt.program.backward if isinstance(s, Segment)
             for k in s.kernels if k.name.endswith("_pack")}
    assert packs == {"lstm.hh.forward_pack", "lstm.hh.backward_pack"}
    text = explain_program(opt.program)
    assert "tiled_gemm(" in text and "packed once before the loop, the step's GEMMs over them " \
        "tiled: lstm.hh (forward, backward)" in text
    for p, q in zip(base.params, opt.params, strict=True):
        q.value[...] = p.value
    for net in (base, opt):   # the same inputs for both
        rng = np.random.default_rng(0)
        net.value("x")[...] = rng.standard_normal(net.value("x").shape)
        net.value("label")[...] = rng.integers(0, 6, net.value("label").shape)
        net.forward()
        net.backward()
    assert_scaled_close(opt.value("lstm"), base.value("lstm"), 1e-5, "hidden values")
    assert_scaled_close(opt.grad("x"), base.grad("x"), 1e-5, "input gradient")
    for p, q in zip(base.params, opt.params):
        assert_scaled_close(q.grad, p.grad, 1e-5, f"gradient of {p.name}")


def test_latte_pack_0_keeps_blas(monkeypatch):
    monkeypatch.setenv("LATTE_PACK", "0")
    assert not _tiled(_lstm(3, 2))


def _fc(level: int, batch: int) -> Net:
    net = Net(batch, opt_level=level, num_threads=2, seed=6)
    x = MemoryDataLayer(net, "x", (70,))
    label = MemoryDataLayer(net, "label", (1,))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, x, 45), label)
    net.init()
    rng = np.random.default_rng(1)
    net.value("x")[...] = rng.standard_normal(net.value("x").shape)
    net.value("label")[...] = rng.integers(0, 45, net.value("label").shape)
    net.forward()
    net.backward()
    return net


def test_large_products_pack_their_weights_at_the_start_of_the_kernel():
    """An FC layer at batch 2200 (1100 rows a thread): forward (B read transposed) and
    input gradient both pack the weights, at the start of their kernels; at batch 128
    neither pays."""
    base, opt = _fc(0, 2200), _fc(3, 2200)
    plan = next(p for p in opt.program.plans if p.ensemble.name == "fc")
    for phase in ("forward", "backward"):
        first = plan.kernels[phase].body.stmts[0]
        assert any(isinstance(n, Ref) and n.buffer.key[0] == "derived" for n in walk(first))
        assert any(isinstance(g, Gemm) and g.panel for g in walk(plan.kernels[phase].body))
    assert_scaled_close(opt.value("fc"), base.value("fc"), 1e-5, "values")
    assert_scaled_close(opt.grad("x"), base.grad("x"), 1e-5, "input gradient")
    for p, q in zip(base.params, opt.params):
        assert_scaled_close(q.grad, p.grad, 1e-5, f"gradient of {p.name}")
    small = next(p for p in _fc(3, 128).program.plans if p.ensemble.name == "fc")
    assert not any(isinstance(g, Gemm) and g.panel and g.packed for k in small.kernels.values()
                   for g in walk(k))


def _conv(level: int) -> Net:
    from latte.stdlib import ConvolutionLayer, ReLULayer  # noqa: PLC0415

    net = Net(2, opt_level=level, num_threads=2, seed=2)
    x = MemoryDataLayer(net, "x", (3, 15, 13))
    label = MemoryDataLayer(net, "label", (1,))
    conv = ReLULayer("relu", net, ConvolutionLayer("conv", net, x, 10, 3, pad=1))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, conv, 4), label)
    net.init()
    rng = np.random.default_rng(4)
    net.value(x)[...] = rng.standard_normal(net.value(x).shape)
    net.value(label)[...] = rng.integers(0, 4, net.value(label).shape)
    return net


def test_window_tiles_are_multiplied_in_place_and_match_level_0(monkeypatch):
    """A convolution's GEMM over its gathered windows (A: 10 filters of 27 weights) runs the
    micro-kernel on the window tile as it lies, forward, on an AVX-512 host (made one here:
    wider vectors are correct anywhere) and with AVX2's 16 registers; with ``LATTE_PACK=0``
    BLAS runs it."""
    vector_registers(monkeypatch, 512, 32)
    base, opt = _conv(0), _conv(2)
    gemms = [g for p in opt.program.plans if p.ensemble.name == "conv"
             for g in walk(p.kernels["forward"].body) if isinstance(g, Gemm)]
    assert gemms and all(g.panel and not g.packed for g in gemms)
    for p, q in zip(base.params, opt.params, strict=True):
        q.value[...] = p.value
    for net in (base, opt):
        net.forward()
        net.backward()
    assert_scaled_close(opt.value("relu"), base.value("relu"), 1e-5, "relu")
    for p, q in zip(base.params, opt.params):
        assert_scaled_close(q.grad, p.grad, 1e-5, p.name)
    vector_registers(monkeypatch, 256, 16)
    avx2 = _conv(2)
    assert [g for p in avx2.program.plans for k in p.kernels.values()
            for g in walk(k.body) if isinstance(g, Gemm) and g.panel == (4, 24, 8)]
    monkeypatch.setenv("LATTE_PACK", "0")
    blas = _conv(2)
    assert not [g for p in blas.program.plans for k in p.kernels.values()
                for g in walk(k.body) if isinstance(g, Gemm) and g.panel]


def test_products_tiled_in_place_are_those_blas_would_pack_for_little_work(monkeypatch):
    """Hand-built GEMMs through ``tile_in_place`` (32 registers of 512 bits, a 1 MiB L2 and
    a 32 MiB shared cache): B read along its rows and an A that stays in cache get a tile,
    and so do two operands along a long ``k`` (dot products); a short transposed B, a
    matrix-vector product, an A over half the shared cache, and a
    transposed A walked over many rows and many steps of k stay with BLAS (with AVX2's 16
    registers too); a short transposed A is tiled where the micro-kernel
    beats BLAS on this machine (``LATTE_TRANSPOSED_A`` decides here, and ``LATTE_IN_PLACE``
    for the large products with A along its rows, timed on a real host)."""
    from latte.compiler.passes.pack import tile_in_place  # noqa: PLC0415

    monkeypatch.setenv("LATTE_TRANSPOSED_A", "1")
    monkeypatch.setenv("LATTE_IN_PLACE", "1")

    def gemm(m, n, k, trans_a=False, trans_b=False):
        a = Buffer(("A",), "A", (m * k,))
        b, c = Buffer(("B",), "B", (k * n,)), Buffer(("C",), "C", (m * n,))
        return Gemm(m, n, k, a, Affine(), m if trans_a else k, trans_a, b, Affine(),
                    k if trans_b else n, trans_b, c, Affine(), n)

    def tiled(g, registers=32):
        out = tile_in_place(Kernel("k", Block((g,))), (512 if registers == 32 else 256, registers),
                            1 << 20, 32 << 20)
        (h,) = out.body.stmts
        return bool(h.panel) and not h.packed

    assert tiled(gemm(64, 896, 27))                          # an RGB 3x3 window tile
    assert tiled(gemm(256, 28, 2304))                        # deep weights, a few pixels
    assert tiled(gemm(576, 784, 64, trans_a=True))           # an input gradient: 64 steps
    assert not tiled(gemm(1024, 512, 1568, trans_a=True))    # many rows and many steps
    assert not tiled(gemm(64, 896, 27, trans_b=True))        # 27 steps of k: BLAS
    assert tiled(gemm(64, 576, 448, trans_b=True))           # a weight gradient: dot products
    assert not tiled(gemm(64, 576, 448, trans_a=True, trans_b=True))
    assert not tiled(gemm(512, 4608, 3136, trans_b=True))    # neither operand fits the L2
    assert not tiled(gemm(1, 896, 27)) and not tiled(gemm(64, 1, 27))
    assert not tiled(gemm(2048, 64, 4096))                   # A: 32 MiB
    assert tiled(gemm(64, 896, 27), registers=16) and tiled(gemm(64, 576, 448, trans_b=True), 16)
    assert not tiled(gemm(1024, 512, 1568, trans_a=True), 16)
    monkeypatch.setenv("LATTE_TRANSPOSED_A", "0")
    assert not tiled(gemm(576, 784, 64, trans_a=True)) and tiled(gemm(64, 896, 27))


def test_transposed_a_in_place_is_measured_once_per_machine(monkeypatch, tmp_path):
    """Whether the micro-kernel reads A transposed is timed against BLAS once (a real trial
    gives a positive ratio), then read back from the cache in later processes."""
    import latte.compiler.passes.pack as pack  # noqa: PLC0415
    import latte.compiler.trials as trials  # noqa: PLC0415

    m, n, k = trials.TRANSPOSED_A_TRIAL
    assert 0 < trials.time_in_place([(m, n, k, m, n, n, True)], (512, 32), 1 << 20, runs=2)[0] < float("inf")
    monkeypatch.delenv("LATTE_TRANSPOSED_A", raising=False)
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(trials, "time_in_place", lambda *args: calls.append(args) or [1.25])
    trials.transposed_a_beats_blas.cache_clear()
    assert pack.transposed_a_in_place((512, 32), 1 << 20) and len(calls) == 1
    assert calls[0][0] == [(m, n, k, m, n, n, True)]
    trials.transposed_a_beats_blas.cache_clear()   # another process: the file answers
    assert pack.transposed_a_in_place((512, 32), 1 << 20) and len(calls) == 1
    assert len(list(tmp_path.glob("transposed-a-speedup-*.json"))) == 1
    trials.transposed_a_beats_blas.cache_clear()


def test_trials_time_products_on_aligned_operands(monkeypatch):
    """The trials hand BLAS and the micro-kernel operands that start on a 64-byte line, as a
    program's buffers do (numpy's own arrays start 16 bytes past one, where the
    micro-kernel's vectors split lines: it lost products to BLAS that it wins aligned),
    holding 0.5 where the product reads and zeros (untouched pages) between its rows."""
    import latte.compiler.trials as trials  # noqa: PLC0415

    def race(blas, tiled, budget, runs):
        pointers = [blas.args[i] for i in (7, 9, 12)]
        assert all(p % 64 == 0 for p in pointers), pointers
        n, k, ldb = blas.args[4], blas.args[5], blas.args[10]
        b = np.ctypeslib.as_array(ctypes.cast(pointers[1], ctypes.POINTER(ctypes.c_float)),
                                  (k * ldb,)).reshape(k, ldb)
        assert (b[:, :n] == 0.5).all() and (b[:, n:] == 0).all()
        tiled()
        return 1.5

    monkeypatch.setattr(trials, "_race", race)
    assert trials.time_in_place([(64, 200, 96, 96, 264, 200, False),
                                 (32, 100, 50, 50, 100, 100, True)], (512, 32), 1 << 20) == [1.5, 1.5]


def test_large_products_read_in_place_where_the_micro_kernel_wins_here(monkeypatch, tmp_path):
    """A product with A along its rows from MEASURED_FMAS multiply-adds is timed against BLAS
    once per shape and machine (a real trial gives a positive ratio) and tiled in place only
    where the micro-kernel won, a net's new shapes timed together before its kernels are
    tiled; a smaller one is tiled without a trial; the answer survives the process in the
    cache; ``LATTE_IN_PLACE`` decides without measuring."""
    import latte.compiler.passes.pack as pack  # noqa: PLC0415
    import latte.compiler.trials as trials  # noqa: PLC0415

    ratios = trials.time_in_place([(40, 96, 64, 80, 100, 96, False), (24, 50, 30, 30, 50, 60, True)],
                                 (512, 32), 1 << 20, runs=2)
    assert len(ratios) == 2 and all(0 < r < float("inf") for r in ratios)
    monkeypatch.delenv("LATTE_IN_PLACE", raising=False)
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    speedup = {(128, 512, 1024): 0.42, (512, 98, 512): 1.03}
    calls = []
    monkeypatch.setattr(trials, "time_in_place", lambda products, *args: calls.extend(products)
                        or [speedup[p[:3]] for p in products])

    def gemm(m, n, k):
        a, b, c = (Buffer((x,), x, (1 << 20,)) for x in "ABC")
        return Gemm(m, n, k, a, Affine(), k, False, b, Affine(), 1024, False, c, Affine(), n)

    def tiled(g):
        (h,) = pack.tile_in_place(Kernel("k", Block((g,))), (512, 32), 2 << 20, 32 << 20).body.stmts
        return bool(h.panel)

    trials.beats_blas.cache_clear()
    batches = []
    monkeypatch.setattr(trials, "time_in_place", lambda products, *args: batches.append(products)
                        or calls.extend(products) or [speedup[p[:3]] for p in products])
    kernel = Kernel("k", Block((gemm(128, 512, 1024), gemm(512, 98, 512), gemm(64, 896, 27))))
    pack.measure_in_place([kernel], (512, 32), 2 << 20, 32 << 20)   # a net's first compile
    assert batches == [[(128, 512, 1024, 1024, 1024, 512, False),
                        (512, 98, 512, 512, 1024, 98, False)]]
    assert not tiled(gemm(128, 512, 1024)) and tiled(gemm(512, 98, 512))
    assert tiled(gemm(64, 896, 27)) and len(calls) == 2   # 1.5M multiply-adds: no trial
    pack.measure_in_place([kernel], (512, 32), 2 << 20, 32 << 20)   # nothing new to time
    assert len(batches) == 1
    trials.beats_blas.cache_clear()   # another process: the files answer
    assert not tiled(gemm(128, 512, 1024)) and tiled(gemm(512, 98, 512)) and len(calls) == 2
    assert len(list(tmp_path.glob("in-place-speedup-*.json"))) == 2
    monkeypatch.setenv("LATTE_IN_PLACE", "1")
    assert tiled(gemm(128, 512, 1024))
    monkeypatch.setenv("LATTE_IN_PLACE", "0")
    assert not tiled(gemm(512, 98, 512)) and not tiled(gemm(64, 896, 27))
    trials.beats_blas.cache_clear()



def test_large_products_of_a_transposed_a_are_timed_by_their_shape(monkeypatch, tmp_path):
    """With A transposed too, a product from MEASURED_FMAS multiply-adds (an MLP's weight
    gradient, 1024 x 128 over the batch's 128) is timed by its shape and tiled where the
    micro-kernel won, whatever the transposed-A trial says; a smaller one follows that
    trial; ``LATTE_TRANSPOSED_A`` decides both without measuring."""
    import latte.compiler.passes.pack as pack  # noqa: PLC0415
    import latte.compiler.trials as trials  # noqa: PLC0415

    monkeypatch.delenv("LATTE_TRANSPOSED_A", raising=False)
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    timed = []
    monkeypatch.setattr(trials, "time_in_place", lambda products, *args: timed.extend(products)
                        or [2.0 if p[6] and p[:3] == (1024, 128, 128) else 0.5 for p in products])
    trials.beats_blas.cache_clear()
    trials.transposed_a_beats_blas.cache_clear()

    def tiled(m, n, k):
        a, b, c = (Buffer((x,), x, (1 << 20,)) for x in "ABC")
        g = Gemm(m, n, k, a, Affine(), 1024, True, b, Affine(), 1024, False, c, Affine(), 1024)
        (h,) = pack.tile_in_place(Kernel("k", Block((g,))), (512, 32), 2 << 20, 32 << 20).body.stmts
        return bool(h.panel)

    assert tiled(1024, 128, 128) and (1024, 128, 128, 1024, 1024, 1024, True) in timed
    assert not tiled(128, 64, 128)   # 1M multiply-adds: the transposed-A trial's 0.5
    assert timed[-1] == (*trials.TRANSPOSED_A_TRIAL, 1152, 196, 196, True)
    monkeypatch.setenv("LATTE_TRANSPOSED_A", "1")
    assert tiled(128, 64, 128) and tiled(512, 128, 128)
    monkeypatch.setenv("LATTE_TRANSPOSED_A", "0")
    assert not tiled(1024, 128, 128)
    trials.beats_blas.cache_clear()
    trials.transposed_a_beats_blas.cache_clear()


@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_explain_shows_what_the_trial_chose(monkeypatch, tmp_path, ratio):
    """An FC layer's input gradient (64 x 512 over 1024, B the weights in place) is timed
    against BLAS at its first compile; ``latte explain`` shows the ratio under the product,
    which runs on BLAS where the micro-kernel lost and tiled where it won."""
    import latte.compiler.trials as trials  # noqa: PLC0415
    from latte.compiler.explain import explain_program  # noqa: PLC0415

    vector_registers(monkeypatch, 512, 32)
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LATTE_IN_PLACE", raising=False)
    monkeypatch.setattr(trials, "time_in_place", lambda products, *args: [ratio] * len(products))
    trials.beats_blas.cache_clear()
    net = Net(64, num_threads=1, seed=0)
    x, label = MemoryDataLayer(net, "x", (512,)), MemoryDataLayer(net, "label", (1,))
    x.needs_grad = True
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, x, 1024), label)
    net.init()
    trials.beats_blas.cache_clear()
    (g,) = [g for p in net.program.plans for k in p.kernels.values() for g in walk(k.body)
            if isinstance(g, Gemm) and (g.m, g.n, g.k) == (64, 512, 1024)]
    assert bool(g.panel) == (ratio > 1)
    text = explain_program(net.program)
    assert f"ran it at {ratio:.2f}x BLAS's speed" in text
