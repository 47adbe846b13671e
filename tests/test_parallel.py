"""Data-copy, tiling, nest fusion and parallel loops (opt level 2): the same numbers as plain
loops, across thread counts, bitwise repeatable, and the IR the papers describe."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from helpers import WeightedSumLoss, check_gradients, fill

from latte import Net
from latte.compiler.codegen import ModuleBuilder
from latte.compiler.explain import explain_program
from latte.compiler.ir import (
    TID,
    Affine,
    Assign,
    AugAssign,
    Block,
    Buffer,
    Const,
    Gemm,
    Kernel,
    Loop,
    LoopKind,
    Ref,
    walk,
)
from latte.compiler.jit import target
from latte.compiler.passes.parallel import parallel, slicing
from latte.compiler.passes.tiling import MIN_TILE, balanced, busiest, heights
from latte.stdlib import (
    ConvolutionLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MeanPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
)

BATCH = 6


def _conv_net(opt_level: int, threads: int, deterministic: bool = False):
    net = Net(BATCH, opt_level=opt_level, num_threads=threads, seed=3, deterministic=deterministic)
    x = MemoryDataLayer(net, "x", (3, 18, 16))
    c1 = ConvolutionLayer("conv1", net, x, 16, 3, pad=1)
    r1 = ReLULayer("relu1", net, c1)
    p1 = MaxPoolingLayer("pool1", net, r1, 2)
    c2 = ConvolutionLayer("conv2", net, p1, 12, (3, 2), stride=2, pad=1)
    p2 = MeanPoolingLayer("pool2", net, c2, 2, stride=1)
    fc = FullyConnectedLayer("fc", net, p2, 10)
    WeightedSumLoss(net, "loss", fc)
    net.init()
    return net, x


def _run(opt_level: int, threads: int, deterministic: bool = False) -> list[np.ndarray]:
    net, x = _conv_net(opt_level, threads, deterministic)
    fill(net, x, np.random.default_rng(0))
    net.forward()
    net.backward()
    return [net.value("fc").copy(), net.grad(x).copy()] + [p.grad.copy() for p in net.params]


@pytest.fixture(scope="module")
def reference():
    return _run(0, 1)


@pytest.mark.parametrize("opt_level,threads", [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_optimized_matches_plain_loops(reference, opt_level, threads):
    for got, want in zip(_run(opt_level, threads), reference):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


def test_threads_default_to_the_cores_the_process_may_run_on():
    """Without ``num_threads`` a net runs one thread per core of its CPU affinity (``taskset``,
    a container's CPU set), not one per core of the machine."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        net, _ = _conv_net(2, None)
    finally:
        os.sched_setaffinity(0, cores)
    assert net.program.buffers.threads == 1


def test_one_and_two_threads_agree():
    for one, two in zip(_run(2, 1), _run(2, 2)):
        np.testing.assert_allclose(one, two, rtol=1e-4, atol=1e-5 * np.abs(one).max())


def _train(deterministic: bool) -> list[np.ndarray]:
    net, x = _conv_net(2, 2, deterministic)
    rng = np.random.default_rng(1)
    for _ in range(3):
        fill(net, x, rng)
        net.forward()
        net.backward()
        net.update(0.01, 0.9, 1e-3)
    return [p.value.copy() for p in net.params]


def test_deterministic_mode_is_bitwise_repeatable():
    first, second = _train(True), _train(True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_conv_gradients_at_opt_level_2():
    net = Net(BATCH, opt_level=2, num_threads=2, seed=4)   # smooth: no ReLU or max kinks
    x = MemoryDataLayer(net, "x", (2, 12, 10))
    c1 = ConvolutionLayer("conv1", net, x, 8, 3, stride=2, pad=1)
    p1 = MeanPoolingLayer("pool1", net, c1, 2, stride=1)
    c2 = ConvolutionLayer("conv2", net, p1, 6, 2)
    WeightedSumLoss(net, "loss", c2)
    net.init()
    fill(net, x, np.random.default_rng(2))
    check_gradients(net, [x], max_entries=8)


def _kernel(net, name: str, phase: str):
    return next(p.kernels[phase] for p in net.program.plans if p.ensemble.name == name)


def test_conv_becomes_gemms_over_gathered_tiles():
    net, _ = _conv_net(2, 2)
    for phase, count in (("forward", 1), ("backward", 2)):
        kernel = _kernel(net, "conv2", phase)
        gemms = [n for n in walk(kernel.body) if isinstance(n, Gemm)]
        assert len(gemms) == count
        outer = [n for n in walk(kernel.body) if isinstance(n, Loop) and n.kind is LoopKind.PARALLEL]
        assert outer and all(any(g is h for h in walk(outer[0])) for g in gemms[:1])
    fwd = _kernel(net, "conv1", "forward")
    (gemm,) = [n for n in walk(fwd.body) if isinstance(n, Gemm)]
    # the tile is gathered once for all 16 output channels: (threads, c, kh, kw, rows, width)
    tile = gemm.b_buf
    assert tile.shape[:4] == (2, 3, 3, 3) and tile.shape[5] == 16
    assert (gemm.m, gemm.k) == (16, 27) and gemm.n == tile.shape[4] * 16
    # the output zeroing folded into the GEMM (beta = 0), the bias add fused into its tile
    assert gemm.beta == 0.0
    assert not any(isinstance(s, Loop) and s.axis is None for s in fwd.body.stmts)


def test_tile_metadata_records_the_dependence_along_the_tiled_dimension():
    net, _ = _conv_net(2, 1)
    tiles = {p.ensemble.name: dict(n.meta) for p in net.program.plans
             for n in walk(p.kernels["forward"].body)
             if isinstance(n, Loop) and n.kind is LoopKind.TILE_OUTER}
    assert tiles["conv1"]["scale"] == 1 and tiles["conv1"]["halo"] == 2   # 3 rows, stride 1
    assert tiles["pool1"]["scale"] == 2 and tiles["pool1"]["halo"] == 0   # 2 rows, stride 2
    assert tiles["conv2"]["scale"] == 2 and tiles["conv2"]["halo"] == 1   # 3 rows, stride 2
    assert 18 % tiles["conv1"]["tile_size"] == 0


def test_tiles_are_the_smallest_wide_enough_for_a_gemm():
    """A row of the conv is 16 wide, so a tile needs 16 rows for MIN_TILE (256) elements per
    channel: of 18 or 24 rows, the smallest such divisor is the whole image; of 32, 16. With no
    divisor wide enough, the whole extent is the only candidate."""
    assert heights(12, lambda t: t * 64 >= MIN_TILE) == [4, 6, 12]
    assert heights(7, lambda t: False) == [7]
    for rows, want in ((18, 18), (24, 24), (32, 16)):
        net = Net(2, opt_level=2, seed=0)
        x = MemoryDataLayer(net, "x", (3, rows, 16))
        ConvolutionLayer("conv1", net, x, 8, 3, pad=1)
        net.init()
        (tile,) = [n for n in walk(net.program.plans[0].kernels["forward"].body)
                   if isinstance(n, Loop) and n.kind is LoopKind.TILE_OUTER]
        assert dict(tile.meta)["tile_size"] == want


def test_tile_heights_share_the_tiles_out_evenly_among_the_threads():
    """56 rows at batch 1 on 2 threads: 7 tiles of 8 rows leave the busier thread 4 tiles (32
    rows), 8 of 7 rows 28; at batch 16 every height gives each thread 448 rows, and the
    cache's choice stays. ``balanced`` moves off that choice only for fewer rows on the
    busiest thread: to the fewest, then to a height that fits, then to the smallest."""
    assert [busiest(1, 56, t, 2) for t in (8, 14, 28, 56, 7)] == [32, 28, 28, 56, 28]
    assert {busiest(16, 56, t, 2) for t in (8, 14, 28, 7)} == {448}
    busy = lambda t: busiest(1, 56, t, 2)  # noqa: E731
    order = [8, 14, 28, 56, 7]
    assert balanced(8, order, lambda t: t <= 14, busy) == 14     # fits
    assert balanced(8, order, lambda t: False, busy) == 7        # none fits: the smallest
    assert balanced(8, order, lambda t: True, lambda t: 0) == 8  # no better share
    assert balanced(8, order, lambda t: True, busy, lambda t: t > 14) == 28   # usable only
    assert balanced(None, order, lambda t: True, busy) is None


@pytest.mark.parametrize("relu", [False, True])
def test_a_lone_image_is_tiled_for_the_threads(relu):
    """A 5x5 convolution (no Winograd) of 30 rows 32 wide: its tiles need 8 rows for
    ``MIN_TILE`` elements a channel, and of the divisors of 30 the cache takes 10. At batch
    1 on 2 threads those are 3 tiles, 2 for one thread: tiles of 15 rows give each thread
    one. With batch 2, or one thread, it stays 10. Alone (``tile_loops``) or fused with a
    ReLU (the group's rows), and the outputs are level 0's."""
    def net_of(batch: int, threads: int, opt_level: int = 3):
        net = Net(batch, opt_level=opt_level, num_threads=threads, seed=0)
        x = MemoryDataLayer(net, "x", (4, 30, 32))
        top = ConvolutionLayer("conv", net, x, 8, 5, pad=2)
        if relu:
            top = ReLULayer("relu", net, top)
        net.init()
        net.value(x)[...] = np.random.default_rng(1).standard_normal(net.value(x).shape)
        net.forward()
        return net, top

    for batch, threads, want in ((1, 2, 15), (2, 2, 10), (1, 1, 10)):
        net, top = net_of(batch, threads)
        assert [g.rows for g in net.program.groups] == ([{net.ensemble("conv"): want,
                                                           net.ensemble("relu"): want}]
                                                        if relu else [])
        (tile,) = [n for n in walk(_kernel(net, "conv", "forward").body)
                   if isinstance(n, Loop) and n.kind is LoopKind.TILE_OUTER]
        assert dict(tile.meta)["tile_size"] == want
        assert not relu or (f"tile rows conv {want}, relu {want} ({30 // want} tiles an item)"
                            in explain_program(net.program))
        plain, _ = net_of(batch, 1, opt_level=0)
        np.testing.assert_allclose(net.value(top), plain.value(top.name),
                                   rtol=1e-4, atol=1e-5)


def test_weight_gradients_accumulate_in_private_buffers():
    net, _ = _conv_net(2, 2)
    bwd = _kernel(net, "conv1", "backward")
    names = {b.name for n in walk(bwd.body) if isinstance(n, Gemm) for b in (n.c_buf,)}
    assert "conv1.grad_weights.private" in names


def _counted(n: int, per_thread: bool, calls: int) -> tuple[np.ndarray, str]:
    """``for i in range(n): count[i] += 1`` (``count[_tid, i]`` with ``per_thread``) as a
    parallel loop of two threads, run ``calls`` times: the counts and the module's IR."""
    shape = (2, n) if per_thread else (n,)
    count = Buffer(("count",), "count", shape)
    index = (Affine.of(TID), Affine.of("i")) if per_thread else (Affine.of("i"),)
    body = Block((AugAssign(Ref(count, index, shape), "+", Const(1.0)),))
    mb = ModuleBuilder({count: 0}, threads=2)
    mb.add_segment("seg", [Kernel("count", Block((parallel(Loop("i", 0, n, body), 1),)))])
    lib = target().compile(str(mb.module))
    out = np.zeros(shape, np.float32)
    table = (ctypes.c_void_p * 1)(out.ctypes.data)
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lib.address("seg"))
    for _ in range(calls):
        run(ctypes.addressof(table))
    return out, str(mb.module)


def test_loops_storing_zeros_to_consecutive_elements_become_memsets():
    """A loop storing 0.0 to consecutive elements (a gradient's zeroing, a sum's start)
    is one ``memset`` (in a parallel loop, one per thread's chunk), from the element its
    first iteration stores; a strided one, or one storing -0.0, stays a loop."""
    rows, row = Buffer(("rows",), "rows", (3, 40)), Buffer(("flat",), "flat", (120,))
    strided, signed = Buffer(("strided",), "strided", (20,)), Buffer(("signed",), "signed", (4,))

    def store(buf, offset, value=0.0):
        return Block((Assign(Ref(buf, (offset,), (buf.size,)), Const(value)),))

    body = Block((
        Loop("r", 0, 3, Block((Loop("j", 5, 37, store(rows, Affine.build({"r": 40, "j": 1}, 0))),))),
        parallel(Loop("i", 0, 100, store(row, Affine.build({"i": 1}, 7))), 1),
        Loop("s", 0, 10, store(strided, Affine.build({"s": 2}, 0))),
        Loop("z", 0, 4, store(signed, Affine.of("z"), -0.0))))
    bufs = (rows, row, strided, signed)
    mb = ModuleBuilder({b: i for i, b in enumerate(bufs)}, threads=2)
    mb.add_segment("seg", [Kernel("zeros", body)])
    code = str(mb.module)
    assert code.count("call void @\"llvm.memset.p0i8.i64\"") == 2
    lib = target().compile(code)
    out = [np.ones(b.shape, np.float32) for b in bufs]
    table = (ctypes.c_void_p * 4)(*(x.ctypes.data for x in out))
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lib.address("seg"))(ctypes.addressof(table))
    want = [np.ones(b.shape, np.float32) for b in bufs]
    want[0][:, 5:37] = want[1][7:107] = want[2][::2] = 0.0
    want[3][:] = -0.0
    for got, expected in zip(out, want):
        np.testing.assert_array_equal(got, expected)
    assert np.signbit(out[3]).all()


