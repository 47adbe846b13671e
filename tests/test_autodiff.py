"""Derived backward (latte/compiler/autodiff.py): neurons that define only ``forward``.

Every stdlib neuron's derived backward gives the hand-written one's gradients at opt levels
0 and 3 (and the FC/conv one still becomes GEMMs); forward-only user neurons (locals,
if/else, every supported function, a running max, two connections from one source) match
central finite differences and opt level 0; what cannot be derived names its line.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from helpers import WeightedSumLoss, check_gradients, fill, set_biases

from latte import ActivationEnsemble, Batch, Ensemble, Net, Neuron, Param, add_connections
from latte.compiler.autodiff import derive_backward, format_neuron
from latte.compiler.explain import explain_program
from latte.compiler.frontend import NeuronInfo, parse_method
from latte.compiler.ir import Gemm, walk
from latte.errors import NeuronSyntaxError
from latte.lang import defines_backward
from latte.stdlib import (
    ConvolutionLayer,
    DropoutLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MeanPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    SigmoidLayer,
    TanhLayer,
    activations,
    convolution,
    dropout,
    fully_connected,
    pooling,
)

BATCH = 3
STDLIB = [(fully_connected, "WeightedNeuron"), (convolution, "WeightedNeuron"),
          (pooling, "MaxNeuron"), (pooling, "MeanNeuron"), (activations, "ReLUNeuron"),
          (activations, "TanhNeuron"), (activations, "SigmoidNeuron"), (dropout, "DropoutNeuron")]


def forward_only(cls: type) -> type:
    """``cls`` without its ``backward``: the same fields, the same ``forward``."""
    module = vars(sys.modules[cls.__module__])
    notes = {k: eval(v, module) if isinstance(v, str) else v   # noqa: S307 - stdlib annotations
             for k, v in vars(cls).get("__annotations__", {}).items()}
    return type(f"Derived{cls.__name__}", (Neuron,), {"forward": cls.forward,
                                                       "__annotations__": notes})


def stdlib_net(opt_level: int) -> tuple[Net, Ensemble]:
    """Conv, ReLU, max and mean pooling, FC, tanh, dropout, FC, sigmoid: every stdlib neuron."""
    net = Net(BATCH, opt_level=opt_level, seed=7)
    x = MemoryDataLayer(net, "x", (2, 7, 7))
    conv = ConvolutionLayer("conv", net, x, 4, 3, pad=1)
    relu = ReLULayer("relu", net, conv)
    pool = MaxPoolingLayer("pool", net, relu, 3, stride=2, pad=1)
    mean = MeanPoolingLayer("mean", net, pool, 2, stride=1)
    fc1 = FullyConnectedLayer("fc1", net, mean, 9)
    tanh = TanhLayer("tanh", net, fc1)
    drop = DropoutLayer("drop", net, tanh, 0.3)
    fc2 = FullyConnectedLayer("fc2", net, drop, 5)
    WeightedSumLoss(net, "loss", SigmoidLayer("sig", net, fc2))
    net.init()
    return net, x


def run_stdlib(opt_level: int, derived: bool, monkeypatch) -> dict[str, np.ndarray]:
    with monkeypatch.context() as m:
        if derived:
            for module, name in STDLIB:
                m.setattr(module, name, forward_only(getattr(module, name)))
        net, x = stdlib_net(opt_level)
    rng = np.random.default_rng(3)
    fill(net, x, rng)
    set_biases(net, rng, 0.1)
    net.forward()
    net.backward()
    out = {p.name: p.grad.copy() for p in net.params}
    out["x"] = net.grad(x).copy()
    out["fc2.value"] = net.value("fc2").copy()
    return out


@pytest.mark.parametrize("opt_level", [0, 3])
def test_stdlib_derived_equals_hand_written(opt_level, monkeypatch):
    hand = run_stdlib(opt_level, False, monkeypatch)
    derived = run_stdlib(opt_level, True, monkeypatch)
    assert hand.keys() == derived.keys()
    for name in hand:
        assert np.abs(hand[name]).max() > 0, name   # every gradient is exercised
        np.testing.assert_allclose(derived[name], hand[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_derived_weighted_neuron_is_the_hand_written_body():
    info = NeuronInfo((12,), {"weights": 12, "bias": 1}, frozenset({"weights", "bias"}))
    cls = fully_connected.WeightedNeuron
    derived = derive_backward(parse_method(cls, "forward", info), info)
    hand = parse_method(cls, "backward", info)
    def statements(block):
        return [s for s in walk(block) if type(s).__name__ == "AugAssign"]
    assert len(statements(derived)) == len(statements(hand)) == 3
    assert all(s in statements(hand) for s in statements(derived))


@pytest.mark.parametrize("derived", [False, True])
def test_derived_fc_and_conv_backward_become_gemms(derived, monkeypatch):
    with monkeypatch.context() as m:
        if derived:
            for module in (fully_connected, convolution):
                m.setattr(module, "WeightedNeuron", forward_only(fully_connected.WeightedNeuron))
        net = Net(4, opt_level=1)   # big enough for gemm.MIN_FLOPS
        x = MemoryDataLayer(net, "x", (3, 8, 8))
        conv = ConvolutionLayer("conv", net, x, 4, 3)
        FullyConnectedLayer("fc", net, conv, 6)
        WeightedSumLoss(net, "loss", net.ensembles[-1])
        net.init()
    counts = {p.ensemble.name: sum(isinstance(n, Gemm) for n in walk(p.kernels["backward"].body))
              for p in net.program.plans if p.ensemble.name in ("conv", "fc")}
    assert counts["conv"] >= 2 and counts["fc"] >= 2   # input and weight gradients
    assert defines_backward(net.ensembles[-2].neuron_type) is not derived


# ---------------------------------------------------------------- forward-only user neurons

class SmoothNeuron(Neuron):
    """Locals, if/else, every supported function, and two connections from one source."""

    weights: Param
    bias: Param

    def forward(self):
        acc = 0.0
        for i in range(len(self.inputs[0])):
            x = self.inputs[0][i]
            acc += self.weights[i] * x + 0.1 * math.tanh(x) * x
        s = math.sqrt(1.0 + acc * acc) + math.log(1.0 + self.inputs[1][0] * self.inputs[1][0])
        if acc > 0.0:
            y = acc * math.exp(-0.5 * abs(self.inputs[1][0]))
        else:
            y = max(acc, 0.3 * acc) - min(self.inputs[1][0], 0.0) / (2.0 + s)
        self.value = y + s * self.bias[0]


class RunningMaxNeuron(Neuron):
    """A running max over a window with the winner's weight (a carried local overwritten
    under a branch, as max-pool's), plus a sum of squares normalized after the loop."""

    weights: Param
    winner: Batch

    def forward(self):
        best = self.inputs[0][0] * self.weights[0]
        arg = 0
        total = 0.0
        for i in range(len(self.inputs[0])):
            t = self.inputs[0][i] * self.weights[i]
            if t > best:
                best = t
                arg = i
            total += t * t
        self.winner = arg
        self.value = best / math.sqrt(1.0 + total)


