"""In-place activations that follow each other or share their source with other readers
work on a copy (latte.lang.inplace); checked against float64 numpy at every opt level and
against the reference interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WeightedSumLoss

from latte import Net
from latte.lang.inplace import CopyNeuron
from latte.reference import Reference
from latte.stdlib import FullyConnectedLayer, MemoryDataLayer, ReLULayer, SigmoidLayer, TanhLayer

RNG = np.random.default_rng(7)
X = RNG.standard_normal((3, 5)).astype(np.float32)


def _build(level: int, kind: str):
    net = Net(3, opt_level=level, num_threads=2, seed=1)
    x = MemoryDataLayer(net, "x", (5,))
    fc = FullyConnectedLayer("fc", net, x, 6)
    outs = []
    if kind == "shared":        # fc is read by relu (in place) and by another layer
        outs += [ReLULayer("relu", net, fc), FullyConnectedLayer("other", net, fc, 2)]
    elif kind == "chain":       # relu -> tanh -> sigmoid, each in place on the one before
        outs.append(SigmoidLayer("sig", net, TanhLayer("tanh", net, ReLULayer("relu", net, fc))))
    else:                       # two activations of one source, both read further
        outs += [TanhLayer("tanh", net, fc), SigmoidLayer("sig", net, fc)]
    for i, o in enumerate(outs):
        WeightedSumLoss(net, f"loss{i}", o, seed=10 + i)
    return net, outs


def _numpy(net, kind: str):
    """Values of the outputs and d loss / d fc, in float64."""
    p = {q.name: q.value.astype(np.float64) for q in net.params}
    w = [e.w.astype(np.float64) for e in net.ensembles if isinstance(e, WeightedSumLoss)]
    fc = X @ p["fc.weights"].T + p["fc.bias"].T
    if kind == "shared":
        relu = np.maximum(fc, 0)
        other = fc @ p["other.weights"].T + p["other.bias"].T
        g = w[0] * (fc > 0) + w[1] @ p["other.weights"]
        return [relu, other], g
    if kind == "chain":
        r = np.maximum(fc, 0)
        t = np.tanh(r)
        s = 1 / (1 + np.exp(-t))
        g = w[0] * s * (1 - s) * (1 - t * t) * (fc > 0)
        return [s], g
    t, s = np.tanh(fc), 1 / (1 + np.exp(-fc))
    return [t, s], w[0] * (1 - t * t) + w[1] * s * (1 - s)


@pytest.mark.parametrize("kind", ["shared", "chain", "siblings"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_activations_that_may_not_work_in_place(kind, level):
    net, outs = _build(level, kind)
    net.init()
    net.value("x")[...] = X
    net.forward()
    net.backward()
    want, g_fc = _numpy(net, kind)
    for o, v in zip(outs, want):
        np.testing.assert_allclose(net.value(o), v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.grad("fc"), g_fc, rtol=1e-5, atol=1e-6)
    if kind != "chain":   # fc keeps its own values (in the chain relu works in place on it)
        fc_value = X @ net.params[0].value.T.astype(np.float64) + net.params[1].value.T
        np.testing.assert_allclose(net.value("fc"), fc_value, rtol=1e-5, atol=1e-6)
    copies = [e.name for e in net.ensembles if getattr(e, "neuron_type", None) is CopyNeuron]
    assert copies == {"shared": ["relu.in"], "chain": ["tanh.in", "sig.in"],
                      "siblings": ["tanh.in", "sig.in"]}[kind]


def test_reference_runs_the_same_copies():
    net, outs = _build(0, "chain")
    ref = Reference(net)   # before init: the reference gives the copies itself
    net.init()
    net.value("x")[...] = X
    net.forward()
    net.backward()
    ref.forward({"x": X})
    ref.backward()
    np.testing.assert_allclose(net.value(outs[0]), ref.values[outs[0].name], rtol=1e-5)
    np.testing.assert_allclose(net.grad("fc"), ref.grads["fc"], rtol=1e-5, atol=1e-7)


def test_a_sole_reader_stays_in_place():
    net, _ = _build(3, "siblings")
    x2 = MemoryDataLayer(net, "x2", (4,))
    ReLULayer("alone", net, FullyConnectedLayer("fc2", net, x2, 3))
    net.init()
    assert "alone.in" not in [e.name for e in net.ensembles]
