"""Runtime: checkpoints, views, data layers, the compile cache, solver policies and updates."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from helpers import fill, fill_labels

from latte import Net, Phase
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import (
    AccuracyLayer,
    ArrayDataLayer,
    FullyConnectedLayer,
    HDF5DataLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
)

BATCH = 4


def _fc_net(seed: int = 0, n_out: int = 3, opt_level: int = 1):
    net = Net(BATCH, seed=seed, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (2, 3, 3))
    label = MemoryDataLayer(net, "label", (1,))
    fc = FullyConnectedLayer("fc", net, x, n_out)
    relu = ReLULayer("relu", net, fc)
    SoftmaxLossLayer("loss", net, relu, label)
    net.init()
    rng = np.random.default_rng(seed)
    fill(net, x, rng)
    fill_labels(net, label, n_out, rng)
    return net


def test_views_have_logical_shapes_and_are_live():
    net = _fc_net()
    assert net.value("x").shape == net.grad("x").shape == (BATCH, 2, 3, 3)
    assert net.value("fc").shape == net.grad("fc").shape == (BATCH, 3)
    assert net.value("relu").shape == (BATCH, 3)
    assert np.shares_memory(net.value("relu"), net.value("fc"))  # in place
    assert net.value("label").shape == (BATCH, 1)
    assert [(p.name, p.value.shape, p.grad.shape) for p in net.params] == [
        ("fc.weights", (3, 18), (3, 18)), ("fc.bias", (3, 1), (3, 1))]
    net.params[1].value[...] = 100.0  # writing .value changes the net
    net.forward()
    assert net.value("fc").min() > 50.0


def test_save_load_round_trip(tmp_path):
    net = _fc_net()
    net.forward()
    net.backward()
    net.update(0.1, 0.9)  # non-zero momentum history
    net.solver_state = {"iteration": 7, "epoch": 1}
    path = tmp_path / "ckpt.npz"
    net.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]  # no temp file left
    saved = [p.value.copy() for p in net.params]
    net.update(0.1, 0.9)
    after_second_update = [p.value.copy() for p in net.params]

    for p in net.params:
        p.value[...] = 0.0
    net.solver_state = {}
    net.load(path)
    for p, v in zip(net.params, saved):
        np.testing.assert_array_equal(p.value, v)
    assert net.solver_state == {"iteration": 7, "epoch": 1}
    net.update(0.1, 0.9)  # the restored momentum history gives the same step again
    for p, v in zip(net.params, after_second_update):
        np.testing.assert_allclose(p.value, v, rtol=1e-6, atol=1e-7)

    other = _fc_net(seed=5)  # a fresh net of the same architecture
    other.load(path)
    for p, v in zip(other.params, saved):
        np.testing.assert_array_equal(p.value, v)


def test_save_overwrites_atomically(tmp_path):
    net = _fc_net()
    path = tmp_path / "ckpt.npz"
    net.save(path)
    net.params[0].value[...] = 1.5
    net.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]
    net.params[0].value[...] = 0.0
    net.load(path)
    assert (net.params[0].value == 1.5).all()


def _data(n: int = 10, seed: int = 3):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 2, 3)).astype(np.float32), rng.integers(0, 3, n)


def _data_net(make_layer):
    net = Net(BATCH, seed=11, opt_level=0)
    data, label = make_layer(net)
    fc = FullyConnectedLayer("fc", net, data, 3)
    SoftmaxLossLayer("loss", net, fc, label)
    AccuracyLayer("accuracy", net, fc, label)
    return net, data, label


def test_hdf5_matches_array_data_layer(tmp_path):
    x, y = _data()
    xt, yt = _data(6, seed=4)
    for name, (a, b) in {"train.h5": (x, y), "test.h5": (xt, yt)}.items():
        with h5py.File(tmp_path / name, "w") as f:
            f["data"], f["label"] = a, b
    h5net, h5data, h5label = _data_net(
        lambda net: HDF5DataLayer(net, tmp_path / "train.h5", tmp_path / "test.h5", shuffle=False))
    arrnet, arrdata, arrlabel = _data_net(
        lambda net: ArrayDataLayer(net, (x, y), test=(xt, yt), shuffle=False))
    assert h5data.shape == arrdata.shape == (2, 3)
    for step in range(4):  # batches walk the set in order; the last is partial (2 of 4)
        idx = (np.arange(BATCH) + BATCH * (step % 3)) % len(x)
        for net, data, label in ((h5net, h5data, h5label), (arrnet, arrdata, arrlabel)):
            net.forward()
            assert net.valid == (2 if step == 2 else BATCH)
            np.testing.assert_array_equal(net.value(data), x[idx])
            np.testing.assert_array_equal(net.value(label)[:, 0], y[idx])
        assert h5net.loss == arrnet.loss
    params = SolverParameters(LRPolicy.Fixed(0.1), MomPolicy.Fixed(0.5), max_epoch=2)
    h5hist, arrhist = solve(SGD(params), h5net), solve(SGD(params), arrnet)
    assert len(h5hist.train_loss) == 2 * -(-len(x) // BATCH)
    assert h5hist.train_loss == arrhist.train_loss
    assert len(h5hist.test_accuracy) == 2 and h5hist.test_accuracy == arrhist.test_accuracy
    for p, q in zip(h5net.params, arrnet.params):
        np.testing.assert_array_equal(p.value, q.value)


def test_test_phase_reports_a_partial_last_batch():
    x, y = _data()
    net, data, _ = _data_net(lambda net: ArrayDataLayer(net, (x, y), test=(x[:6], y[:6]),
                                                        shuffle=False))
    net.forward(Phase.TEST)
    assert net.valid == BATCH
    net.forward(Phase.TEST)
    assert net.valid == 2
    np.testing.assert_array_equal(net.value(data)[:2], x[4:6])


def test_disk_cache_hit_on_second_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    first = _fc_net(n_out=5)
    assert first.program.library.from_cache is False
    assert len(list(tmp_path.glob("*.o"))) == 1
    second = _fc_net(n_out=5)
    assert second.program.library.from_cache is True
    assert second.program.library.key == first.program.library.key
    for net in (first, second):
        net.forward()
        net.backward()
    assert second.loss == first.loss
    for p, q in zip(first.params, second.params):
        np.testing.assert_array_equal(p.grad, q.grad)
    assert _fc_net(n_out=4).program.library.from_cache is False  # another net, another key


def test_lr_policies():
    its = np.arange(0, 50, 7)
    cases = {
        LRPolicy.Fixed(0.1): 0.1 + 0 * its,
        LRPolicy.Step(0.1, 0.5, 10): 0.1 * 0.5 ** (its // 10),
        LRPolicy.Exp(0.1, 0.9): 0.1 * 0.9 ** its,
        LRPolicy.Inv(0.01, 1e-4, 0.75): 0.01 * (1 + 1e-4 * its) ** -0.75,
        LRPolicy.Decay(0.1, 0.5): 0.1 / (1 + 0.5 * its),
        LRPolicy.Poly(0.1, 40, 2.0): 0.1 * np.maximum(0.0, 1 - its / 40) ** 2.0,
    }
    for policy, expected in cases.items():
        np.testing.assert_allclose([policy(int(i)) for i in its], expected, rtol=1e-12,
                                   err_msg=repr(policy))


def test_momentum_policies():
    its = np.arange(0, 60, 5)
    cases = {
        MomPolicy.Fixed(0.9): 0.9 + 0 * its,
        MomPolicy.Step(0.5, 1.5, 10, 0.95): np.minimum(0.95, 0.5 * 1.5 ** (its // 10)),
        MomPolicy.Linear(0.5, 0.1, 10, 0.9): np.minimum(0.9, 0.5 + 0.1 * (its // 10)),
    }
    for policy, expected in cases.items():
        np.testing.assert_allclose([policy(int(i)) for i in its], expected, rtol=1e-12,
                                   err_msg=repr(policy))


def test_update_applies_lr_and_decay_multipliers():
    net = _fc_net()
    for p in net.params:
        p.value[...] = np.random.default_rng(1).standard_normal(p.value.shape)
    lr, mom, regu = 0.05, 0.9, 0.01
    value = {p.name: p.value.astype(np.float64) for p in net.params}
    hist = {p.name: np.zeros_like(value[p.name]) for p in net.params}
    mults = {"fc.weights": (1.0, 1.0), "fc.bias": (2.0, 0.0)}
    assert {p.name: (p.lr_mult, p.decay_mult) for p in net.params} == mults
    for _ in range(3):
        net.forward()
        net.backward()
        for p in net.params:
            lr_mult, decay_mult = mults[p.name]
            hist[p.name] = mom * hist[p.name] + lr * lr_mult * (
                p.grad + regu * decay_mult * value[p.name])
            value[p.name] = value[p.name] - hist[p.name]
        net.update(lr, mom, regu)
        for p in net.params:
            np.testing.assert_allclose(p.value, value[p.name], rtol=1e-5, atol=1e-6,
                                       err_msg=p.name)


def test_solve_decreases_the_loss():
    rng = np.random.default_rng(0)
    centers = 3 * rng.standard_normal((3, 2, 3))
    y = rng.integers(0, 3, 48)
    x = (centers[y] + 0.3 * rng.standard_normal((48, 2, 3))).astype(np.float32)
    net, _, _ = _data_net(lambda net: ArrayDataLayer(net, (x, y), test=(x, y)))
    params = SolverParameters(LRPolicy.Fixed(0.05), MomPolicy.Fixed(0.9), max_epoch=4)
    hist = solve(SGD(params), net)
    assert len(hist.train_loss) == 4 * 12 and len(hist.test_accuracy) == 4
    assert np.mean(hist.train_loss[-6:]) < 0.5 * np.mean(hist.train_loss[:6])
    assert hist.test_accuracy[-1] >= 0.9
    assert net.solver_state == {"iteration": 48, "epoch": 4}


@pytest.mark.parametrize("bad", [-1, 4])
def test_opt_level_is_checked(bad):
    with pytest.raises(ValueError, match="opt_level"):
        Net(2, opt_level=bad)


def test_test_accuracy_without_accuracy_layer():
    """With a test set but no AccuracyLayer, accuracy comes from the softmax loss's arg-max."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    net = Net(8, seed=0)
    data, label = ArrayDataLayer(net, (x, y), test=(x, y), shuffle=False)
    loss = SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, data, 2), label)
    history = solve(SGD(SolverParameters(lr_policy=LRPolicy.Fixed(0.5), max_epoch=3)), net)
    assert len(history.test_accuracy) == 3
    net.forward(Phase.TEST)
    logits = net.value(loss.inputs[0])
    expected = (logits.argmax(axis=1) == y[:8]).mean()
    assert loss.counts[1] == 8 and loss.counts[0] / 8 == pytest.approx(expected)
