"""User-defined neuron types (written here, not in the stdlib) through the whole compiler."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import OPT_LEVELS, WeightedSumLoss, check_gradients, fill

from latte import Batch, Ensemble, Field, Net, Neuron, Param, add_connections
from latte.stdlib import MemoryDataLayer

BATCH = 4


class SquareNeuron(Neuron):
    """``a = sum_i w[i] * x[i]**2``; ``value = a + bias`` if ``a > 0`` else ``0.5 * a + bias``."""

    weights: Param
    bias: Param(lr_mult=2.0, decay_mult=0.0)

    def forward(self):
        acc = 0.0
        for i in range(len(self.inputs[0])):
            x = self.inputs[0][i]
            acc += self.weights[i] * x * x
        if acc > 0.0:
            self.value = acc + self.bias[0]
        else:
            self.value = 0.5 * acc + self.bias[0]

    def backward(self):
        acc = 0.0
        for i in range(len(self.inputs[0])):
            acc += self.weights[i] * self.inputs[0][i] * self.inputs[0][i]
        slope = 1.0 if acc > 0.0 else 0.5
        g = slope * self.grad
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += 2.0 * g * self.weights[i] * self.inputs[0][i]
            self.grad_weights[i] += g * self.inputs[0][i] * self.inputs[0][i]
        self.grad_bias[0] += self.grad


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_square_neuron_with_locals_and_branches(opt_level):
    rng = np.random.default_rng(10)
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (6,))
    w = rng.standard_normal((5, 6)).astype(np.float32)
    b = rng.standard_normal((5, 1)).astype(np.float32)
    sq = Ensemble(net, "sq", SquareNeuron, (5,), weights=w, bias=b)
    add_connections(net, x, sq, lambda o: (range(6),))
    WeightedSumLoss(net, "loss", sq)
    net.init()
    xv = fill(net, x, rng)
    net.forward()
    a = (xv[:, None, :] ** 2 * w[None]).sum(-1)
    assert (a > 0).any() and (a <= 0).any()  # both branches are exercised
    np.testing.assert_allclose(net.value(sq), np.where(a > 0, a, 0.5 * a) + b[:, 0],
                               rtol=1e-5, atol=1e-5)
    assert [(p.name, p.lr_mult, p.decay_mult) for p in net.params] == [
        ("sq.weights", 1.0, 1.0), ("sq.bias", 2.0, 0.0)]
    check_gradients(net, [x])


def test_parameters_live_in_the_ensembles_copy_not_the_users_array():
    """The compiled net keeps a parameter where its ensemble holds it (no second copy of the
    weights at init), and the array the user gave stays the user's."""
    rng = np.random.default_rng(3)
    net = Net(BATCH, opt_level=1)
    x = MemoryDataLayer(net, "x", (6,))
    w, b = np.ones((5, 6), np.float32), np.zeros((5, 1), np.float32)
    sq = Ensemble(net, "sq", SquareNeuron, (5,), weights=w, bias=b)
    add_connections(net, x, sq, lambda o: (range(6),))
    WeightedSumLoss(net, "loss", sq)
    net.init()
    weights = net.params[0]
    assert np.shares_memory(weights.value, sq.fields["weights"].array)
    assert not np.shares_memory(weights.value, w)
    assert weights.value.ctypes.data % 64 == 0
    fill(net, x, rng)
    net.forward()
    net.backward()
    net.update(0.1)
    assert not np.array_equal(weights.value, w)
    np.testing.assert_array_equal(w, 1.0)


class LocalNeuron(Neuron):
    """Locally connected: each neuron has its own weights over a window of the input."""

    weights: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.weights[i] * self.inputs[0][i]

    def backward(self):
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += self.weights[i] * self.grad
            self.grad_weights[i] += self.inputs[0][i] * self.grad


