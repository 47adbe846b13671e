"""Convolution with dilation, groups and bias=False against PyTorch's conv2d in float64, the
quasi-affine mapping fit (``o // q``) it relies on, and one GEMM per group."""

from __future__ import annotations

import itertools

import islpy as isl
import numpy as np
import pytest
from helpers import WeightedSumLoss, assert_scaled_close, fill, pair

from latte import Net
from latte.compiler.explain import explain_program
from latte.compiler.ir import Gemm, Loop, walk
from latte.compiler.mapping import _EXHAUSTIVE, analyze_connection, analyze_connections, value_at
from latte.errors import ShapeError
from latte.lang import Ensemble, add_connections
from latte.stdlib import ConvolutionLayer, MemoryDataLayer, ReLULayer
from latte.stdlib.convolution import UnbiasedNeuron

torch = pytest.importorskip("torch")

BATCH = 2

# (channels, height, width, filters, kernel, stride, pad, dilation, groups, bias)
CASES = [
    (3, 9, 8, 4, 3, 1, 2, 2, 1, False),                   # dilated, no bias
    (4, 9, 7, 6, (3, 2), 2, 1, 1, 2, True),               # AlexNet's two groups, strided
    (4, 8, 8, 4, 3, 1, 1, 1, 4, True),                    # depthwise
    (3, 11, 10, 6, 3, 2, 2, 2, 3, False),                 # depthwise, multiplier 2, dilated
    (4, 8, 9, 4, (2, 3), (1, 2), (1, 0), (2, 1), 2, True),  # everything per axis
    (8, 18, 18, 16, 3, 1, 1, (1, 2), 4, True),            # > 4096 neurons: the traced fit
]


def _ids(case) -> str:
    c, h, w, f, k, s, p, d, g, b = case
    return f"c{c}-{h}x{w}-f{f}-k{k}-s{s}-p{p}-d{d}-g{g}-{'bias' if b else 'nobias'}"


