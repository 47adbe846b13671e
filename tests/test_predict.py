"""``net.predict``: a test-phase forward over any number of samples, batch by batch, that
leaves training alone."""

from __future__ import annotations

import numpy as np
import pytest

from latte import Net, Phase
from latte.errors import LatteError, ShapeError
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import (
    AccuracyLayer,
    AddLayer,
    ArrayDataLayer,
    BatchNormLayer,
    ConvolutionLayer,
    DropoutLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    RNNLayer,
    SoftmaxLossLayer,
)

BATCH = 8
RNG = np.random.default_rng(0)
X_IMG = RNG.standard_normal((27, 3, 8, 8)).astype(np.float32)
Y_IMG = RNG.integers(0, 5, 27)
X_VEC = RNG.standard_normal((27, 12)).astype(np.float32)


def mlp(opt_level: int, x=X_VEC, y=Y_IMG, **net_kwargs):
    net = Net(BATCH, opt_level=opt_level, seed=3, **net_kwargs)
    data, label = ArrayDataLayer(net, (x, y), test=(x, y), shuffle=True)
    h = ReLULayer("relu1", net, FullyConnectedLayer("ip1", net, data, 16))
    out = FullyConnectedLayer("ip2", net, DropoutLayer("drop", net, h, 0.3), 5)
    SoftmaxLossLayer("loss", net, out, label)
    AccuracyLayer("acc", net, out, label)
    return net


def conv_net(opt_level: int, x=X_IMG, y=Y_IMG):
    net = Net(BATCH, opt_level=opt_level, seed=3)
    data, label = ArrayDataLayer(net, (x, y), test=(x, y), shuffle=False)
    c = ConvolutionLayer("conv1", net, data, 4, 3, pad=1)
    r = ReLULayer("relu1", net, BatchNormLayer("bn1", net, c))
    p = MaxPoolingLayer("pool1", net, ConvolutionLayer("conv2", net, r, 4, 3, pad=1), 2)
    out = FullyConnectedLayer("ip", net, DropoutLayer("drop", net, p, 0.5), 5)
    SoftmaxLossLayer("loss", net, out, label)
    return net


def values_of_test_pass(net, name: str, n: int) -> np.ndarray:
    """``name``'s values over the test set's first ``n`` samples from forward(TEST)."""
    for s in net.data_sources():
        s.reset(Phase.TEST)
    rows = []
    while sum(len(r) for r in rows) < n:
        net.forward(Phase.TEST)
        rows.append(net.value(name)[:net.valid].copy())
    return np.concatenate(rows)[:n]


@pytest.mark.parametrize("opt_level", [0, 3])
@pytest.mark.parametrize("build", [mlp, conv_net])
def test_predict_equals_the_test_pass(build, opt_level):
    net = build(opt_level)
    x = X_VEC if build is mlp else X_IMG
    net.init()
    for p in net.params:   # trained-looking weights and statistics, not the initial ones
        p.value[...] += RNG.standard_normal(p.value.shape).astype(np.float32) * 0.1
    for a in net.state.values():
        a[...] = RNG.uniform(0.5, 1.5, a.shape).astype(np.float32)
    program = net.program
    expected = values_of_test_pass(net, "ip" if build is conv_net else "ip2", len(x))
    for n in (3, BATCH, 2 * BATCH, len(x)):   # fewer than a batch, one, two, not a multiple
        got = net.predict(x[:n])
        assert got.dtype == np.float32 and got.shape == (n, 5)
        np.testing.assert_array_equal(got, expected[:n])
    assert net.program is program   # nothing recompiled


