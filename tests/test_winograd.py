"""Winograd F(2x2, 3x3) and F(4x4, 3x3) (latte/compiler/passes/winograd.py): which nests
they take, and that what they compute equals opt level 0 (the direct sums) on odd sizes,
padding, batches and threads, alone and inside fused groups."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import WeightedSumLoss

from latte import Ensemble, Net, Neuron, Param, Phase, add_connections
from latte.compiler.ir import Gemm, Loop, LoopKind, Ref, walk
from latte.compiler.passes import winograd
from latte.compiler.passes.tiling import is_batch_loop
from latte.compiler.passes.winograd import ITEM_TILES, MIN_TILES, _plane, match
from latte.stdlib import ConvolutionLayer, MaxPoolingLayer, MemoryDataLayer, ReLULayer


@pytest.fixture(params=["2", "4"], ids=["F2", "F4"])
def scheme(request, monkeypatch) -> int:
    """F(2x2, 3x3) or F(4x4, 3x3) wherever Winograd applies (``LATTE_WINOGRAD``): the
    output tile's side."""
    monkeypatch.setenv("LATTE_WINOGRAD", request.param)
    return int(request.param)


def _planes(net, phases=("forward", "backward", "test")) -> set[int]:
    """The transformed tiles' positions (16 or 36) of the Winograd products of ``phases``."""
    return {g.a_buf.shape[0] for p in net.program.plans for name, k in p.kernels.items()
            if name in phases for g in walk(k.body)
            if isinstance(g, Gemm) and g.a_buf.key[0] == "derived"}


def _uses_winograd(net, phases=("forward", "backward", "test")) -> bool:
    return bool(_planes(net, phases))


def _backward_buffers(net) -> set[str]:
    return {r.buffer.name for p in net.program.plans for r in walk(p.kernels["backward"].body)
            if isinstance(r, Ref)}


def _run(level: int, build, shape, batch: int, threads: int, seed: int = 0):
    net = Net(batch, opt_level=level, num_threads=threads, seed=1)
    x = MemoryDataLayer(net, "x", shape)
    x.needs_grad = True
    out = build(net, x)
    WeightedSumLoss(net, "loss", out)
    net.init()
    net.value(x)[...] = np.random.default_rng(seed).standard_normal((batch, *shape))
    net.forward()
    net.backward()
    test = net.predict(np.random.default_rng(seed + 1).standard_normal((batch, *shape)), out)
    return net, (net.value(out).copy(), net.grad(x).copy(), test,
                 *[p.grad.copy() for p in net.params])


def _close(got, want, tol=2e-5):
    for g, w in zip(got, want):
        scale = max(float(np.abs(w).max()), 1e-3)
        assert np.abs(g - w).max() <= tol * scale, (np.abs(g - w).max(), scale)


def _conv(n_filters, pad):
    return lambda net, x: ConvolutionLayer("conv", net, x, n_filters, 3, pad=pad)


def _conv_relu_pool(net, x):
    conv = ConvolutionLayer("conv", net, x, 12, 3, pad=1)
    return MaxPoolingLayer("pool", net, ReLULayer("relu", net, conv), 2)


@pytest.mark.parametrize("shape,batch,threads,build", [
    ((8, 16, 16), 1, 1, _conv(8, 1)),      # whole tiles
    ((9, 13, 17), 2, 2, _conv(10, 1)),     # odd rows and columns: partial tiles
    ((8, 15, 11), 3, 2, _conv(8, 0)),      # no padding
    ((16, 28, 28), 1, 2, _conv(16, 1)),    # one image on two threads (shared statements)
    ((8, 24, 24), 2, 2, _conv_relu_pool),  # fused with a ReLU and a pool
], ids=["whole", "odd", "unpadded", "one-image", "fused"])
@pytest.mark.parametrize("level", [2, 3])
def test_winograd_equals_level_0(level, shape, batch, threads, build, scheme):
    net, got = _run(level, build, shape, batch, threads)
    assert _planes(net) == {(scheme + 2) ** 2}
    _, want = _run(0, build, shape, batch, threads)
    _close(got, want)