def user_net(opt_level: int, neuron: type, fields: dict) -> tuple[Net, Ensemble]:
    net = Net(BATCH, opt_level=opt_level, seed=1)
    x = MemoryDataLayer(net, "x", (2, 5, 5))
    ens = Ensemble(net, "user", neuron, (3, 4, 4), **fields)
    add_connections(net, x, ens, lambda c, y, i: (range(2), range(y, y + 2), range(i, i + 2)))
    if neuron is SmoothNeuron:
        add_connections(net, x, ens, lambda c, y, i: (c % 2, y + 1, i))
    WeightedSumLoss(net, "loss", ens)
    net.init()
    return net, x


CASES = [(SmoothNeuron, lambda r: {"weights": r.standard_normal((3, 4, 4, 8), np.float32),
                                   "bias": (r.standard_normal((3, 1), np.float32),
                                            lambda c, y, x: c)}),
         (RunningMaxNeuron, lambda r: {"weights": r.standard_normal((3, 4, 4, 8), np.float32),
                                       "winner": np.zeros((3, 4, 4), np.float32)})]


@pytest.mark.parametrize("neuron,fields", CASES, ids=[c[0].__name__ for c in CASES])
def test_forward_only_neuron_gradients(neuron, fields):
    results = []
    for opt_level in (0, 3):
        rng = np.random.default_rng(5)
        net, x = user_net(opt_level, neuron, fields(rng))
        fill(net, x, rng)
        if opt_level == 0:
            check_gradients(net, [x], max_entries=24)
        net.forward()
        net.backward()
        results.append([net.grad(x).copy()] + [p.grad.copy() for p in net.params])
    for level0, level3 in zip(*results):
        np.testing.assert_allclose(level3, level0, rtol=1e-4, atol=1e-5)