def test_threads_steal_iterations_each_runs_once():
    """A parallel loop of a few iterations per thread is shared by stealing (each thread
    takes its chunk's iterations from an atomic counter, then what the others left): every
    iteration still runs exactly once per call, whichever thread takes it."""
    counts, code = _counted(13, False, 400)
    assert "atomicrmw add" in code
    np.testing.assert_array_equal(counts, np.full(13, 400.0))


def test_loops_over_per_thread_buffers_keep_their_static_chunks():
    """A loop indexing per-thread buffers by the thread number (private gradients, whose
    reduction in thread order keeps results independent of timing) is never stolen from:
    thread t runs iterations [t n / 2, (t + 1) n / 2) of every call."""
    counts, code = _counted(13, True, 50)
    assert "atomicrmw" not in code
    want = np.zeros((2, 13), np.float32)
    want[0, :6], want[1, 6:] = 50, 50
    np.testing.assert_array_equal(counts, want)


def test_gemm_slices_cover_the_product_and_keep_the_threads_even():
    """A GEMM split across threads: pieces of whole 16-float vectors (past 16) that cover
    its rows or columns once, whose largest-first share per thread is within a vector of an
    even split (784 columns: 400 and 384, not seven pieces of 112, four on one thread), and
    one piece per thread where each piece would stream an operand larger than half the L2."""
    l2 = 1 << 20
    for size in range(64, 5000, 37):
        for threads in (2, 3, 4):
            for shared in (0, l2):
                chunk, pieces = slicing(size, threads, shared, l2)
                assert chunk * (pieces - 1) < size <= chunk * pieces
                assert chunk <= 16 or chunk % 16 == 0
                loads = [0] * threads
                for piece in sorted([chunk] * (pieces - 1) + [size - chunk * (pieces - 1)])[::-1]:
                    loads[loads.index(min(loads))] += piece
                assert max(loads) <= -(-size // threads) + 15, (size, threads, chunk, pieces)
                if shared:
                    assert pieces <= threads
    assert slicing(784, 2, 256 << 10, l2) == (400, 2)
    assert slicing(3136, 2, 64 << 10, l2) == (784, 4)   # as even, more pieces to steal
