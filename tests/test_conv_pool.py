"""Convolution, pooling and dropout layers: forward against numpy, backward against finite
differences, dropout masks against their contract."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import OPT_LEVELS, WeightedSumLoss, check_gradients, fill, fill_labels, pair, set_biases

from latte import Net, Phase
from latte.errors import ShapeError
from latte.stdlib import (
    ConvolutionLayer,
    DropoutLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MeanPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
)

BATCH = 2


def _windows(x: np.ndarray, kernel, stride, pad, fill_value: float = 0.0) -> np.ndarray:
    """``out[n, c, i, j, a, b] = xp[n, c, sy*i + a, sx*j + b]`` with ``xp`` padded by ``pad``."""
    (kh, kw), (sy, sx), (py, px) = pair(kernel), pair(stride), pair(pad)
    xp = np.pad(x, ((0, 0), (0, 0), (py, py), (px, px)), constant_values=fill_value)
    out_h = (xp.shape[2] - kh) // sy + 1
    out_w = (xp.shape[3] - kw) // sx + 1
    return np.stack([np.stack([xp[:, :, sy * i:sy * i + kh, sx * j:sx * j + kw]
                               for j in range(out_w)], axis=2) for i in range(out_h)], axis=2)


# (channels, height, width, filters, kernel, stride, pad)
CONV_CASES = [
    (1, 5, 5, 2, 1, 1, 0),
    (3, 6, 5, 2, 3, 1, 1),
    (1, 7, 6, 3, (2, 3), 2, 0),
    (3, 9, 8, 2, 5, 1, 2),
    (1, 8, 7, 2, 3, 3, 0),          # windows do not cover the last rows / columns
    (3, 7, 9, 2, 3, 2, 2),
    (1, 6, 6, 2, (2, 3), 3, 1),
]


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("c,h,w,f,kernel,stride,pad", CONV_CASES,
                         ids=[f"c{c}-{h}x{w}-k{k}-s{s}-p{p}" for c, h, w, _, k, s, p in CONV_CASES])
def test_convolution(opt_level, c, h, w, f, kernel, stride, pad):
    rng = np.random.default_rng(20)
    net = Net(BATCH, opt_level=opt_level, seed=20)
    x = MemoryDataLayer(net, "x", (c, h, w))
    conv = ConvolutionLayer("conv", net, x, f, kernel, stride=stride, pad=pad)
    WeightedSumLoss(net, "loss", conv)
    net.init()
    (kh, kw), (sy, sx) = pair(kernel), pair(stride)
    out_h, out_w = (h + 2 * pad - kh) // sy + 1, (w + 2 * pad - kw) // sx + 1
    assert conv.shape == (f, out_h, out_w)
    weights, bias = net.params
    assert (weights.name, weights.lr_mult, weights.decay_mult) == ("conv.weights", 1.0, 1.0)
    assert (bias.name, bias.lr_mult, bias.decay_mult) == ("conv.bias", 2.0, 0.0)
    assert weights.value.shape == (f, c * kh * kw) and bias.value.shape == (f, 1)
    assert not bias.value.any() and np.abs(weights.value).max() <= np.sqrt(3.0 / (c * kh * kw))
    bias.value[...] = rng.standard_normal(bias.value.shape)
    xv = fill(net, x, rng)
    net.forward()
    cols = _windows(xv, kernel, stride, pad)                  # (n, c, oh, ow, kh, kw)
    ref = np.einsum("ncyxab,fcab->nfyx", cols, weights.value.reshape(f, c, kh, kw))
    ref += bias.value[:, 0, None, None]
    np.testing.assert_allclose(net.value(conv), ref, rtol=1e-4, atol=1e-5)
    check_gradients(net, [x])


# (channels, height, width, kernel, stride, pad)
POOL_CASES = [
    (1, 4, 4, 2, None, 0),
    (3, 5, 7, 3, 2, 1),             # stride != kernel, padded
    (2, 7, 6, (2, 3), None, 0),     # windows do not cover the last row
    (1, 6, 5, 3, 1, 1),             # overlapping windows
    (2, 9, 8, 3, 3, 2),
    (1, 5, 5, 2, 3, 0),             # stride > kernel: some inputs are never read
]
POOL_IDS = [f"c{c}-{h}x{w}-k{k}-s{s}-p{p}" for c, h, w, k, s, p in POOL_CASES]


def _pool_grad(windows_grad: np.ndarray, x_shape, kernel, stride, pad) -> np.ndarray:
    """Scatter-add per-window gradients ``(n, c, oh, ow, kh, kw)`` back onto the input."""
    (kh, kw), (sy, sx), (py, px) = pair(kernel), pair(stride), pair(pad)
    n, c, h, w = x_shape
    gp = np.zeros((n, c, h + 2 * py, w + 2 * px))
    for i in range(windows_grad.shape[2]):
        for j in range(windows_grad.shape[3]):
            gp[:, :, sy * i:sy * i + kh, sx * j:sx * j + kw] += windows_grad[:, :, i, j]
    return gp[:, :, py:py + h, px:px + w]


def _pool_net(layer, opt_level, c, h, w, kernel, stride, pad):
    """x -> ``layer`` (stride None: the layer's default, the kernel) -> WeightedSumLoss."""
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (c, h, w))
    pool = layer("pool", net, x, kernel, stride=stride, pad=pad)
    loss = WeightedSumLoss(net, "loss", pool)
    net.init()
    return net, x, pool, loss


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("c,h,w,kernel,stride,pad", POOL_CASES, ids=POOL_IDS)
def test_max_pooling(opt_level, c, h, w, kernel, stride, pad):
    rng = np.random.default_rng(21)
    net, x, pool, loss = _pool_net(MaxPoolingLayer, opt_level, c, h, w, kernel, stride, pad)
    # distinct values 0.05 apart: no ties, and no finite-difference step changes an arg-max;
    # mostly negative, so that padding read as zero would win
    n = BATCH * c * h * w
    xv = ((rng.permutation(n) - 0.9 * n) * 0.05).reshape(BATCH, c, h, w).astype(np.float32)
    net.value(x)[...] = xv
    net.forward()
    stride = stride or kernel
    win = _windows(xv, kernel, stride, pad, fill_value=-np.inf)
    ref = win.max(axis=(-2, -1))
    assert pool.shape == (c, *ref.shape[2:])
    np.testing.assert_array_equal(net.value(pool), ref)
    net.backward()
    hit = win == ref[..., None, None]
    ref_grad = _pool_grad(hit * loss.w[..., None, None], xv.shape, kernel, stride, pad)
    np.testing.assert_allclose(net.grad(x), ref_grad, rtol=1e-6)
    check_gradients(net, [x])


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("c,h,w,kernel,stride,pad", POOL_CASES, ids=POOL_IDS)
def test_mean_pooling(opt_level, c, h, w, kernel, stride, pad):
    rng = np.random.default_rng(22)
    net, x, pool, loss = _pool_net(MeanPoolingLayer, opt_level, c, h, w, kernel, stride, pad)
    xv = fill(net, x, rng)
    net.forward()
    kh, kw = pair(kernel)
    stride = stride or kernel
    win = _windows(xv, kernel, stride, pad)
    np.testing.assert_allclose(net.value(pool), win.sum(axis=(-2, -1)) / (kh * kw),
                               rtol=1e-5, atol=1e-6)   # padding counts in the divisor
    net.backward()
    per_window = np.broadcast_to(loss.w[..., None, None] / (kh * kw), win.shape)
    ref_grad = _pool_grad(per_window, xv.shape, kernel, stride, pad)
    np.testing.assert_allclose(net.grad(x), ref_grad, rtol=1e-5, atol=1e-6)
    check_gradients(net, [x])


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_brainslug_pooling_example(opt_level):
    net = Net(1, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (1, 4, 4))
    max_pool = MaxPoolingLayer("max", net, x, 2)
    mean_pool = MeanPoolingLayer("mean", net, x, 2)
    net.value(x)[0, 0] = [[1, 2, 2, 5], [3, 2, 2, 3], [7, 3, 4, 8], [5, 9, 6, 2]]
    net.forward()
    np.testing.assert_array_equal(net.value(max_pool)[0, 0], [[3, 5], [9, 8]])
    np.testing.assert_array_equal(net.value(mean_pool)[0, 0], [[2, 3], [6, 5]])
    # the arg-max (row-major in the window) is per batch item state
    np.testing.assert_array_equal(net.field(max_pool, "argmax")[0, 0, ..., 0], [[2, 1], [3, 1]])


