"""Cross-layer fusion (opt level 3): fused nets compute what plain loops (opt level 0)
compute, forward and backward, and the chains that should fuse do, with scaled tiles.

The example nets are rebuilt here at a small batch (LeNet with fewer units, the VGG layers
on 64x64 instead of 224x224 images): the example scripts build and train their nets at
module level, with no knobs for batch or image size. A guard checks that each rebuilt chain
still has the example's layers, in order. Small images fit one tile of the machine's cache
budget, so some tests tell the compiler a smaller L2 (``_set_l2``) to get several tiles.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
from helpers import WeightedSumLoss, fill, fill_labels

import latte.compiler.pipeline
from latte import Net, Phase
from latte.compiler import machine
from latte.compiler.explain import explain_program
from latte.compiler.ir import Block, Loop, LoopKind, accesses, walk
from latte.compiler.passes.tiling import MIN_TILE
from latte.lang import NormalizationEnsemble
from latte.stdlib import (
    ConvolutionLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MeanPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
    TanhLayer,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# ---------------------------------------------------------------- running and comparing
def _run(build, opt_level: int, threads: int, seed: int = 0) -> tuple[Net, dict[str, np.ndarray]]:
    """Build ``net, inputs = build(Net(...))``, feed seeded inputs, run a test forward (the
    loss and the values the loss layers read), then forward and backward: the values of
    every ensemble, the loss, the input gradients and every parameter gradient."""
    net = Net(build.batch, opt_level=opt_level, num_threads=threads, seed=seed)
    x, label = build(net)
    net.init()
    rng = np.random.default_rng(seed + 1)
    fill(net, x, rng)
    if label is not None:
        fill_labels(net, label, build.classes, rng)
    net.forward(Phase.TEST)
    out = {"test:loss": np.array(net.loss)}
    out |= {f"test:{i.name}": net.value(i).copy() for e in net.ensembles
            if isinstance(e, NormalizationEnsemble) for i in e.inputs}
    net.forward()
    out |= {f"value:{e.name}": net.value(e).copy() for e in net.ensembles if e is not label}
    out["loss"] = np.array(net.loss)
    net.backward()
    out[f"grad:{x.name}"] = net.grad(x).copy()
    out |= {f"grad:{p.name}": p.grad.copy() for p in net.params}
    return net, out


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for key, ref in want.items():
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        np.testing.assert_allclose(got[key], ref, rtol=2e-4, atol=2e-5 * scale + 1e-6,
                                   err_msg=f"{what}: {key}")


def _fused_kernels(net) -> list[str]:
    return [k.name for p in net.program.plans for k in p.kernels.values()
            if "+" in k.name and k.body.stmts]


def _compare(build, threads: int = 1, seed: int = 0, what: str = "") -> Net:
    _, want = _run(build, 0, 1, seed)
    net, got = _run(build, 3, threads, seed)
    _assert_same(got, want, what or build.__name__)
    return net


def _net(batch: int, classes: int | None = None):
    """Decorator: a builder with its batch size (and label classes, for a softmax loss)."""
    def wrap(fn):
        fn.batch, fn.classes = batch, classes
        return fn
    return wrap


# ---------------------------------------------------------------- the example nets
def _computing_layers(source: str) -> list[str]:
    """The layer constructors ``source`` calls, in source order, but data and accuracy
    layers (the rebuilt nets feed memory data and compute no accuracy)."""
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id.endswith("Layer")]
    names = [n.func.id for n in sorted(calls, key=lambda n: (n.lineno, n.col_offset))]
    return [n for n in names if not n.endswith("DataLayer") and n != "AccuracyLayer"]


@_net(batch=4, classes=10)
def digits_mlp(net):
    x = MemoryDataLayer(net, "data", (1, 8, 8))
    label = MemoryDataLayer(net, "label", (1,))
    ip1 = FullyConnectedLayer("ip1", net, x, 64)
    r1 = ReLULayer("relu1", net, ip1)
    ip2 = FullyConnectedLayer("ip2", net, r1, 10)
    SoftmaxLossLayer("loss", net, ip2, label)
    return x, label


@_net(batch=3, classes=10)
def lenet(net):
    # 8, 12 and 64 units instead of 20, 50 and 500: LLVM needs seconds for the opt-0 loops
    x = MemoryDataLayer(net, "data", (1, 28, 28))
    label = MemoryDataLayer(net, "label", (1,))
    conv1 = ConvolutionLayer("conv1", net, x, 8, 5)
    pool1 = MaxPoolingLayer("pool1", net, conv1, 2)
    conv2 = ConvolutionLayer("conv2", net, pool1, 12, 5)
    pool2 = MaxPoolingLayer("pool2", net, conv2, 2)
    ip1 = FullyConnectedLayer("ip1", net, pool2, 64)
    relu1 = ReLULayer("relu1", net, ip1)
    ip2 = FullyConnectedLayer("ip2", net, relu1, 10)
    SoftmaxLossLayer("loss", net, ip2, label)
    return x, label


@_net(batch=2, classes=10)
def vgg_micro(net):
    x = MemoryDataLayer(net, "data", (3, 64, 64))   # 224x224 in the example
    label = MemoryDataLayer(net, "label", (1,))
    conv1 = ConvolutionLayer("conv1_1", net, x, 64, 3, pad=1)
    relu1 = ReLULayer("relu1_1", net, conv1)
    pool1 = MaxPoolingLayer("pool1", net, relu1, 2)
    fc = FullyConnectedLayer("fc", net, pool1, 10)
    SoftmaxLossLayer("loss", net, fc, label)
    return x, label


EXAMPLE_NETS = {
    # example file: (builder, fused kernels expected at opt 3)
    "digits_mlp.py": (digits_mlp, set()),
    "lenet.py": (lenet, {"conv1+pool1.forward", "conv1+pool1.backward", "conv2+pool2.forward",
                         "conv2+pool2.backward"}),
    "vgg_micro.py": (vgg_micro, {"conv1_1+relu1_1+pool1.forward", "conv1_1+relu1_1+pool1.backward"}),
}


@pytest.mark.parametrize("example", sorted(EXAMPLE_NETS))
def test_example_nets_fused_equal_unfused(example):
    build, fused = EXAMPLE_NETS[example]
    # the rebuilt chain is the example's
    assert _computing_layers(inspect.getsource(build)) == _computing_layers(
        (EXAMPLES / example).read_text())
    net = _compare(build, threads=2, what=example)
    assert set(_fused_kernels(net)) == fused


# ---------------------------------------------------------------- random chains
def _out(n: int, k: int, s: int, p: int) -> int:
    return (n + 2 * p - k) // s + 1


def _random_chain(seed: int):
    """A seeded random chain of conv / ReLU / max-pool / mean-pool layers (valid shapes
    only), sometimes closed by fully connected layers, under a WeightedSumLoss."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 4))
    # even heights more often than not: 2x2 stride-2 pools then cover every row, and fuse
    height = int(2 * rng.integers(3, 11) if rng.random() < 0.6 else rng.integers(6, 21))
    shape = (int(rng.integers(1, 9)), height, int(rng.integers(6, 21)))
    plan, c, h, w = [], *shape
    prev = "data"
    for _ in range(int(rng.integers(2, 5))):
        kinds = ["conv", "maxpool", "meanpool"] + (["relu"] if prev not in ("data", "relu") else [])
        kind = str(rng.choice(kinds))
        if kind == "relu":
            plan.append(("relu",))
            prev = kind
            continue
        if kind != "conv" and rng.random() < 0.5:   # the classic 2x2 stride-2 pool
            k, s, p = 2, 2, 0
        else:
            k, s, p = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(0, 2))
            if kind != "conv":
                p = min(p, k - 1)   # a pooling window never lies wholly in the padding
        if min(_out(h, k, s, p), _out(w, k, s, p)) < 1:
            continue
        h, w = _out(h, k, s, p), _out(w, k, s, p)
        if kind == "conv":
            c = int(rng.integers(1, 9))
            plan.append(("conv", c, k, s, p))
        else:
            plan.append((kind, k, s, p))
        prev = kind
    if rng.random() < 0.25:
        plan.append(("fc", int(rng.integers(1, 9))))
        if rng.random() < 0.5:
            plan += [("relu",), ("fc", int(rng.integers(1, 5)))]

    @_net(batch=batch)
    def chain(net):
        x = MemoryDataLayer(net, "x", shape)
        ens = x
        for i, layer in enumerate(plan):
            name = f"{layer[0]}{i}"
            if layer[0] == "conv":
                ens = ConvolutionLayer(name, net, ens, layer[1], layer[2], stride=layer[3],
                                       pad=layer[4])
            elif layer[0] == "relu":
                ens = ReLULayer(name, net, ens)
            elif layer[0] == "maxpool":
                ens = MaxPoolingLayer(name, net, ens, layer[1], stride=layer[2], pad=layer[3])
            elif layer[0] == "meanpool":
                ens = MeanPoolingLayer(name, net, ens, layer[1], stride=layer[2], pad=layer[3])
            else:
                ens = FullyConnectedLayer(name, net, ens, layer[1])
        WeightedSumLoss(net, "loss", ens, seed=seed)
        return x, None

    chain.__name__ = f"chain{seed}: x{shape} " + " ".join(map(str, plan))
    return chain