def _windows(x: np.ndarray, width: int, pad: int = 0, value: float = 0.0) -> np.ndarray:
    """``out[n, i, k] = xp[n, i + k]`` with ``xp`` padded by ``pad`` on both sides."""
    xp = np.pad(x, ((0, 0), (pad, pad)), constant_values=value)
    n_out = xp.shape[1] - width + 1
    return np.stack([xp[:, i:i + width] for i in range(n_out)], axis=1)


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_locally_connected_unshared_weights(opt_level):
    rng = np.random.default_rng(11)
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (9,))
    w = rng.standard_normal((7, 3)).astype(np.float32)
    loc = Ensemble(net, "loc", LocalNeuron, (7,), weights=w)
    add_connections(net, x, loc, lambda i: (range(i, i + 3),))
    WeightedSumLoss(net, "loss", loc)
    net.init()
    assert net.program.plans[0].accesses[0].table is None  # affine, no gather table
    xv = fill(net, x, rng)
    net.forward()
    np.testing.assert_allclose(net.value(loc), (_windows(xv, 3) * w).sum(-1), rtol=1e-5, atol=1e-6)
    check_gradients(net, [x])


class PairNeuron(Neuron):
    """``value = scale * a * (v . b)`` over two connections: one element of ``a``, all of ``b``."""

    v: Param
    scale: Field

    def forward(self):
        dot = 0.0
        for j in range(len(self.inputs[1])):
            dot += self.v[j] * self.inputs[1][j]
        self.value = self.scale * self.inputs[0][0] * dot

    def backward(self):
        dot = 0.0
        for j in range(len(self.inputs[1])):
            dot += self.v[j] * self.inputs[1][j]
        g = self.scale * self.grad
        self.grad_inputs[0][0] += g * dot
        for j in range(len(self.inputs[1])):
            self.grad_inputs[1][j] += g * self.inputs[0][0] * self.v[j]
            self.grad_v[j] += g * self.inputs[0][0] * self.inputs[1][j]


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_two_connections(opt_level):
    rng = np.random.default_rng(12)
    net = Net(BATCH, opt_level=opt_level)
    a = MemoryDataLayer(net, "a", (5,))
    b = MemoryDataLayer(net, "b", (3,))
    v = rng.standard_normal((1, 3)).astype(np.float32)
    scale = np.arange(1, 6, dtype=np.float32).reshape(5, 1)
    pair = Ensemble(net, "pair", PairNeuron, (5,), v=(v, lambda i: 0), scale=scale)
    add_connections(net, a, pair, lambda i: (i,))
    add_connections(net, b, pair, lambda i: (range(3),))
    WeightedSumLoss(net, "loss", pair)
    net.init()
    assert net.params[0].value.shape == (1, 3)  # one vector shared by every neuron
    av, bv = fill(net, a, rng), fill(net, b, rng)
    net.forward()
    np.testing.assert_allclose(net.value(pair), scale[:, 0] * av * (bv @ v[0])[:, None],
                               rtol=1e-5, atol=1e-6)
    check_gradients(net, [a, b])


class ConvNeuron(Neuron):
    """1-D convolution with one filter shared by every position."""

    weights: Param

    def forward(self):
        for k in range(len(self.inputs[0])):
            self.value += self.weights[k] * self.inputs[0][k]

    def backward(self):
        for k in range(len(self.inputs[0])):
            self.grad_inputs[0][k] += self.weights[k] * self.grad
            self.grad_weights[k] += self.inputs[0][k] * self.grad


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("padding", [0.0, 2.5])
def test_padded_connection(opt_level, padding):
    rng = np.random.default_rng(13)
    n = 6
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (n,))
    w = rng.standard_normal((1, 3)).astype(np.float32)
    conv = Ensemble(net, "conv", ConvNeuron, (n,), weights=(w, lambda i: 0))
    add_connections(net, x, conv, lambda i: (range(i - 1, i + 2),), padding=padding)
    WeightedSumLoss(net, "loss", conv)
    net.init()
    assert not net.program.plans[0].accesses[0].in_bounds
    xv = fill(net, x, rng)
    net.forward()
    ref = (_windows(xv, 3, pad=1, value=padding) * w[0]).sum(-1)
    np.testing.assert_allclose(net.value(conv), ref, rtol=1e-5, atol=1e-5)
    check_gradients(net, [x])


