"""Float32 rounding bounds of the reference interpreter (``latte.reference.rounding``): the
interval rules, and compiled level-0 code inside the bounds where float32 loses digits
(large softmax logits, a saturated gate, an overflow on a branch not taken), the cases the
random tester found (1224, 56, 30272, 4799)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import WeightedSumLoss

from latte import Ensemble, Net, Neuron, Phase, add_connections
from latte.errors import LatteError
from latte.lang import NormalizationEnsemble
from latte.reference import Reference, rounding
from latte.stdlib import FullyConnectedLayer, MemoryDataLayer, SoftmaxLossLayer

INF = float("inf")


def _ends(iv) -> tuple:
    return tuple(float(e) for e in iv)


def test_overflow_then_division_is_bounded():
    """float32's ``1 / (1 + exp(212))`` is 0 (exp overflows): the interval holds it, 8.5e-93
    wide, not the whole line."""
    one = rounding.exact(1.0)
    e = rounding.call("exp", (212.0, 212.0))
    assert e[0] > 1e92 and e[1] == INF
    lo, hi = _ends(rounding.binop("/", 1.0, 1.0, one, rounding.binop("+", 1.0, 1.0, one, e)))
    assert lo == 0.0 and hi == pytest.approx(math.exp(-212.0), rel=1e-6)
    assert _ends(rounding.call("sigmoid", (-212.0, -212.0)))[0] == 0.0
    assert _ends(rounding.binop("*", 0.0, 1.0, (0.0, 0.0), e)) == (-INF, INF)   # 0 * inf


def test_a_function_of_an_unbounded_value_stays_unbounded():
    """``(-inf, inf)`` stands for NaN too (``inf - inf``): ``exp``, ``abs`` or ``max`` of it
    may be NaN in float32, which ``[0, inf]`` would not allow (case 42731: an overflowed
    logit's softmax is NaN at level 0, ``[1, 0, ...]`` in float64)."""
    nan = rounding.binop("-", INF, INF, (1.0, INF), (1.0, INF))
    assert _ends(nan) == (-INF, INF)
    for fn in ("exp", "tanh", "abs", "sigmoid"):
        assert _ends(rounding.call(fn, nan)) == (-INF, INF), fn
    assert _ends(rounding.binop("max", 1.0, 1.0, nan, (2.0, 3.0))) == (-INF, INF)
    lo, hi = _ends(rounding.call("exp", (-INF, 0.0)))   # bounded: no NaN
    assert lo == 0.0 and 1.0 <= hi < 1.0 + 1e-6
    assert _ends(rounding.binop("max", 1.0, 1.0, (1.0, INF), (2.0, 3.0))) == (2.0, INF)


def test_a_sum_rounds_by_its_terms_not_its_result():
    """``1e8 + (1 - 1e8)`` is 1, but float32 may be off by the terms' rounding."""
    lo, hi = _ends(rounding.binop("+", 1e8, 1.0 - 1e8, rounding.exact(1e8), rounding.exact(1.0 - 1e8)))
    assert lo <= 1.0 <= hi and hi - lo >= 2 * rounding.U * 1e8
    lo, hi = _ends(rounding.binop("+", 1.0, 2.0, (1.0, 1.0), (2.0, 2.0)))
    assert hi - lo <= 6 * rounding.U   # terms that do not cancel: a few ulps


def test_a_long_sum_rounds_by_its_partial_sums():
    """A reduction's rounding: U times its partial sums' magnitudes, not n times its terms'."""
    terms = np.tile([1.0, -1.0], 500)
    lo, hi = _ends(rounding.total(terms, (terms, terms), (0,)))
    assert lo <= 0.0 <= hi and hi - lo == pytest.approx(2 * rounding.U * 500)


class Identity(Neuron):
    def forward(self):
        self.value = self.inputs[0][0]

    def backward(self):
        self.grad_inputs[0][0] += self.grad


class DiscardsOverflow(Neuron):
    """``x`` where ``x > -1e9`` (always), else the square of ``y * 1e30 * 1e30`` (past
    float32 in every lane); no backward: the compiler derives it, and the zero adjoint of the
    branch not taken times that infinity is NaN."""

    def forward(self):
        big = self.inputs[0][1] * 1e30 * 1e30
        x = self.inputs[0][0]
        self.value = x if x > -1e9 else big * big


class Gate(Neuron):
    """A sigmoid gate times a value; no backward (the compiler's: ``s * g * (1 - g)``, 0 in
    float32 where the gate saturates at 1)."""

    def forward(self):
        self.value = 1.0 / (1.0 + math.exp(-self.inputs[0][0])) * self.inputs[0][1]


def _run(net: Net, feed: dict, scale: float = 0.5) -> Reference:
    """Compile ``net`` at level 0, give it random parameters (times ``scale``) and ``feed``,
    run a training step and the same step on a bounded reference."""
    rng = np.random.default_rng(0)
    net.init()
    for p in net.params:
        p.value[...] = scale * rng.standard_normal(p.value.shape)
    for name, x in feed.items():
        net.value(name)[...] = x
    net.forward(Phase.TRAIN)
    net.backward()
    ref = Reference(net, bounds=True)
    for p in net.params:
        ref.params[p.name][...] = p.value
    ref.forward(feed)
    ref.backward()
    return ref


def _inside(got, lo, hi) -> bool:
    """Whether every entry of ``got`` lies in ``[lo, hi]`` (NaN only where unbounded)."""
    got = np.asarray(got, np.float64)
    nan_ok = np.isinf(lo) & np.isinf(hi)
    return bool(np.all(((got >= lo) & (got <= hi)) | (np.isnan(got) & nan_ok)))


def _all_inside(net: Net, ref: Reference) -> None:
    b = ref.bounds
    for e in net.ensembles:
        if not isinstance(e, NormalizationEnsemble):
            assert _inside(net.value(e), b.lo.values[e.name], b.hi.values[e.name]), e.name
            assert _inside(net.grad(e), b.lo.grads[e.name], b.hi.grads[e.name]), e.name
    for p in net.params:
        assert _inside(p.grad, b.lo.param_grads[p.name], b.hi.param_grads[p.name]), p.name


def test_softmax_of_large_logits():
    """Case 1224: logits near 1e4 are float32 to within 1e-3, so the probabilities, and the
    gradient, are good to 1e-3 of themselves, far past a tolerance relative to the array."""
    net = Net(2, opt_level=0)
    x, label = MemoryDataLayer(net, "x", (16,)), MemoryDataLayer(net, "label", (1,))
    fc = FullyConnectedLayer("fc", net, x, 8)
    SoftmaxLossLayer("loss", net, fc, label)
    rng = np.random.default_rng(1)
    ref = _run(net, {"x": rng.standard_normal((2, 16)).astype(np.float32),
                     "label": np.array([[3.0], [5.0]], np.float32)}, scale=2000.0)
    _all_inside(net, ref)
    width = ref.bounds.hi.grads["fc"] - ref.bounds.lo.grads["fc"]
    assert width.max() > 2e-4 * np.abs(ref.grads["fc"]).max()


def test_saturated_gate_under_a_derived_backward():
    """Case 56: at ``x = 30`` the gate is 1 in float32 and the compiler's derived gradient
    ``g * (1 - g)`` is 0; the tape differentiates the gate as the compiler does, so its bound
    holds that 0."""
    net = Net(2, opt_level=0)
    x = MemoryDataLayer(net, "x", (2,))
    copy = Ensemble(net, "copy", Identity, (2,))
    add_connections(net, x, copy, lambda i: (i,))
    gate = Ensemble(net, "gate", Gate, (1,))
    add_connections(net, copy, gate, lambda i: (range(2),))
    WeightedSumLoss(net, "loss", gate)
    ref = _run(net, {"x": np.array([[30.0, 1.5], [0.5, -2.0]], np.float32)})
    assert net.grad("copy")[0, 0] == 0.0 and ref.grads["copy"][0, 0] != 0.0
    _all_inside(net, ref)


def test_overflow_on_a_branch_not_taken():
    """Case 30272: a lane that computed a value past float32 gets unbounded gradients under
    a derived backward (compiled code has NaN there, the tape 0); its value stays exact."""
    net = Net(2, opt_level=0)
    x = MemoryDataLayer(net, "x", (2,))
    copy = Ensemble(net, "copy", Identity, (2,))
    add_connections(net, x, copy, lambda i: (i,))
    odd = Ensemble(net, "odd", DiscardsOverflow, (1,))
    add_connections(net, copy, odd, lambda i: (range(2),))
    WeightedSumLoss(net, "loss", odd)
    ref = _run(net, {"x": np.array([[0.5, 2.0], [-1.5, 3.0]], np.float32)})
    assert np.isnan(net.grad("copy")[:, 1]).all() and not ref.grads["copy"][:, 1].any()
    assert np.isinf(ref.bounds.hi.grads["copy"]).all()
    assert (ref.bounds.hi.values["odd"] - ref.bounds.lo.values["odd"]).max() == 0.0
    _all_inside(net, ref)


class Twice(NormalizationEnsemble):
    def __init__(self, net, name, src):
        super().__init__(net, name, [src], src.shape)

    def forward(self, inputs, value, valid):
        value[...] = 2.0 * inputs[0]


def test_a_host_step_needs_a_rule():
    net = Net(2)
    Twice(net, "twice", MemoryDataLayer(net, "x", (3,)))
    with pytest.raises(LatteError, match="no rule bounds"):
        Reference(net, bounds=True).forward({"x": np.zeros((2, 3))})