N_CHAINS = 30
# L2 sizes the compiler is told (the tile budget): small images need a small
# cache to be cut into several tiles; None keeps the machine's
L2_SIZES = (None, 32 << 10, 8 << 10)


def _set_l2(monkeypatch, size: int | None) -> None:
    if size is not None:
        sizes = {**machine.cache_sizes(), 2: size}
        monkeypatch.setattr(latte.compiler.pipeline, "cache_sizes", lambda: sizes)
        monkeypatch.setenv("LATTE_STORED_PROGRAMS", "0")   # a patched machine: compile


@pytest.fixture(scope="module")
def fused_chains() -> dict[int, str | None]:
    """Per random chain run so far, its name if opt level 3 fused something in it."""
    return {}


@pytest.mark.parametrize("seed", range(N_CHAINS))
def test_random_chains_fused_equal_unfused(seed, fused_chains, monkeypatch):
    _set_l2(monkeypatch, L2_SIZES[seed % len(L2_SIZES)])
    build = _random_chain(seed)
    net = _compare(build, threads=1 + seed % 2, seed=seed)
    fused_chains[seed] = build.__name__ if _fused_kernels(net) else None


def test_random_chains_exercise_fusion(fused_chains):
    """Runs after the chains: a fair share of them must have fused (else the test above
    compares unfused code with itself)."""
    if len(fused_chains) < N_CHAINS:
        pytest.skip("needs every random chain to have run first")
    fused = [name for name in fused_chains.values() if name]
    assert len(fused) >= N_CHAINS // 4, fused