class CopyNeuron(Neuron):
    """``value = gain * input``: a gather when the mapping is not affine."""

    gain: Field

    def forward(self):
        self.value = self.gain * self.inputs[0][0]

    def backward(self):
        self.grad_inputs[0][0] += self.gain * self.grad


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("shift,padding", [(0, None), (1, 0.5)], ids=["in-bounds", "padded"])
def test_non_affine_mapping_uses_a_gather_table(opt_level, shift, padding):
    rng = np.random.default_rng(14)
    n = 7
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (n,))
    gain = np.full((n, 1), 1.5, np.float32)
    sq = Ensemble(net, "sq", CopyNeuron, (n,), gain=gain)
    add_connections(net, x, sq, lambda i: ((i * i) % n - shift,), padding=padding)
    loss = WeightedSumLoss(net, "loss", sq)
    net.init()
    src = np.array([(i * i) % n - shift for i in range(n)])
    access = net.program.plans[0].accesses[0]
    assert access.dims is None and access.in_bounds == (padding is None)
    np.testing.assert_array_equal(access.table[:, 0], np.where(src >= 0, src, -1))
    xv = fill(net, x, rng)
    net.forward()
    ok = src >= 0
    ref = np.where(ok, xv[:, np.maximum(src, 0)], padding or 0.0)
    np.testing.assert_allclose(net.value(sq), 1.5 * ref, rtol=1e-6)
    net.backward()
    ref_grad = np.zeros_like(xv)
    np.add.at(ref_grad, (slice(None), src[ok]), 1.5 * loss.w[:, ok])  # repeats accumulate
    np.testing.assert_allclose(net.grad(x), ref_grad, rtol=1e-5, atol=1e-6)
    check_gradients(net, [x])


class MathNeuron(Neuron):
    """Exercises the math subset: exp, log, sqrt, tanh, abs, min, max and a module-level constant."""

    def forward(self):
        u = self.inputs[0][0]
        self.value = (math.exp(-abs(u)) + math.log(1.0 + u * u) + math.sqrt(u * u + 1.0)
                      + math.tanh(u) + min(u, 0.5) + max(u, -0.5) + OFFSET)


OFFSET = 0.25


def test_math_builtins():
    rng = np.random.default_rng(15)
    net = Net(BATCH, opt_level=0)
    x = MemoryDataLayer(net, "x", (5,))
    out = Ensemble(net, "out", MathNeuron, (5,))
    add_connections(net, x, out, lambda i: (i,))
    net.init()
    u = fill(net, x, rng).astype(np.float64)
    net.forward()
    ref = (np.exp(-abs(u)) + np.log1p(u * u) + np.sqrt(u * u + 1) + np.tanh(u)
           + np.minimum(u, 0.5) + np.maximum(u, -0.5) + OFFSET)
    np.testing.assert_allclose(net.value(out), ref, rtol=1e-5, atol=1e-6)