@pytest.mark.parametrize("opt_level", [0, 3])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_against_torch(opt_level, case):
    c, h, w, f, kernel, stride, pad, dilation, groups, bias = case
    rng = np.random.default_rng(11)
    net = Net(BATCH, opt_level=opt_level, num_threads=2, seed=11)
    x = MemoryDataLayer(net, "x", (c, h, w))
    conv = ConvolutionLayer("conv", net, x, f, kernel, stride, pad, dilation=dilation,
                            groups=groups, bias=bias)
    loss = WeightedSumLoss(net, "loss", conv)
    net.init()
    params = {p.name: p for p in net.params}
    assert sorted(params) == (["conv.bias", "conv.weights"] if bias else ["conv.weights"])
    (kh, kw) = pair(kernel)
    weights = params["conv.weights"]
    assert weights.value.shape == (f, c // groups * kh * kw)
    if bias:
        params["conv.bias"].value[...] = rng.standard_normal((f, 1))
    xv = fill(net, x, rng)
    net.forward()
    net.backward()

    wt = torch.tensor(weights.value.reshape(f, c // groups, kh, kw), dtype=torch.float64,
                      requires_grad=True)
    bt = (torch.tensor(params["conv.bias"].value[:, 0], dtype=torch.float64, requires_grad=True)
          if bias else None)
    xt = torch.tensor(xv, dtype=torch.float64, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, pair(stride), pair(pad), pair(dilation), groups)
    assert conv.shape == tuple(yt.shape[1:])
    (yt * torch.tensor(loss.w, dtype=torch.float64)).sum().backward()
    assert_scaled_close(net.value(conv), yt.detach().numpy(), 1e-5, "forward")
    assert_scaled_close(net.grad(x), xt.grad.numpy(), 1e-5, "input gradient")
    assert_scaled_close(weights.grad, wt.grad.numpy().reshape(f, -1), 1e-5, "weight gradient")
    if bias:
        assert_scaled_close(params["conv.bias"].grad[:, 0], bt.grad.numpy(), 1e-5, "bias gradient")


def _conv_net(opt_level: int, groups: int, channels: int = 8, filters: int = 16) -> Net:
    net = Net(BATCH, opt_level=opt_level, num_threads=2, seed=3)
    x = MemoryDataLayer(net, "x", (channels, 16, 16))
    conv = ConvolutionLayer("conv", net, x, filters, 3, pad=1, groups=groups)
    WeightedSumLoss(net, "loss", ReLULayer("relu", net, conv))
    net.init()
    return net


@pytest.mark.parametrize("opt_level", [1, 3])
def test_groups_are_gemms(opt_level):
    """A grouped convolution compiles to one sgemm per group (a loop over the groups around
    it) in forward, input gradient and weight gradient; no gather table."""
    groups, channels, filters = 2, 8, 16
    net = _conv_net(opt_level, groups, channels, filters)
    plan = next(p for p in net.program.plans if p.ensemble.name == "conv")
    assert plan.accesses[0].dims is not None
    assert plan.accesses[0].quotients() == {0: filters // groups}
    for phase, count in (("forward", 1), ("backward", 2)):
        bodies = [p.kernels[phase].body for p in net.program.plans]   # fused: the owner's
        around = [lp for b in bodies for lp in walk(b) if isinstance(lp, Loop)
                  and any(isinstance(s, Gemm) for s in lp.body.stmts)]
        gemms = [s for lp in around for s in lp.body.stmts if isinstance(s, Gemm)]
        assert len(gemms) == count, phase
        assert all(lp.extent == groups and dict(lp.meta).get("strip") == filters // groups
                   for lp in around), phase
        if phase == "forward":
            assert (gemms[0].m, gemms[0].k) == (filters // groups, channels // groups * 9)
    text = explain_program(net.program)
    assert "forward: 1 GEMM match" in text and "gather table" not in text
    assert f"quasi-affine, strip-mined dim 0 (size {filters}) by {filters // groups}" in text


def _sink_points(shape):
    return itertools.product(*(range(n) for n in shape))


@pytest.mark.parametrize("shape", [(6, 3, 3), (24, 16, 16)], ids=["evaluated", "traced"])
def test_quotient_fit_is_exact(shape):
    """``o // q`` in a mapping is fitted at every neuron (small ensembles by evaluation,
    large ones by one symbolic call): the fitted form equals the mapping everywhere, and
    the isl relation holds exactly the pairs the mapping selects."""
    f, h, w = shape
    net = Net(1)
    x = MemoryDataLayer(net, "x", (12, h + 2, w + 2))
    sink = Ensemble(net, "s", UnbiasedNeuron, shape,
                    weights=(np.zeros((f, 4 * 9), np.float32), lambda o, y, x_: o))
    mapping = lambda o, y, x_: (range(o // (f // 3) * 4, o // (f // 3) * 4 + 4),  # noqa: E731
                                range(y, y + 3), range(x_, x_ + 3))
    add_connections(net, x, sink, mapping)
    assert (int(np.prod(shape)) > _EXHAUSTIVE) == (shape[0] == 24)
    acc = analyze_connection(net.connections_into(sink)[0])
    assert acc.dims is not None and acc.quotients() == {0: f // 3} and acc.in_bounds
    assert "floor" in str(acc.relation)
    for idx in _sink_points(shape):
        want = mapping(*idx)
        got = tuple(range(value_at(a.lo, idx), value_at(a.lo, idx) + a.step * a.length, a.step)
                    for a in acc.dims)
        assert got == want, idx
    if shape[0] == 6:   # the relation, point by point
        for idx in _sink_points(shape):
            pt = isl.Set(f"{{ [{', '.join(map(str, idx))}] }}")
            found = _isl_points(acc.relation.intersect_domain(pt).range())
            assert sorted(found) == sorted(itertools.product(*mapping(*idx))), idx


def _isl_points(s: isl.Set) -> list[tuple[int, ...]]:
    out = []
    s.foreach_point(lambda p: out.append(tuple(
        p.get_coordinate_val(isl.dim_type.set, i).to_python() for i in range(s.dim(isl.dim_type.set)))))
    return out


@pytest.mark.parametrize("opt_level", [0, 3])
@pytest.mark.parametrize("shape", [(6, 4, 5), (12, 20, 20)], ids=["evaluated", "traced"])
def test_channel_shuffle(opt_level, shape):
    """``(o % g) * (C/g) + o // g`` (ShuffleNet's channel shuffle) is quasi-affine too: no
    gather table, and values and gradients move where numpy says."""
    c, groups = shape[0], 3
    net = Net(BATCH, opt_level=opt_level, num_threads=2)
    x = MemoryDataLayer(net, "x", shape)
    out = Ensemble(net, "shuffle", UnbiasedNeuron, shape,
                   weights=np.ones((*shape, 1), np.float32))
    add_connections(net, x, out, lambda o, y, x_: ((o % groups) * (c // groups) + o // groups, y, x_))
    loss = WeightedSumLoss(net, "loss", out)
    net.init()
    assert net.program.plans[0].accesses[0].quotients() == {0: groups}
    xv = fill(net, x, np.random.default_rng(5))
    net.forward()
    net.backward()
    perm = [(o % groups) * (c // groups) + o // groups for o in range(c)]
    np.testing.assert_array_equal(net.value(out), xv[:, perm])
    grad = np.zeros_like(xv)
    grad[:, perm] = loss.w
    np.testing.assert_array_equal(net.grad(x), grad)


def _conn(net, sink_shape, src_shape, mapping, name="s"):
    src = MemoryDataLayer(net, f"{name}_src", src_shape)
    sink = Ensemble(net, name, UnbiasedNeuron, sink_shape,
                    weights=np.zeros((*sink_shape, 1), np.float32))
    add_connections(net, src, sink, mapping)
    return net.connections_into(sink)


def test_quotients_that_cannot_be_strip_mined():
    """A divisor that does not divide the extent, or two divisors of one dimension, fall
    back to gather tables (still exact); an index map stays affine only."""
    net = Net(1)
    (c,) = _conn(net, (5,), (3,), lambda o: (o // 2,), "a")          # 2 does not divide 5
    assert analyze_connection(c).dims is None
    (c,) = _conn(net, (6,), (2, 3), lambda o: (o // 3, o // 2), "b")  # 3 and 2 in one mapping
    assert analyze_connection(c).dims is None
    src = MemoryDataLayer(net, "c_src", (3,))
    sink = Ensemble(net, "c", UnbiasedNeuron, (6,), weights=np.zeros((6, 1), np.float32))
    add_connections(net, src, sink, lambda o: (o // 2,))
    add_connections(net, src, sink, lambda o: (o // 3 + 1,))
    first, second = analyze_connections(net.connections_into(sink))
    assert first.quotients() == {0: 2} and second.dims is None
    (c,) = _conn(net, (8,), (4,), lambda o: (o // 2,), "d")
    acc = analyze_connection(c)
    assert acc.quotients() == {0: 2} and acc.shared_dims() == ()


def test_group_errors():
    net = Net(1)
    x = MemoryDataLayer(net, "x", (6, 8, 8))
    with pytest.raises(ShapeError, match="'g4'.*groups=4"):
        ConvolutionLayer("g4", net, x, 8, 3, groups=4)     # 4 does not divide 6 channels
    with pytest.raises(ShapeError, match="'g3'.*groups=3"):
        ConvolutionLayer("g3", net, x, 8, 3, groups=3)     # nor 8 filters
    with pytest.raises(ShapeError, match="'big'.*does not fit"):
        ConvolutionLayer("big", net, x, 8, 3, dilation=4)  # spans 9 rows of 8
    with pytest.raises(ShapeError, match="dilation"):
        ConvolutionLayer("d0", net, x, 8, 3, dilation=0)


@pytest.mark.parametrize("opt_level", [1, 3])
def test_strided_1x1_convolution_is_gemms(opt_level):
    """A stride-2 1x1 convolution (a ResNet projection shortcut) reads strided columns: its
    input is gathered into a contiguous tile, so forward and both gradients are GEMMs."""
    nets = []
    for level in (0, opt_level):
        net = Net(2, num_threads=2, opt_level=level, seed=0)
        data = MemoryDataLayer(net, "data", (8, 10, 10))
        data.needs_grad = True
        conv = ConvolutionLayer("proj", net, data, 16, 1, stride=2)
        WeightedSumLoss(net, "loss", conv)
        net.init()
        fill(net, data, np.random.default_rng(1))
        net.forward()
        net.backward()
        nets.append((net, conv, data))
    (base, conv, data), (opt, _, _) = nets
    plan = next(p for p in opt.program.plans if p.ensemble.name == "proj")
    for phase in ("forward", "backward"):
        assert any(isinstance(n, Gemm) for n in walk(plan.kernels[phase].body)), phase
    assert_scaled_close(opt.value("proj"), base.value(conv), 1e-5, "value")
    assert_scaled_close(opt.grad("data"), base.grad(data), 1e-5, "input gradient")
    for p, q in zip(base.params, opt.params):
        assert_scaled_close(q.grad, p.grad, 1e-5, p.name)