# ---------------------------------------------------------------- what fuses, and how
SMALL_L2 = 64 << 10   # a 64 KiB tile budget cuts a 32x32 image into several tiles


def _pooled_conv(opt_level: int, threads: int = 1, mean: bool = False):
    """conv 3->8 3x3 pad 1, ReLU, max-pool 2 (and mean-pool 2) on 32x32 images."""
    net = Net(2, opt_level=opt_level, num_threads=threads, seed=0)
    x = MemoryDataLayer(net, "x", (3, 32, 32))
    conv = ConvolutionLayer("conv", net, x, 8, 3, pad=1)
    relu = ReLULayer("relu", net, conv)
    pool = MaxPoolingLayer("pool", net, relu, 2)          # 8 x 16 x 16
    if mean:
        MeanPoolingLayer("mean", net, pool, 2)            # 8 x 8 x 8
    net.init()
    return net


def _live(net) -> dict:
    return {k.name: k for p in net.program.plans for k in p.kernels.values() if k.body.stmts}


def _loops(kernel, kind: LoopKind) -> list[Loop]:
    return [n for n in walk(kernel.body) if isinstance(n, Loop) and n.kind is kind]


def _tiles(kernel) -> dict[str, tuple[int, int]]:
    """Per ensemble, (tile rows, tiles) of the kernel's tile loops, which all run the same
    number of tiles."""
    out = {t.axis.ensemble_name: (dict(t.meta)["tile_size"], t.extent)
           for t in _loops(kernel, LoopKind.TILE_OUTER)}
    counts = {t.extent for t in _loops(kernel, LoopKind.TILE_OUTER)}
    assert len(counts) == 1, f"{kernel.name}: tile loops of different lengths {counts}"
    return out


