"""Standard-library layers: forward against numpy, backward against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import OPT_LEVELS, WeightedSumLoss, check_gradients, fill, fill_labels, set_biases, softmax_xent

from latte import Net
from latte.stdlib import (
    AccuracyLayer,
    FullyConnectedLayer,
    MemoryDataLayer,
    ReLULayer,
    SigmoidLayer,
    SoftmaxLossLayer,
    TanhLayer,
)

BATCH = 8


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("in_shape", [(32,), (2, 3, 3)], ids=["1d", "chw"])
def test_fully_connected(opt_level, in_shape):
    rng = np.random.default_rng(1)
    net = Net(BATCH, opt_level=opt_level, seed=1)
    x = MemoryDataLayer(net, "x", in_shape)
    label = MemoryDataLayer(net, "label", (1,))
    fc = FullyConnectedLayer("fc", net, x, 16)
    SoftmaxLossLayer("loss", net, fc, label)
    net.init()
    set_biases(net, rng)
    xv = fill(net, x, rng)
    y = fill_labels(net, label, 16, rng)
    net.forward()
    w, b = net.params[0].value, net.params[1].value
    assert [p.name for p in net.params] == ["fc.weights", "fc.bias"]
    assert w.shape == (16, int(np.prod(in_shape))) and b.shape == (16, 1)
    ref = xv.reshape(BATCH, -1) @ w.T + b[:, 0]
    np.testing.assert_allclose(net.value(fc), ref, rtol=1e-5, atol=1e-5)
    ref_loss, ref_grad = softmax_xent(ref, y)
    assert net.loss == pytest.approx(ref_loss, rel=1e-5)
    net.backward()
    np.testing.assert_allclose(net.grad(fc), ref_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(net.grad(x).reshape(BATCH, -1), ref_grad @ w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(net.params[0].grad, ref_grad.T @ xv.reshape(BATCH, -1),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(net.params[1].grad[:, 0], ref_grad.sum(axis=0), rtol=1e-4, atol=1e-6)
    check_gradients(net, [x])


ACTIVATIONS = {
    "relu": (ReLULayer, lambda z: np.maximum(z, 0.0)),
    "tanh": (TanhLayer, np.tanh),
    "sigmoid": (SigmoidLayer, lambda z: 1.0 / (1.0 + np.exp(-z))),
}


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("kind", sorted(ACTIVATIONS))
def test_activation(opt_level, kind):
    layer, fn = ACTIVATIONS[kind]
    rng = np.random.default_rng(2)
    net = Net(BATCH, opt_level=opt_level, seed=2)
    x = MemoryDataLayer(net, "x", (32,))
    fc = FullyConnectedLayer("fc", net, x, 16)
    act = layer("act", net, fc)
    loss = WeightedSumLoss(net, "loss", act)
    net.init()
    set_biases(net, rng)
    xv = fill(net, x, rng)
    net.forward()
    w, b = net.params[0].value, net.params[1].value
    pre = xv @ w.T + b[:, 0]
    out = fn(pre.astype(np.float64))
    np.testing.assert_allclose(net.value(act), out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.value(fc), out, rtol=1e-5, atol=1e-6)  # in place
    assert net.loss == pytest.approx(float((loss.w * out).sum()), rel=1e-5)
    net.backward()
    eps = 1e-6
    slope = (fn(pre.astype(np.float64) + eps) - fn(pre.astype(np.float64) - eps)) / (2 * eps)
    np.testing.assert_allclose(net.grad(fc), loss.w * slope, rtol=1e-4, atol=1e-5)
    check_gradients(net, [x])


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_softmax_loss(opt_level):
    rng = np.random.default_rng(3)
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (5,))
    label = MemoryDataLayer(net, "label", (1,))
    loss = SoftmaxLossLayer("loss", net, x, label)
    net.init()
    xv = fill(net, x, rng, scale=3.0)
    y = fill_labels(net, label, 5, rng)
    net.forward()
    ref_loss, ref_grad = softmax_xent(xv, y)
    assert net.loss == pytest.approx(ref_loss, rel=1e-6)
    assert loss.loss == pytest.approx(ref_loss, rel=1e-6)
    p = np.exp(xv - xv.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(net.value(loss)[:, 0], -np.log(p[np.arange(BATCH), y]), rtol=1e-5)
    net.backward()
    np.testing.assert_allclose(net.grad(x), ref_grad, rtol=1e-5, atol=1e-7)
    check_gradients(net, [x])


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_softmax_loss_is_stable_for_large_logits(opt_level):
    net = Net(2, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (3,))
    label = MemoryDataLayer(net, "label", (1,))
    SoftmaxLossLayer("loss", net, x, label)
    net.value(x)[...] = [[1000.0, 0.0, -1000.0], [0.0, 1000.0, 999.0]]
    net.value(label)[:, 0] = [0, 2]
    net.forward()
    assert net.loss == pytest.approx((0.0 + 1.0 + np.log1p(np.exp(-1.0))) / 2, rel=1e-6)


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_accuracy(opt_level):
    rng = np.random.default_rng(4)
    net = Net(BATCH, opt_level=opt_level, seed=4)
    x = MemoryDataLayer(net, "x", (32,))
    label = MemoryDataLayer(net, "label", (1,))
    fc = FullyConnectedLayer("fc", net, x, 4)
    acc = AccuracyLayer("acc", net, fc, label)
    net.init()
    xv = fill(net, x, rng)
    y = fill_labels(net, label, 4, rng)
    net.forward()
    w, b = net.params[0].value, net.params[1].value
    hits = ((xv @ w.T + b[:, 0]).argmax(axis=1) == y)
    assert 0 < hits.sum() < BATCH  # the check below distinguishes hits from misses
    assert acc.accuracy == pytest.approx(hits.mean())
    np.testing.assert_array_equal(net.value(acc)[:, 0], hits.astype(np.float32))
    net.value(label)[:, 0] = (xv @ w.T + b[:, 0]).argmax(axis=1)
    net.forward()
    assert acc.accuracy == 1.0
