"""``Net(profile=True)``: per-ensemble time, without changing what the net computes."""

from __future__ import annotations

import numpy as np
import pytest

from latte import Net, Phase
from latte.runtime.profile import Profile
from latte.stdlib import ArrayDataLayer, FullyConnectedLayer, ReLULayer, SoftmaxLossLayer


def _mlp(profile: bool, opt_level: int = 3) -> Net:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 12)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    net = Net(16, num_threads=1, seed=0, opt_level=opt_level, profile=profile)
    data, label = ArrayDataLayer(net, (X, y), test=(X[:16], y[:16]), shuffle=False)
    h = ReLULayer("relu", net, FullyConnectedLayer("ip1", net, data, 10))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("ip2", net, h, 3), label)
    net.init()
    return net


def _train(net: Net, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        net.forward()
        net.backward()
        net.update(0.1, 0.9, 0.001)
        losses.append(net.loss)
    return losses


@pytest.mark.parametrize("opt_level", [0, 3])
def test_profiling_changes_no_result(opt_level):
    plain, profiled = _mlp(False, opt_level), _mlp(True, opt_level)
    assert plain.profile is None and isinstance(profiled.profile, Profile)
    np.testing.assert_allclose(_train(profiled, 4), _train(plain, 4), rtol=1e-5)
    for a, b in zip(plain.params, profiled.params):
        np.testing.assert_allclose(a.value, b.value, rtol=1e-5, atol=1e-6)


def test_profile_times_each_ensemble_per_phase():
    net = _mlp(True)
    _train(net, 2)
    net.profile.reset()
    _train(net, 3)
    net.forward(Phase.TEST)
    prof = net.profile
    assert prof.calls == {"forward": 3, "backward": 3, "update": 3, "test": 1}
    ms = prof.ms_per_call()
    assert list(ms) == ["(data)", "ip1", "relu", "ip2", "loss", "(zero_grads)", "(sgd_update)"]
    for name in ("ip1", "relu", "ip2", "loss"):
        assert ms[name]["forward"] > 0 and ms[name]["backward"] > 0 and ms[name]["test"] > 0
    assert ms["(sgd_update)"]["update"] > 0 and ms["(sgd_update)"]["forward"] == 0
    assert prof.total_ms() == pytest.approx(sum(sum(c[p] for p in ("forward", "backward",
                                                                     "update"))
                                                for c in ms.values()))
    table = prof.format()
    assert "3 iterations" in table and "test-phase forward" in table
    assert all(f"  {name} " in table for name in ms)


def test_a_fused_group_is_one_row():
    from latte.stdlib import ConvolutionLayer, MaxPoolingLayer

    rng = np.random.default_rng(0)
    net = Net(4, num_threads=1, seed=0, profile=True)   # opt level 3: cross-layer fusion
    data, label = ArrayDataLayer(net, (rng.standard_normal((8, 3, 16, 16)).astype(np.float32),
                                       rng.integers(0, 3, 8)))
    conv = ConvolutionLayer("conv", net, data, 4, 3, pad=1)
    pool = MaxPoolingLayer("pool", net, ReLULayer("relu", net, conv), 2)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, pool, 3), label)
    net.init()
    _train(net, 2)
    names = [g.name for g in net.program.groups]
    assert names   # else the checks below hold vacuously
    ms = net.profile.ms_per_call()
    for group in names:   # one kernel runs every member: the row names them all
        assert ms[group]["forward"] > 0 and ms[group]["backward"] > 0
    fused = {member for group in names for member in group.split("+")}
    assert {"conv", "relu", "pool", "fc"} <= fused | set(ms)
    assert not fused & set(ms)