class FilterNeuron(Neuron):
    """A 2-D convolution neuron: one filter (and bias) per output channel."""

    weights: Param
    bias: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.weights[i] * self.inputs[0][i]
        self.value += self.bias[0]

    def backward(self):
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += self.weights[i] * self.grad
            self.grad_weights[i] += self.inputs[0][i] * self.grad
        self.grad_bias[0] += self.grad


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("stride,pad", [(1, 0), (2, 1)])
def test_convolution_with_shared_filters(opt_level, stride, pad):
    rng = np.random.default_rng(16)
    c_in, size, c_out, k = 2, 5, 3, 3
    out = (size + 2 * pad - k) // stride + 1
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (c_in, size, size))
    w = rng.standard_normal((c_out, c_in * k * k)).astype(np.float32)
    b = rng.standard_normal((c_out, 1)).astype(np.float32)
    conv = Ensemble(net, "conv", FilterNeuron, (c_out, out, out),
                    weights=(w, lambda o, y, x: o), bias=(b, lambda o, y, x: o))
    add_connections(net, x, conv, lambda o, y, x: (
        range(c_in), range(stride * y - pad, stride * y - pad + k),
        range(stride * x - pad, stride * x - pad + k)), padding=0.0 if pad else None)
    WeightedSumLoss(net, "loss", conv)
    net.init()
    assert net.program.plans[0].accesses[0].shared_dims() == (0,)
    xv = fill(net, x, rng)
    net.forward()
    xp = np.pad(xv, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    cols = np.stack([xp[:, :, stride * i:stride * i + k, stride * j:stride * j + k].reshape(BATCH, -1)
                     for i in range(out) for j in range(out)], axis=1)  # (batch, out*out, c_in*k*k)
    ref = (cols @ w.T + b[:, 0]).transpose(0, 2, 1).reshape(BATCH, c_out, out, out)
    np.testing.assert_allclose(net.value(conv), ref, rtol=1e-4, atol=1e-5)
    check_gradients(net, [x])


class MinAbsNeuron(Neuron):
    """The window entry of least magnitude; its position is per batch item state (a ``Batch``
    field), and backward sends the gradient there with the entry's sign. (Unlike the stdlib's
    max-pool, the branch lives in backward.)"""

    argmin: Batch

    def forward(self):
        best = abs(self.inputs[0][0])
        arg = 0
        for i in range(len(self.inputs[0])):
            if abs(self.inputs[0][i]) < best:
                best = abs(self.inputs[0][i])
                arg = i
        self.value = best
        self.argmin = arg

    def backward(self):
        for i in range(len(self.inputs[0])):
            if i == self.argmin:
                if self.inputs[0][i] < 0.0:
                    self.grad_inputs[0][i] += -self.grad
                else:
                    self.grad_inputs[0][i] += self.grad


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_batch_field_holds_per_item_state(opt_level):
    rng = np.random.default_rng(17)
    net = Net(BATCH, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (2, 6))
    pool = Ensemble(net, "pool", MinAbsNeuron, (2, 3), argmin=np.zeros((2, 3), np.float32))
    add_connections(net, x, pool, lambda c, i: (c, range(2 * i, 2 * i + 2)))
    loss = WeightedSumLoss(net, "loss", pool)
    net.init()
    xv = fill(net, x, rng)
    net.forward()
    windows = xv.reshape(BATCH, 2, 3, 2)
    mags = np.abs(windows)
    np.testing.assert_array_equal(net.value(pool), mags.min(-1))
    net.backward()
    ref = (mags == mags.min(-1, keepdims=True)) * np.sign(windows) * loss.w[..., None]
    np.testing.assert_allclose(net.grad(x), ref.reshape(BATCH, 2, 6), rtol=1e-6)
    check_gradients(net, [x])


class FloorDivNeuron(Neuron):
    """Integer ``//`` and ``%`` of negative numbers floor, as in Python."""

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += ((i - 3) // 2) * self.inputs[0][i] + ((i - 3) % 2) + ((i + 1) % -3)


@pytest.mark.parametrize("opt_level", (0, 3))
def test_integer_division_floors_like_python(opt_level):
    net = Net(2, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (6,))
    Ensemble(net, "e", FloorDivNeuron, (1,))
    add_connections(net, x, net.ensemble("e"), lambda i: (range(6),))
    net.init()
    xv = fill(net, x, np.random.default_rng(0))
    net.forward()
    i = np.arange(6)
    want = (((i - 3) // 2) * xv + (i - 3) % 2 + (i + 1) % -3).sum(axis=1)
    np.testing.assert_allclose(net.value("e")[:, 0], want, rtol=1e-5)