def _inner_rows(kernel) -> dict[str, int]:
    """Per ensemble, the rows of one tile (extent of its tile-inner loops; a loop split
    around padding tests is consecutive loops over the same variable: their extents add)."""
    rows: dict[str, set[int]] = {}
    for block in (n for n in walk(kernel.body) if isinstance(n, Block)):
        runs: list[list[Loop]] = []
        for s in block.stmts:
            inner = isinstance(s, Loop) and s.kind is LoopKind.TILE_INNER
            if inner and runs and runs[-1][-1].var == s.var and runs[-1][-1].stop == s.start:
                runs[-1].append(s)
            elif inner:
                runs.append([s])
        for run in runs:
            rows.setdefault(run[0].axis.ensemble_name, set()).add(sum(lp.extent for lp in run))
    assert all(len(r) == 1 for r in rows.values()), rows
    return {name: r.pop() for name, r in rows.items()}


def test_conv_relu_pool_fuses_with_tiles_scaled_by_the_pool_stride(monkeypatch):
    _set_l2(monkeypatch, SMALL_L2)
    monkeypatch.setenv("LATTE_COALESCE", "0")   # keeps each tile's rows a loop of their own
    net = _pooled_conv(3, threads=2)
    live = _live(net)
    assert set(live) == {"conv+relu+pool.forward", "conv+relu+pool.backward"}
    steps = [k.name for s in net.program.forward if hasattr(s, "kernels") for k in s.kernels]
    assert steps == ["conv+relu+pool.forward"]

    # forward: several tiles; a tile of the conv and ReLU is two pooled rows per pooled row
    fwd = live["conv+relu+pool.forward"]
    tiles = _tiles(fwd)
    rows, count = tiles["conv"]
    assert count > 1 and rows * count == 32
    # the ReLU runs in the conv's point-wise nest (fuse.merge_pointwise: one pass a tile)
    assert _inner_rows(fwd) == {"conv": rows, "pool": rows // 2}
    # backward: the same tiles, the pool's tile loop records half the conv's rows
    bwd = live["conv+relu+pool.backward"]
    assert _tiles(bwd)["pool"] == (rows // 2, count)
    assert _inner_rows(bwd) == {"conv": rows, "relu": rows, "pool": rows // 2}

    # unfused (opt level 2) with the same cache: a kernel per layer, and the pool tiles alone
    plain = _live(_pooled_conv(2, threads=2))
    assert not any("+" in name for name in plain)
    assert "pool.forward" in plain and "conv.forward" in plain


def test_tiles_scale_by_the_product_of_the_strides(monkeypatch):
    """conv -> ReLU -> max-pool 2 -> mean-pool 2: a conv tile is four rows per mean row."""
    _set_l2(monkeypatch, SMALL_L2)
    monkeypatch.setenv("LATTE_COALESCE", "0")   # keeps each tile's rows a loop of their own
    net = _pooled_conv(3, mean=True)
    assert set(_live(net)) == {"conv+relu+pool+mean.forward", "conv+relu+pool+mean.backward"}
    for kernel in _live(net).values():
        tiles = _tiles(kernel)
        count = next(iter(tiles.values()))[1]
        rows = _inner_rows(kernel)
        assert count > 1 and rows["mean"] * count == 8
        # the forward's ReLU runs in the conv's point-wise nest: no tile-inner loop of its own
        assert rows.get("relu", 4 * rows["mean"]) == 4 * rows["mean"]
        assert ("relu" in rows) == kernel.name.endswith("backward")
        assert {k: v for k, v in rows.items() if k != "relu"} == {
            "conv": 4 * rows["mean"], "pool": 2 * rows["mean"], "mean": rows["mean"]}
        # backward: the conv's input gradient, a gather tiled over the rows of x (the
        # conv's size), after the fused tiles (it reads the conv's gradient one row ahead)
        assert ("x" in tiles) == kernel.name.endswith("backward")
        for name, (size, _) in tiles.items():
            assert size == rows["conv" if name == "x" else name]


def test_a_conv_after_a_pool_gets_tiles_wide_enough_for_its_products():
    """conv (64 wide) -> ReLU -> max-pool 2 -> conv (32 wide) -> ReLU: the second conv's tile
    needs 8 rows for MIN_TILE (256) elements per channel, so the first conv's is 16 (4 would
    do for the first alone, and gave the second conv's products 64 columns); fused equals
    plain loops."""

    @_net(batch=2)
    def pooled_pair(net):
        x = MemoryDataLayer(net, "x", (3, 64, 64))
        r1 = ReLULayer("relu1", net, ConvolutionLayer("conv1", net, x, 8, 3, pad=1))
        pool = MaxPoolingLayer("pool", net, r1, 2)
        r2 = ReLULayer("relu2", net, ConvolutionLayer("conv2", net, pool, 8, 3, pad=1))
        WeightedSumLoss(net, "loss", r2)
        return x, None

    net = _compare(pooled_pair)
    (group,) = net.program.groups
    rows = {e.name: r for e, r in group.rows.items()}
    assert rows["conv2"] * 32 == MIN_TILE and rows["conv1"] == rows["pool"] * 2 == 16


def test_fused_tiles_compute_what_unfused_code_computes(monkeypatch):
    """The several-tile groups above, forward and backward, against plain loops."""
    _set_l2(monkeypatch, SMALL_L2)

    @_net(batch=2)
    def block(net):
        x = MemoryDataLayer(net, "x", (3, 32, 32))
        conv = ConvolutionLayer("conv", net, x, 8, 3, pad=1)
        relu = ReLULayer("relu", net, conv)
        pool = MaxPoolingLayer("pool", net, relu, 2)
        mean = MeanPoolingLayer("mean", net, pool, 2)
        WeightedSumLoss(net, "loss", mean)
        return x, None

    net = _compare(block, threads=2)
    assert _fused_kernels(net) == ["conv+relu+pool+mean.forward", "conv+relu+pool+mean.backward"]
    _assert_line_buffers(net, ["conv"], shift=[])   # the mean's own nest reads the pool


def _assert_line_buffers(net, inner: list[str], shift: list[str]) -> None:
    """The test forward of the net's one fused group keeps the values of ``inner`` in
    per-thread line buffers of a few rows (rows carried to the next tile move down at the
    end of each tile for ``shift``), and stores no arg-max; the training forward keeps
    every value."""
    (group,) = net.program.groups
    (train,) = [k for s in net.program.forward if hasattr(s, "kernels") for k in s.kernels
                if k.name == f"{group.name}.forward"]
    (test,) = [k for s in net.program.test if hasattr(s, "kernels") for k in s.kernels
               if k.name == f"{group.name}.forward"]
    touched = {a.buffer.name: a.buffer for a in accesses(test.body)}
    for name in inner:
        assert f"{name}.value" in {a.buffer.name for a in accesses(train.body)}
        assert f"{name}.value" not in touched
        lines = touched[f"{name}.value.lines"]
        ens = next(p.ensemble for p in group.plans if p.ensemble.name == name)
        assert lines.shape[0] == net.num_threads and lines.shape[1] == ens.shape[0]
        assert group.rows[ens] <= lines.shape[2] < ens.shape[1]
        assert lines.shape[3:] == ens.shape[2:]
    assert "pool.argmax" not in {a.buffer.name for a in accesses(test.body) if a.written}
    moves = [s for t in _loops(test, LoopKind.TILE_OUTER) for s in t.body.stmts
             if isinstance(s, Loop) and s.var.startswith("_ln")]
    assert sorted(a.buffer.name for m in moves for a in accesses(m) if a.written) == sorted(
        f"{name}.value.lines" for name in shift)


def test_conv_after_conv_fuses_with_a_skewed_schedule(monkeypatch):
    """A VGG block (conv, ReLU, conv, ReLU, pool): the second conv reads a halo of the
    first's rows, so it runs one tile behind (one ahead in backward); forward and backward
    equal plain loops with several tiles and two threads."""
    _set_l2(monkeypatch, SMALL_L2)

    @_net(batch=2)
    def vgg_block(net):
        x = MemoryDataLayer(net, "x", (3, 32, 32))
        c1 = ConvolutionLayer("conv1", net, x, 8, 3, pad=1)
        r1 = ReLULayer("relu1", net, c1)
        c2 = ConvolutionLayer("conv2", net, r1, 8, 3, pad=1)
        r2 = ReLULayer("relu2", net, c2)
        pool = MaxPoolingLayer("pool", net, r2, 2)
        WeightedSumLoss(net, "loss", pool)
        return x, None

    net = _compare(vgg_block, threads=2)
    name = "conv1+relu1+conv2+relu2+pool"
    assert _fused_kernels(net) == [f"{name}.forward", f"{name}.backward"]
    _assert_line_buffers(net, ["conv1", "conv2"], shift=["conv1"])
    text = explain_program(net.program)
    assert "pool.argmax: recomputed in backward (estimated off-chip bytes: keep " in text
    assert "    pool.argmax: 8 x " in text and ", training backward" in text
    assert "    conv1.value: 8 x " in text and ", test forward" in text
    for kernel in _live(net).values():
        (tile,) = _loops(kernel, LoopKind.TILE_OUTER)
        # backward: conv1's input gradient, a gather, reads conv1's gradient (relu1's tiles
        # write it) one row past its tile, and runs one more tile behind
        skew = 2 if kernel.name.endswith("backward") else 1
        assert dict(tile.meta)["skew"] == skew
        assert 1 < tile.extent - skew < 32   # several tiles, plus those of the skew
        outer = _loops(kernel, LoopKind.PARALLEL)
        assert outer and all(dict(n.meta)["collapse"] == 1 for n in outer if n.axis is not None)


def test_halos_end_groups_when_the_batch_cannot_feed_the_threads(monkeypatch):
    """Skewed tiles run in order; with one item and two threads, tile parallelism wins."""
    _set_l2(monkeypatch, SMALL_L2)
    net = Net(1, opt_level=3, num_threads=2, seed=0)
    x = MemoryDataLayer(net, "x", (3, 32, 32))
    c1 = ConvolutionLayer("conv1", net, x, 8, 3, pad=1)
    c2 = ConvolutionLayer("conv2", net, ReLULayer("relu1", net, c1), 8, 3, pad=1)
    MaxPoolingLayer("pool", net, ReLULayer("relu2", net, c2), 2)
    net.init()
    assert [g.name for g in net.program.groups] == ["conv1+relu1", "conv2+relu2+pool"]
    for kernel in _live(net).values():
        assert all("skew" not in dict(t.meta) for t in _loops(kernel, LoopKind.TILE_OUTER))


def _argmax_writes(net) -> dict[str, set[str]]:
    """Per phase, the arg-max buffers the fused group's kernel writes."""
    (group,) = net.program.groups
    return {phase: {a.buffer.name for a in accesses(group.owner(phase).kernels[phase].body)
                    if a.written and "argmax" in a.buffer.name} for phase in ("forward", "backward")}


def test_pool_after_relu_recomputes_its_argmax_in_backward(monkeypatch):
    """The ReLU's backward reads the pool's input rows anyway (its mask), so recomputing the
    arg-max per tile costs no off-chip bytes against two passes over the arg-max; training
    forward stores none, backward recomputes it into a per-thread tile buffer, and the
    gradients equal plain loops (test above)."""
    _set_l2(monkeypatch, SMALL_L2)
    net = _pooled_conv(3, threads=2)
    (group,) = net.program.groups
    choice = group.choices["pool"]
    argmax = net.program.buffers.field(group.plans[-1].ensemble, "argmax")
    assert choice.recompute and choice.recompute_bytes == 0
    assert choice.keep_bytes == 2 * argmax.size * 4
    assert _argmax_writes(net) == {"forward": set(), "backward": {"pool.argmax.lines"}}


def test_pool_after_conv_keeps_its_argmax(monkeypatch):
    """Without a ReLU nothing in the group's backward reads the conv's output, so
    recomputing would load it again (four values per arg-max): the arg-max is kept."""
    _set_l2(monkeypatch, SMALL_L2)

    @_net(batch=2)
    def conv_pool(net):
        x = MemoryDataLayer(net, "x", (3, 32, 32))
        conv = ConvolutionLayer("conv", net, x, 8, 3, pad=1)
        WeightedSumLoss(net, "loss", MaxPoolingLayer("pool", net, conv, 2))
        return x, None

    net = _compare(conv_pool, threads=2)
    choice = net.program.groups[0].choices["pool"]
    assert not choice.recompute and choice.recompute_bytes > choice.keep_bytes
    assert _argmax_writes(net) == {"forward": {"pool.argmax"}, "backward": set()}


# ---------------------------------------------------------------- DAGs
@_net(batch=2)
def residual_block(net):
    """conv -> relu -> conv -> add(shortcut) -> relu, the shortcut being the block's input:
    the input has two readers (it ends the group before it), the add reads a side input
    complete before the group."""
    from latte.stdlib import AddLayer
    x = MemoryDataLayer(net, "x", (8, 32, 16))
    c1 = ConvolutionLayer("c1", net, x, 8, 3, 1, 1)
    r1 = ReLULayer("r1", net, c1)
    c2 = ConvolutionLayer("c2", net, r1, 8, 3, 1, 1)
    add = AddLayer("add", net, c2, x)
    out = ReLULayer("out", net, add)
    WeightedSumLoss(net, "loss", out)
    return x, None


@_net(batch=2)
def shared_producer(net):
    """A conv read by a pool and by an activation that must copy: its group must end at
    the conv, and both branches must see its values."""
    x = MemoryDataLayer(net, "x", (4, 32, 16))
    c1 = ConvolutionLayer("c1", net, x, 6, 3, 1, 1)
    pool = MaxPoolingLayer("pool", net, c1, 2)
    act = TanhLayer("tanh", net, c1)
    WeightedSumLoss(net, "l1", pool)
    WeightedSumLoss(net, "l2", act, seed=5)
    return x, None


@pytest.mark.parametrize("threads", [1, 2])
def test_residual_block_fuses_the_add_and_equals_unfused(threads):
    net = _compare(residual_block, threads)
    groups = [g.name for g in net.program.groups]
    assert any("add" in g and "c2" in g for g in groups), groups


@pytest.mark.parametrize("threads", [1, 2])
def test_a_producer_with_two_readers_ends_its_group(threads):
    net = _compare(shared_producer, threads)
    for g in net.program.groups:
        names = [p.ensemble.name for p in g.plans]
        assert "c1" not in names[:-1], names   # nothing fuses after c1


@_net(batch=2)
def pointwise_then_padded(net):
    """A 1x1 conv (its nests are not tiled: one tile is its whole image) fused with a padded
    3x3 conv (a halo: the schedule is skewed). The 1x1 conv's backward GEMMs need all of the
    input gradient the 3x3 conv's tiles write: they once ran before the tile loop and
    returned zeros (found by the model zoo's GoogLeNet test)."""
    x = MemoryDataLayer(net, "x", (8, 8, 8))
    a = ConvolutionLayer("a", net, x, 4, 1)
    b = ConvolutionLayer("b", net, a, 6, 3, 1, 1)
    WeightedSumLoss(net, "loss", b)
    return x, None


@pytest.mark.parametrize("threads", [1, 2])
def test_untiled_member_of_a_skewed_group_runs_after_the_tiles(threads):
    net = _compare(pointwise_then_padded, threads)
    assert [g.name for g in net.program.groups] == ["a+b"]


def test_in_place_activation_of_an_input_is_no_line_buffer_in_test():
    """A fused group's first member working in place on a data ensemble reads that buffer:
    the test forward must not move it into per-thread line buffers (it read zeros)."""
    from latte.stdlib import PReLULayer

    net = Net(4, opt_level=3, num_threads=2)
    x = MemoryDataLayer(net, "x", (3, 4, 4))
    p = PReLULayer("p", net, ReLULayer("e", net, x))
    net.init()
    v = np.random.default_rng(0).standard_normal((4, 3, 4, 4)).astype(np.float32)
    net.value(x)[...] = v
    net.forward(Phase.TEST)
    assert net.program.groups, "the activation and the PReLU fuse"
    np.testing.assert_allclose(net.value(p), np.maximum(v, 0), rtol=1e-6)