@pytest.mark.parametrize("shape,planes", [
    ((64, 8, 128), 36),   # 32 4x4 tiles or more a row tile, 64 x 64 channels: F(4x4, 3x3)
    ((16, 8, 128), 16),   # 16 x 16 channels: too little work a product, F(2x2, 3x3)
    ((64, 12, 12), 16),   # 9 4x4 tiles: F(2x2, 3x3)
])
def test_where_four_by_four_tiles_pay(shape, planes):
    from latte.compiler.explain import explain_program

    channels = shape[0]
    net = Net(1, opt_level=2)
    x = MemoryDataLayer(net, "x", shape)
    ConvolutionLayer("conv", net, x, channels, 3, pad=1)
    net.init()
    assert _planes(net, ("forward",)) == {planes}
    side = math.isqrt(planes) - 2
    assert f"Winograd F({side}x{side}, 3x3): the 3x3 window as {planes} GEMMs" in \
        explain_program(net.program)


@pytest.mark.parametrize("batch,planes,width", [
    (4, 36, 16),    # 4 items of 16 4x4 tiles: the batch pays for F(4x4, 3x3)'s weights
    (1, 16, 49),    # one image: F(2x2, 3x3), 49 2x2 tiles a product
    (2, 16, 49),    # 32 4x4 tiles in the batch: too few
])
def test_a_batch_of_small_images_takes_four_by_four_tiles(batch, planes, width):
    """A 14x14 layer of 96 channels in one row tile has too few 4x4 tiles an image for
    F(4x4, 3x3) (16, not ``WIDE_TILES``), but a batch of 4 has ``ITEM_TILES``: its 36
    transformed weight planes are paid once per run over them (forward, the input
    gradient's gather and the test forward alike); equals level 0."""
    build = _conv(96, 1)
    net, got = _run(2, build, (96, 14, 14), batch, 1)
    assert _planes(net) == {planes}
    assert _widths(net, "forward") == _widths(net, "backward") == {width}
    _, want = _run(0, build, (96, 14, 14), batch, 1)
    _close(got, want)