def test_window_errors():
    net = Net(1)
    x = MemoryDataLayer(net, "x", (1, 4, 4))
    with pytest.raises(ShapeError, match="does not fit"):
        ConvolutionLayer("conv", net, x, 2, 5)
    with pytest.raises(ShapeError, match="smaller than the kernel"):
        MaxPoolingLayer("pool", net, x, 2, pad=2)
    with pytest.raises(ShapeError, match="kernel"):
        MeanPoolingLayer("pool", net, x, (2, 2, 2))
    flat = MemoryDataLayer(net, "flat", (16,))
    with pytest.raises(ShapeError, match="channels, height, width"):
        ConvolutionLayer("conv", net, flat, 2, 3)
    with pytest.raises(ValueError, match="ratio"):
        DropoutLayer("drop", net, x, ratio=1.0)


def _dropout_net(seed, ratio, opt_level=0, shape=(8, 10, 10)):
    net = Net(16, opt_level=opt_level, seed=seed)
    x = MemoryDataLayer(net, "x", shape)
    drop = DropoutLayer("drop", net, x, ratio=ratio)
    loss = WeightedSumLoss(net, "loss", drop)
    net.init()
    return net, x, drop, loss


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_dropout_masks(opt_level):
    ratio = 0.3
    net, x, drop, _ = _dropout_net(5, ratio, opt_level)
    xv = fill(net, x, np.random.default_rng(23))
    masks = []
    for _ in range(3):
        net.forward(Phase.TRAIN)
        mask = net.field(drop, "mask")[..., 0].copy()
        masks.append(mask)
        assert set(np.unique(mask)) == {0.0, np.float32(1.0 / (1.0 - ratio))}
        assert abs((mask == 0).mean() - ratio) < 0.03     # 12800 draws: sd 0.004
        np.testing.assert_allclose(net.value(drop), xv * mask, rtol=1e-6)
    assert not np.array_equal(masks[0], masks[1])          # redrawn every iteration
    assert not np.array_equal(masks[0][0], masks[0][1])    # per batch item
    net.forward(Phase.TEST)
    np.testing.assert_array_equal(net.value(drop), xv)     # identity at test time
    net.forward(Phase.TRAIN)
    assert (net.field(drop, "mask") == 0).any()

    again, x2, drop2, _ = _dropout_net(5, ratio, opt_level)
    other, x3, drop3, _ = _dropout_net(6, ratio, opt_level)
    for i in range(2):
        again.forward(Phase.TRAIN)
        other.forward(Phase.TRAIN)
        np.testing.assert_array_equal(again.field(drop2, "mask")[..., 0], masks[i])
        assert not np.array_equal(other.field(drop3, "mask")[..., 0], masks[i])


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_dropout_gradient(opt_level):
    net, x, drop, loss = _dropout_net(7, 0.5, opt_level, shape=(3, 4, 5))
    fill(net, x, np.random.default_rng(24))
    net.forward(Phase.TRAIN)
    net.backward()
    mask = net.field(drop, "mask")[..., 0]
    assert (mask == 0).any() and (mask == 2.0).any()
    np.testing.assert_allclose(net.grad(x), loss.w * mask, rtol=1e-6)
    assert not net.grad(x)[mask == 0].any()                # dropped units get no gradient
    net.forward(Phase.TEST)
    net.backward()
    np.testing.assert_allclose(net.grad(x), loss.w, rtol=1e-6)


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("pooling", [MaxPoolingLayer, MeanPoolingLayer], ids=["max", "mean"])
def test_small_convnet_gradients(opt_level, pooling):
    rng = np.random.default_rng(25)
    net = Net(BATCH, opt_level=opt_level, seed=25)
    x = MemoryDataLayer(net, "x", (2, 8, 7))
    label = MemoryDataLayer(net, "label", (1,))
    conv = ConvolutionLayer("conv", net, x, 3, 3, pad=1)
    relu = ReLULayer("relu", net, conv)
    pool = pooling("pool", net, relu, 2)
    fc = FullyConnectedLayer("fc", net, pool, 5)
    SoftmaxLossLayer("loss", net, fc, label)
    net.init()
    set_biases(net, rng, scale=0.1)
    fill(net, x, rng)
    fill_labels(net, label, 5, rng)
    assert pool.shape == (3, 4, 3)
    check_gradients(net, [x], eps=1e-3, max_entries=12)