class WindowMinNeuron(Neuron):
    """Nested loops over a 3x3 window with a running min (the first on ties)."""

    def forward(self):
        low = self.inputs[0][0]
        for r in range(3):
            for q in range(3):
                v = self.inputs[0][r * 3 + q]
                if v < low:
                    low = v
        self.value = low * low + (self.inputs[0][4] if low < 0.0 else -self.inputs[0][4])


class SignedPeakNeuron(Neuron):
    """A carried local overwritten in two branches: its adjoint goes to whichever wrote last."""

    def forward(self):
        peak = 0.0
        for i in range(len(self.inputs[0])):
            v = self.inputs[0][i]
            if v > peak:
                peak = v
            elif v < -2.0 * peak:
                peak = -0.5 * v
        self.value = peak * peak


class ParityNeuron(Neuron):
    """A local chosen per iteration by ``%`` (a join inside a loop), weights picked by
    ``//``, and the accumulated value reused nonlinearly."""

    weights: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            if i % 2 == 0:
                w = self.weights[i // 2]
            else:
                w = -0.5 * self.weights[i // 2]
            self.value += w * self.inputs[0][i]
        self.value = self.value * self.value / (1.0 + abs(self.value))


class Relu6Neuron(Neuron):
    """In place, two clamps: the derivative is read from the output through both."""

    def forward(self):
        self.value = max(self.value, 0.0)
        self.value = min(self.value, 6.0)


class HalfExpNeuron(Neuron):
    def forward(self):
        self.value = math.exp(0.5 * self.value)


def window_net(opt_level: int, neuron: type) -> tuple[Net, Ensemble]:
    net = Net(BATCH, opt_level=opt_level, seed=2)
    x = MemoryDataLayer(net, "x", (2, 6, 6))
    fields = {"weights": np.linspace(-1, 1, 2 * 4 * 4 * 5, dtype=np.float32).reshape(2, 4, 4, 5)}
    ens = Ensemble(net, "user", neuron, (2, 4, 4), **(fields if neuron is ParityNeuron else {}))
    add_connections(net, x, ens, lambda c, y, i: (c, range(y, y + 3), range(i, i + 3)))
    WeightedSumLoss(net, "loss", ens)
    net.init()
    return net, x


def activation_net(opt_level: int, neuron: type) -> tuple[Net, Ensemble]:
    net = Net(BATCH, opt_level=opt_level, seed=2)
    x = MemoryDataLayer(net, "x", (2, 6, 6))
    fc = FullyConnectedLayer("fc", net, x, 7)
    WeightedSumLoss(net, "loss", ActivationEnsemble(net, "act", neuron, fc))
    net.init()
    return net, x


REFERENCE_CASES = [(window_net, WindowMinNeuron), (window_net, SignedPeakNeuron),
                   (window_net, ParityNeuron),
                   (window_net, SmoothNeuron), (activation_net, Relu6Neuron),
                   (activation_net, HalfExpNeuron)]


@pytest.mark.parametrize("build,neuron", REFERENCE_CASES, ids=[c[1].__name__ for c in REFERENCE_CASES])
@pytest.mark.parametrize("opt_level", [0, 3])
def test_forward_only_neuron_matches_reference(build, neuron, opt_level):
    reference = pytest.importorskip("latte.reference")
    if neuron is SmoothNeuron:   # two connections: the window and one-to-one
        build = lambda opt, _: user_net(opt, SmoothNeuron, CASES[0][1](np.random.default_rng(4)))  # noqa: E731
    net, x = build(opt_level, neuron)
    xv = fill(net, x, np.random.default_rng(8), scale=4.0)   # clamps and branches both ways
    ref = reference.Reference(net)
    ref.forward({"x": xv.astype(np.float64)})
    ref.backward()
    net.forward()
    net.backward()
    np.testing.assert_allclose(net.grad(x), ref.grads["x"], rtol=1e-4, atol=1e-4)
    assert np.abs(ref.grads["x"]).max() > 0
    for p in net.params:
        np.testing.assert_allclose(p.grad, ref.param_grads[p.name], rtol=1e-4, atol=1e-4,
                                   err_msg=p.name)


def test_explain_prints_the_derived_backward():
    net, _ = user_net(1, RunningMaxNeuron, CASES[1][1](np.random.default_rng(0)))
    text = explain_program(net.program)
    assert "backward: derived from forward" in text
    assert "self.grad_weights[i] +=" in text and "_last_best" in text


def test_derived_body_prints_as_python():
    info = NeuronInfo((4,), {"argmax": 1}, frozenset())
    body = derive_backward(parse_method(pooling.MaxNeuron, "forward", info), info)
    text = format_neuron(body)
    assert "if i == _last_best:\n        self.grad_inputs[0][i] += self.grad" in text
    assert "(self.grad if _last_best == -1.0 else 0.0)" in text   # first arg-max wins ties


# ---------------------------------------------------------------- what cannot be derived

class ProductNeuron(Neuron):
    def forward(self):
        p = 1.0
        for i in range(len(self.inputs[0])):
            p = p * self.inputs[0][i]   # needs every partial product
        self.value = p


class LeakyNeuron(Neuron):
    def forward(self):
        self.value = max(self.value, 0.01 * self.value)   # derivative needs the input


def _line(cls: type, text: str) -> int:
    import inspect
    lines, first = inspect.getsourcelines(cls.forward)
    return first + next(k for k, line in enumerate(lines) if text in line)


def test_unsupported_forward_names_its_line():
    net = Net(2)
    x = MemoryDataLayer(net, "x", (4,))
    p = Ensemble(net, "p", ProductNeuron, (1,))
    add_connections(net, x, p, lambda o: (range(4),))
    WeightedSumLoss(net, "loss", p)
    with pytest.raises(NeuronSyntaxError, match=rf"test_autodiff.py:{_line(ProductNeuron, 'for i')}:"
                                                 r" ensemble 'p': local 'p' carries .*"
                                                 r"write backward\(\) by hand"):
        net.init()


def test_inplace_activation_needing_its_input_is_an_error():
    net = Net(2)
    x = MemoryDataLayer(net, "x", (4,))
    fc = FullyConnectedLayer("fc", net, x, 3)
    WeightedSumLoss(net, "loss", ActivationEnsemble(net, "leaky", LeakyNeuron, fc))
    line = _line(LeakyNeuron, "max(")
    with pytest.raises(NeuronSyntaxError, match=rf"test_autodiff.py:{line}: ensemble 'leaky': "
                                                 r".*needs its input.*"
                                                 r"write backward\(\) by hand"):
        net.init()