@pytest.mark.parametrize("size", [1, 16, 17, 4096, 64 * 64, 512 * 512, 10 ** 6 + 3])
def test_transform_planes_lie_an_odd_number_of_lines_apart(size):
    """The 16 planes of U, V and M: aligned, at least ``size`` floats, an odd number of
    64-byte lines apart, so that no two of them share a cache set at the same index."""
    stride = _plane(size)
    assert stride >= size and stride % 16 == 0 and (stride // 16) % 2 == 1
    assert len({(e * stride * 4 // 64) % 64 for e in range(16)}) == 16


def test_winograd_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LATTE_WINOGRAD", "0")
    net, got = _run(3, _conv(8, 1), (8, 16, 16), 1, 1)
    assert not _uses_winograd(net)


class _PaddedWindow(Neuron):
    """A user's 3x3 window sum with weights, padded with 0.5: Winograd reads the padding."""

    weights: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.weights[i] * self.inputs[0][i]


def _user_window(net, x):
    w = np.random.default_rng(2).standard_normal((6, 8 * 9)).astype(np.float32)
    ens = Ensemble(net, "window", _PaddedWindow, (6, 12, 12), weights=(w, lambda o, y, x: o))
    add_connections(net, x, ens, lambda o, y, x: (range(0, 8), range(y - 1, y + 2),
                                                  range(x - 1, x + 2)), padding=0.5)
    return ens


def test_a_user_neuron_with_nonzero_padding(scheme):
    net, got = _run(3, _user_window, (8, 12, 12), 2, 2)
    assert _planes(net) == {(scheme + 2) ** 2}
    _, want = _run(0, _user_window, (8, 12, 12), 2, 2)
    _close(got, want)


@pytest.mark.parametrize("kwargs,channels,size", [
    ({"stride": 2, "pad": 1}, 8, 16),       # strided
    ({"dilation": 2, "pad": 2}, 8, 16),     # dilated
    ({"pad": 2}, 8, 16),                    # a 5x5 window below (kernel 5)
    ({"pad": 1}, 3, 32),                    # too few input channels to pay
    ({"pad": 1, "groups": 2}, 8, 16),       # grouped
    ({"pad": 1}, 8, 7),                     # 7x7 outputs of one item: too few tiles to pay
], ids=["stride", "dilation", "5x5", "3-channels", "groups", "7x7"])
def test_what_winograd_does_not_take(kwargs, channels, size):
    net = Net(1, opt_level=2)
    x = MemoryDataLayer(net, "x", (channels, size, size))
    kernel = 5 if kwargs.get("pad") == 2 and "dilation" not in kwargs else 3
    ConvolutionLayer("conv", net, x, 8, kernel, **kwargs)
    net.init()
    assert not _uses_winograd(net, ("forward",))
    nests = [s for p in net.program.plans for s in p.kernels["forward"].body.stmts
             if is_batch_loop(s)]
    assert not any(match(s) for s in nests)


def test_test_phase_and_explain_name_it():
    from latte.compiler.explain import explain_program

    net, _ = _run(3, _conv(8, 1), (8, 16, 16), 1, 1)
    assert "Winograd F(2x2, 3x3)" in explain_program(net.program)
    net.forward(Phase.TEST)   # the test program runs the same kernels


def _conv_relu_conv_pool(net, x):
    conv1 = ReLULayer("relu1", net, ConvolutionLayer("conv1", net, x, 16, 3, pad=1))
    conv2 = ConvolutionLayer("conv2", net, conv1, 16, 3, pad=1)
    return MaxPoolingLayer("pool", net, ReLULayer("relu2", net, conv2), 2)


@pytest.mark.parametrize("shape,batch,threads,build", [
    ((8, 16, 16), 1, 1, _conv(8, 1)),                # one convolution, its input's gradient
    ((9, 17, 13), 2, 2, _conv(12, 1)),               # odd rows and columns: partial tiles
    ((16, 48, 64), 2, 2, _conv_relu_conv_pool),      # at level 3 a fused group, 12 tiles
], ids=["one", "odd", "fused"])
@pytest.mark.parametrize("level", [2, 3])
def test_input_gradients_as_gathers_equal_level_0(level, shape, batch, threads, build, scheme):
    """A same-size 3x3 convolution's input gradient is a forward convolution of the output
    gradient with the flipped, transposed weights: Winograd computes it, no scatter-add. In
    the fused group conv2's gather reads the gradient relu1's tiles write one row past its
    own tile, and runs a tile behind (the skew grows from 1 to 2)."""
    net, got = _run(level, build, shape, batch, threads)
    if build is _conv_relu_conv_pool and level == 3:
        (group,) = net.program.groups
        tile = next(s for s in walk(group.owner("backward").kernels["backward"].body)
                    if isinstance(s, Loop) and s.kind is LoopKind.TILE_OUTER)
        assert dict(tile.meta)["skew"] == 2 and tile.extent == 14
    names = _backward_buffers(net)
    assert any("flipped" in n for n in names) and not any("scatter" in n for n in names)
    assert _planes(net, ("backward",)) == {(scheme + 2) ** 2}
    from latte.compiler.explain import explain_program

    assert "input gradient as a gather" in explain_program(net.program)
    _, want = _run(0, build, shape, batch, threads)
    _close(got, want)


def _widths(net, phase: str) -> set[int]:
    """The widths (``n``) of the Winograd products of ``phase``."""
    return {g.n for p in net.program.plans for g in walk(p.kernels[phase].body)
            if isinstance(g, Gemm) and g.a_buf.key[0] == "derived"}


@pytest.mark.parametrize("shape,batch,threads,build,items", [
    ((16, 8, 8), 8, 2, _conv(8, 1), 4),        # 16 tiles an item: 4 items a product
    ((8, 7, 7), 6, 2, _conv(8, 1), 6),         # 16 tiles (partial ones): 6, the fewest dividing 6
    ((16, 8, 8), 4, 2, _conv_relu_conv_pool, 4),   # two convs, ReLUs and a pool
    ((8, 6, 6), 3, 1, _conv(8, 1), 0),         # 9 tiles: 3 items have 27, too few to pay
], ids=["8x8", "7x7", "fused", "6x6"])
@pytest.mark.parametrize("level", [2, 3])
def test_small_images_share_products_across_items(level, shape, batch, threads, build, items,
                                                  scheme):
    """An item with too few 2x2 tiles for a product of its own shares one with the next
    items (forward, the input gradient's gather and the test forward); equals level 0.
    ``LATTE_WINOGRAD=4`` shares them alike, over 4x4 tiles."""
    net, got = _run(level, build, shape, batch, threads)
    tiles = -(-shape[1] // scheme) * -(-shape[2] // scheme)
    if items:
        assert _widths(net, "forward") == _widths(net, "backward") == {items * tiles}
    else:
        assert batch * tiles < MIN_TILES and not _uses_winograd(net)
    _, want = _run(0, build, shape, batch, threads)
    _close(got, want)


def _private_batched(net) -> set[str]:
    """The batched buffers (values, input gradients) the kernels keep one copy of per
    thread."""
    return {r.buffer.name for p in net.program.plans for k in p.kernels.values()
            for r in walk(k.body) if isinstance(r, Ref) and r.buffer.key[-1] == "private"
            and getattr(r.buffer.key[0], "batched", False)}


@pytest.mark.parametrize("shape,batch", [((16, 8, 8), 16), ((8, 7, 7), 12)],
                         ids=["whole-tiles", "partial-tiles"])
def test_blocks_of_items_run_in_parallel_on_their_own_outputs(shape, batch, scheme):
    """Blocks of items (item ``4 * block + i``) store only their own items' outputs and input
    gradients: the threads share the block loop, with no per-thread copy of the output or
    the input gradient to zero and sum after (only the weights' gradients have one); equals
    level 0."""
    net, got = _run(3, _conv(8, 1), shape, batch, 2)
    tiles = -(-shape[1] // scheme) * -(-shape[2] // scheme)
    assert _widths(net, "forward") == _widths(net, "backward") == {4 * tiles}
    for phase in ("forward", "backward"):
        kernel = next(p for p in net.program.plans if p.ensemble.name == "conv").kernels[phase]
        assert any(is_batch_loop(s) and s.kind is LoopKind.PARALLEL for s in kernel.body.stmts)
    assert not _private_batched(net)
    _, want = _run(0, _conv(8, 1), shape, batch, 2)
    _close(got, want)


def _spread_products(net, phase: str) -> dict[str, set[int]]:
    """Per transform (``winograd``: forward or gather, ``wgrad``), the sizes (``n`` or
    ``k``: the tiles) of ``phase``'s Winograd products that run in a parallel loop of their
    own over the planes, on buffers shared by the threads."""
    out: dict = {}
    for plan in net.program.plans:
        for s in plan.kernels[phase].body.stmts:
            gemms = [g for g in walk(s) if isinstance(g, Gemm)]
            if (isinstance(s, Loop) and s.kind is LoopKind.PARALLEL and not is_batch_loop(s)
                    and gemms and all(b.key[0] == "derived" for g in gemms
                                      for b in (g.a_buf, g.b_buf, g.c_buf))):
                for g in gemms:
                    kind = "wgrad" if ".wgrad" in g.c_buf.name else "winograd"
                    out.setdefault(kind, set()).add(g.k if kind == "wgrad" else g.n)
    return out


@pytest.mark.parametrize("channels,shape,batch,every,llc,forward,backward", [
    # F(4x4, 3x3) over blocks of 4 items, 5.3 MB of transformed weights: past half the
    # 8 MiB cache; the weight gradient's sums fewer than the batch's tiles stay per block
    (192, (192, 7, 7), 16, False, 8 << 20, {"winograd": {16 * 4}}, {"winograd": {16 * 4}}),
    # the same under a 480 MiB cache (an Intel Xeon's, shared by its socket's cores): the
    # blocks' 16 tiles are narrower than ITEM_TILES, so the products spread all the same
    (192, (192, 7, 7), 16, False, 480 << 20, {"winograd": {16 * 4}}, {"winograd": {16 * 4}}),
    # small, spread by the random tester's switch: F(2x2, 3x3), the weight gradient too
    (16, (16, 8, 8), 16, True, 8 << 20, {"winograd": {16 * 16}},
     {"winograd": {16 * 16}, "wgrad": {16 * 16}}),
], ids=["large-weights", "narrow-blocks", "every"])
def test_products_over_the_whole_batch(monkeypatch, channels, shape, batch, every, llc, forward,
                                       backward):
    """A deep layer's small images whose transformed weights outweigh the batch's
    transformed tiles and half the last-level cache, or whose blocks of items have fewer
    tiles than ``ITEM_TILES``: each product takes the whole batch's tiles once, the threads
    sharing the planes, instead of every block of items reading the weights again
    (forward, the input gradient's gather; a weight gradient: its sums made once over the
    batch instead of in each thread's own copy, zeroed and summed); equals level 0."""
    from latte.compiler import pipeline
    from latte.compiler.explain import explain_program

    sizes = {**pipeline.cache_sizes(), 3: llc}
    monkeypatch.setattr(pipeline, "cache_sizes", lambda: sizes)
    monkeypatch.setattr(winograd, "SPREAD_EVERY", every)
    monkeypatch.setenv("LATTE_STORED_PROGRAMS", "0")   # the key holds the host's caches
    build = _conv(channels, 1)
    net, got = _run(3, build, shape, batch, 2)
    assert _spread_products(net, "forward") == forward
    assert _spread_products(net, "backward") == backward
    private = {r.buffer.name for p in net.program.plans for k in p.kernels.values()
               for r in walk(k.body) if isinstance(r, Ref) and r.buffer.key[-1] == "private"}
    assert private <= {"conv.grad_bias.private"}   # the bias's sums alone, per thread
    assert "products over the whole batch's tiles" in explain_program(net.program)
    _, want = _run(0, build, shape, batch, 2)
    _close(got, want)


def test_small_weights_keep_products_per_block():
    """Where the transformed weights are small next to the batch's tiles (16 channels at
    8x8, batch 16), each block of items keeps its own products, in its thread."""
    net, _ = _run(3, _conv(16, 1), (16, 8, 8), 16, 2)
    assert _widths(net, "forward") == {4 * 16}
    assert not _spread_products(net, "forward") and not _spread_products(net, "backward")


def _conv_relu_conv(net, x):
    conv1 = ReLULayer("relu1", net, ConvolutionLayer("conv1", net, x, 8, 3, pad=1))
    return ConvolutionLayer("conv2", net, conv1, 8, 3, pad=1)


@pytest.mark.parametrize("shape,batch,threads,build,depth,group", [
    ((16, 8, 8), 8, 2, _conv(8, 1), 64, None),      # 16 tiles an item: sums over 4 items
    ((9, 13, 17), 6, 2, _conv(12, 1), 126, None),   # 63 partial tiles an item: 2 items
    # row tiles; at level 3 a skewed group
    ((16, 48, 64), 2, 2, _conv_relu_conv_pool, None, "conv1+relu1+conv2+relu2+pool"),
    # 32 tiles an item, 2 items a block; at level 3 a skewed group, the blocks' sums after
    # its tiles, their transform back after the sums
    ((9, 2, 64), 4, 2, _conv_relu_conv, 64, "conv1+relu1+conv2"),
], ids=["8x8", "odd", "fused", "fused-blocks"])
@pytest.mark.parametrize("level", [2, 3])
def test_weight_gradients_through_winograd(level, shape, batch, threads, build, depth, group):
    """F(3x3, 2x2): each thread sums the products of transformed output-gradient and source
    tiles over its items (and row tiles), and the weight gradient is their sum over the
    threads transformed back once; equals level 0."""
    from latte.compiler.explain import explain_program

    net, got = _run(level, build, shape, batch, threads)
    depths = {g.k for p in net.program.plans for g in walk(p.kernels["backward"].body)
              if isinstance(g, Gemm) and ".wgrad" in g.c_buf.name}
    if depth is None:   # a product per row tile of at least ITEM_TILES tiles
        assert depths and min(depths) >= ITEM_TILES
    else:
        assert depths == {depth}
    assert level == 2 or [g.name for g in net.program.groups] == ([group] if group else [])
    assert "F(3x3, 2x2) weight gradient" in explain_program(net.program)
    _, want = _run(0, build, shape, batch, threads)
    _close(got, want)


@pytest.mark.parametrize("kwargs,channels,size,off", [
    ({"pad": 1}, 8, 16, True),              # LATTE_GATHER_GRADS=0
    ({"stride": 2, "pad": 1}, 8, 16, False),
    ({"pad": 0}, 8, 16, False),             # the input is larger than the output
    ({"dilation": 2, "pad": 2}, 8, 16, False),
    ({"pad": 1}, 8, 4, False),              # 4x4: too few tiles, even two items' together
], ids=["off", "stride", "unpadded", "dilation", "4x4"])
def test_input_gradients_that_stay_scatters(monkeypatch, kwargs, channels, size, off):
    if off:
        monkeypatch.setenv("LATTE_GATHER_GRADS", "0")
    build = lambda net, x: ConvolutionLayer("conv", net, x, 8, 3, **kwargs)  # noqa: E731
    net, got = _run(2, build, (channels, size, size), 2, 2)
    names = _backward_buffers(net)
    assert not any("flipped" in n for n in names) and any("scatter" in n for n in names)
    assert not any("flipped" in b.name for b in net.program.buffers.buffers.values())
    _, want = _run(0, build, (channels, size, size), 2, 2)
    _close(got, want)
