"""Element-wise, pooling, normalization and joining layers against PyTorch in float64:
forward values, input gradients and parameter gradients through a loss of known gradient,
at opt level 0 (one thread) and 3 (two threads)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WeightedSumLoss, fill

from latte import Net
from latte.errors import ShapeError
from latte.stdlib import (
    AddLayer,
    ConcatLayer,
    ConvolutionLayer,
    ELULayer,
    GlobalAveragePoolingLayer,
    LeakyReLULayer,
    LRNLayer,
    MemoryDataLayer,
    MulLayer,
    PReLULayer,
    SoftmaxLayer,
)

torch = pytest.importorskip("torch")
F = torch.nn.functional

BATCH = 4
LEVELS = [(0, 1), (3, 2)]   # (opt level, threads)


def run_latte(build, shapes, opt_level: int, threads: int, scale: float = 1.0, seed: int = 0):
    """Build ``build(net, inputs)`` over memory inputs of ``shapes`` with a WeightedSumLoss
    on top; give every parameter random values; run forward and backward. Returns the
    inputs, the output, the loss weights, input gradients and ``{name: (value, grad)}``."""
    rng = np.random.default_rng(seed)
    net = Net(BATCH, opt_level=opt_level, num_threads=threads, seed=seed)
    ins = [MemoryDataLayer(net, f"x{k}", s) for k, s in enumerate(shapes)]
    out = build(net, ins)
    loss = WeightedSumLoss(net, "loss", out)
    net.init()
    xs = [fill(net, e, rng, scale).astype(np.float64) for e in ins]
    for p in net.params:
        p.value[...] = rng.uniform(-0.5, 1.0, p.value.shape).astype(np.float32)
    params = {p.name: p.value.astype(np.float64) for p in net.params}
    net.forward()
    y = net.value(out).copy()
    net.backward()
    grads = [net.grad(e).copy() for e in ins]
    pgrads = {p.name: p.grad.copy() for p in net.params}
    return xs, y, loss.w.astype(np.float64), grads, params, pgrads


def close(got, want, what: str) -> None:
    want = np.asarray(want)
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-4,
                               atol=1e-4 * max(np.abs(want).max(), 1e-3), err_msg=what)


def check(build, torch_fn, shapes, opt_level, threads, scale: float = 1.0) -> None:
    """``torch_fn(xs, params)`` is the float64 torch forward over tensors requiring grad;
    the inputs are normal with standard deviation ``scale``."""
    xs, y, w, grads, params, pgrads = run_latte(build, shapes, opt_level, threads, scale)
    tx = [torch.tensor(x, requires_grad=True) for x in xs]
    tp = {n: torch.tensor(v, requires_grad=True) for n, v in params.items()}
    ty = torch_fn(tx, tp)
    (ty * torch.tensor(w).reshape(ty.shape)).sum().backward()
    close(y, ty.detach().numpy(), "forward")
    for k, (g, t) in enumerate(zip(grads, tx)):
        close(g, t.grad.numpy(), f"gradient of x{k}")
    for n, t in tp.items():
        close(pgrads[n], t.grad.numpy(), f"gradient of {n}")
    assert tp or not pgrads


levels = pytest.mark.parametrize("opt_level,threads", LEVELS, ids=["o0", "o3t2"])


@levels
@pytest.mark.parametrize("shape", [(6,), (3, 4, 5)], ids=["c", "chw"])
@pytest.mark.parametrize("slope", [0.01, 0.3, 0.0])
def test_leaky_relu(opt_level, threads, shape, slope):
    check(lambda net, x: LeakyReLULayer("act", net, x[0], slope=slope),
          lambda x, p: F.leaky_relu(x[0], slope), [shape], opt_level, threads)


@levels
@pytest.mark.parametrize("shape", [(6,), (3, 4, 5)], ids=["c", "chw"])
@pytest.mark.parametrize("alpha", [1.0, 0.4])
def test_elu(opt_level, threads, shape, alpha):
    check(lambda net, x: ELULayer("act", net, x[0], alpha=alpha),
          lambda x, p: F.elu(x[0], alpha), [shape], opt_level, threads)


@levels
@pytest.mark.parametrize("shape", [(6,), (3, 4, 5), (2, 7)], ids=["c", "chw", "cl"])
def test_prelu(opt_level, threads, shape):
    check(lambda net, x: PReLULayer("act", net, x[0]),
          lambda x, p: F.prelu(x[0], p["act.slope"].reshape(-1)), [shape], opt_level, threads)


def test_prelu_parameter():
    net = Net(2)
    PReLULayer("pr", net, MemoryDataLayer(net, "x", (3, 2, 2)))
    net.init()
    (slope,) = net.params
    assert slope.name == "pr.slope" and slope.value.shape == (3,)   # the shape given
    np.testing.assert_array_equal(slope.value, 0.25)


@levels
@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 1, 7)], ids=["3x4x5", "2x1x7"])
def test_global_average_pooling(opt_level, threads, shape):
    check(lambda net, x: GlobalAveragePoolingLayer("gap", net, x[0]),
          lambda x, p: x[0].mean(dim=(2, 3)), [shape], opt_level, threads)


@levels
@pytest.mark.parametrize("shape", [(10,), (3, 2, 2)], ids=["c", "chw"])
def test_softmax(opt_level, threads, shape):
    check(lambda net, x: SoftmaxLayer("soft", net, x[0]),
          lambda x, p: F.softmax(x[0].reshape(BATCH, -1), dim=1), [shape], opt_level, threads)


@levels
def test_softmax_large_logits(opt_level, threads):
    """Logits up to several hundred: exp overflows float32 unless the maximum comes off."""
    check(lambda net, x: SoftmaxLayer("soft", net, x[0]),
          lambda x, p: F.softmax(x[0], dim=1), [(12,)], opt_level, threads, scale=200.0)


@levels
@pytest.mark.parametrize("shape,size,alpha,beta,k", [
    ((7, 4, 3), 5, 1e-4, 0.75, 1.0),   # the defaults
    ((7, 4, 3), 5, 0.5, 0.75, 1.0),
    ((6, 3), 4, 0.8, 0.6, 2.0),        # even size: the window is asymmetric
    ((5, 2, 2), 1, 0.3, 1.5, 0.5),
    ((3, 2, 2), 7, 0.9, 0.75, 1.0),    # window wider than the channels
])
def test_lrn(opt_level, threads, shape, size, alpha, beta, k):
    check(lambda net, x: LRNLayer("lrn", net, x[0], size=size, alpha=alpha, beta=beta, k=k),
          lambda x, p: F.local_response_norm(x[0], size, alpha, beta, k), [shape],
          opt_level, threads)


@levels
@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)], ids=["c", "chw"])
@pytest.mark.parametrize("kind", ["add", "mul"])
def test_add_mul(opt_level, threads, shape, kind):
    layer, op = (AddLayer, torch.add) if kind == "add" else (MulLayer, torch.mul)
    check(lambda net, x: layer("join", net, x[0], x[1]), lambda x, p: op(x[0], x[1]),
          [shape, shape], opt_level, threads)


@levels
@pytest.mark.parametrize("kind", ["add", "mul"])
def test_add_mul_same_source(opt_level, threads, kind):
    layer, op = (AddLayer, torch.add) if kind == "add" else (MulLayer, torch.mul)
    check(lambda net, x: layer("join", net, x[0], x[0]), lambda x, p: op(x[0], x[0]),
          [(3, 2)], opt_level, threads)


@levels
@pytest.mark.parametrize("shapes,axis", [
    ([(2, 3, 4), (1, 3, 4), (3, 3, 4)], 0),
    ([(2, 1, 4), (2, 3, 4)], 1),
    ([(2, 3, 2), (2, 3, 1), (2, 3, 3)], -1),
    ([(4,), (3,)], 0),
    ([(2, 3)], 1),
], ids=["c3", "h2", "w3", "flat", "one"])
def test_concat(opt_level, threads, shapes, axis):
    rank = len(shapes[0])
    check(lambda net, x: ConcatLayer("cat", net, x, axis=axis),
          lambda x, p: torch.cat(x, dim=1 + axis % rank), shapes, opt_level, threads)


def test_shape_errors_name_both_inputs():
    net = Net(2)
    a = MemoryDataLayer(net, "a", (2, 3))
    b = MemoryDataLayer(net, "b", (3, 2))
    for layer in (AddLayer, MulLayer):
        with pytest.raises(ShapeError, match="'a'.*'b'"):
            layer("join", net, a, b)
    with pytest.raises(ShapeError, match="'a'.*'b'"):
        ConcatLayer("cat", net, [a, b], axis=0)
    with pytest.raises(ShapeError, match="axis 2"):
        ConcatLayer("cat", net, [a, a], axis=2)
    with pytest.raises(ShapeError, match="'a'"):
        GlobalAveragePoolingLayer("gap", net, a)


def test_in_place_activations_reject_what_they_cannot_invert():
    net = Net(2)
    x = MemoryDataLayer(net, "x", (3,))
    with pytest.raises(ValueError, match="'act'.*slope"):
        LeakyReLULayer("act", net, x, slope=-0.1)
    with pytest.raises(ValueError, match="'act'.*alpha"):
        ELULayer("act", net, x, alpha=-1.0)
    with pytest.raises(ValueError, match="'lrn'.*size"):
        LRNLayer("lrn", net, x, size=0)


def _inception_block(net, x):
    """Two convolutions joined along channels, LRN, PReLU, a residual add, an in-place
    leaky ReLU, global average pooling and softmax, over rows wide enough to be tiled and
    fused at opt level 3."""
    a = ConvolutionLayer("a", net, x[0], 4, 3, pad=1)
    b = ConvolutionLayer("b", net, x[0], 2, 1)
    cat = ConcatLayer("cat", net, [a, b])
    lrn = LRNLayer("lrn", net, cat, size=3, alpha=0.5)
    add = AddLayer("add", net, PReLULayer("pr", net, lrn), cat)
    return SoftmaxLayer("soft", net, GlobalAveragePoolingLayer("gap", net, LeakyReLULayer("act", net, add)))


def _inception_block_torch(x, p):
    def conv(name, k, pad):
        w = p[f"{name}.weights"]
        return F.conv2d(x[0], w.reshape(len(w), -1, k, k), p[f"{name}.bias"].reshape(-1), padding=pad)
    cat = torch.cat([conv("a", 3, 1), conv("b", 1, 0)], dim=1)
    pr = F.prelu(F.local_response_norm(cat, 3, 0.5), p["pr.slope"].reshape(-1))
    return F.softmax(F.leaky_relu(pr + cat, 0.01).mean(dim=(2, 3)), dim=1)


@levels
def test_inception_block(opt_level, threads):
    check(_inception_block, _inception_block_torch, [(3, 4, 128)], opt_level, threads)