def test_every_ensemble_at_opt_3_matches_opt_0():
    """Inside a fused group the test program keeps values in line buffers; predict still
    returns them (from the forward steps run in the test phase)."""
    nets = [conv_net(level) for level in (0, 3)]
    for net in nets:
        net.init()
    for a, b in zip(nets[0].params + [*nets[0].state.values()],
                    nets[1].params + [*nets[1].state.values()]):
        a, b = (getattr(a, "value", a), getattr(b, "value", b))
        a[...] = b[...] = RNG.uniform(0.5, 1.5, a.shape).astype(np.float32)
    for name in ("conv1", "bn1", "conv2", "pool1", "drop", "ip"):
        ref, got = (net.predict(X_IMG[:11], name) for net in nets)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                   err_msg=name)


@pytest.mark.parametrize("opt_level", [0, 3])
def test_sequences(opt_level):
    """With time steps, samples are (n, T, *shape) and so is the result."""
    x = RNG.standard_normal((10, 3, 5)).astype(np.float32)
    y = RNG.integers(0, 3, (10, 3))
    net = Net(4, time_steps=3, seed=1, opt_level=opt_level)
    data, label = ArrayDataLayer(net, (x, y), test=(x, y), shuffle=False)
    out = FullyConnectedLayer("out", net, RNNLayer("rnn", net, data, 6), 3)
    SoftmaxLossLayer("loss", net, out, label)
    net.init()
    expected = []
    for _ in range(3):   # 4 + 4 + 2 sequences
        net.forward(Phase.TEST)
        expected.append(net.value(out)[:, :net.valid].swapaxes(0, 1).copy())
    got = net.predict(x)
    assert got.shape == (10, 3, 3)
    np.testing.assert_array_equal(got, np.concatenate(expected))
    assert net.predict(x[:1], "rnn").shape == (1, 3, 6)
    with pytest.raises(ShapeError, match=r"samples of shape \(3, 5\)"):
        net.predict(x[:, 0])


def test_memory_data_layer_and_the_last_ensemble():
    net = Net(4, seed=1)
    inp = MemoryDataLayer(net, "x", (6,))
    h = FullyConnectedLayer("ip", net, inp, 3)
    net.init()
    x = RNG.standard_normal((9, 6)).astype(np.float32)
    w, b = (p.value for p in net.params)
    b[...] = RNG.standard_normal(b.shape)
    expected = x.astype(np.float64) @ w.T.astype(np.float64) + b.reshape(-1)
    got = net.predict(x)   # no loss: the last ensemble added
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(net.predict(x, h), got)


def test_predict_leaves_training_alone():
    """A run with predict calls between its steps is bitwise the run without them
    (shuffling, dropout, the read-ahead batch and the parameters)."""
    def run(with_predict: bool):
        net = mlp(2, deterministic=True, num_threads=1)
        params = SolverParameters(lr_policy=LRPolicy.Fixed(0.05),
                                  mom_policy=MomPolicy.Fixed(0.9), max_epoch=3)

        def progress(event, **info):
            if with_predict:
                net.predict(X_VEC[:5])
        history = solve(SGD(params), net, progress=progress)
        return history.train_loss, [p.value.copy() for p in net.params]

    (loss_a, params_a), (loss_b, params_b) = run(False), run(True)
    assert loss_a == loss_b
    for a, b in zip(params_a, params_b):
        np.testing.assert_array_equal(a, b)


def test_errors_name_what_is_wrong():
    net = mlp(0)
    with pytest.raises(ShapeError, match=r"'data' takes samples of shape \(12,\)"):
        net.predict(X_VEC[:, :5])
    with pytest.raises(ShapeError, match="samples of shape"):
        net.predict(X_VEC[0])   # one sample without its leading n
    with pytest.raises(LatteError, match="no ensemble named 'nope'"):
        net.predict(X_VEC, "nope")
    with pytest.raises(LatteError, match=r"2 input ensembles \('data', 'label'\)"):
        net.predict(X_VEC, "loss")

    two = Net(4)
    a, b = MemoryDataLayer(two, "a", (3,)), MemoryDataLayer(two, "b", (3,))
    AddLayer("sum", two, a, b)
    with pytest.raises(LatteError, match=r"2 input ensembles \('a', 'b'\)"):
        two.predict(np.zeros((2, 3), np.float32))
