"""Time steps and recurrent connections: values, back-propagation through time at every opt
level against level 0 and the reference interpreter, the order of a step, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import assert_scaled_close, softmax_xent

from latte import Ensemble, Net, Neuron, NormalizationEnsemble, Param, add_connections
from latte.compiler import Segment, TimeSteps
from latte.compiler.explain import explain_program
from latte.compiler.ir import Assign, AugAssign, Gemm, Ref, accesses, walk
from latte.errors import MappingError, ShapeError
from latte.reference import Reference
from latte.stdlib import (
    ArrayDataLayer,
    FullyConnectedLayer,
    LSTMLayer,
    MemoryDataLayer,
    RNNLayer,
    SoftmaxLossLayer,
    TanhLayer,
)

N_IN, N, CLASSES = 3, 4, 5


class RecurrentNeuron(Neuron):
    """``value = tanh(w . x + u . h_prev + b)``: an Elman cell in one neuron."""

    w: Param
    u: Param
    b: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.w[i] * self.inputs[0][i]
        for j in range(len(self.inputs[1])):
            self.value += self.u[j] * self.inputs[1][j]
        self.value = math.tanh(self.value + self.b[0])


class SumNeuron(Neuron):
    """``value = sum of every input`` (backward derived)."""

    def forward(self):
        for k in range(len(self.inputs[0])):
            self.value += self.inputs[0][k]
        for k in range(len(self.inputs[1])):
            self.value += 0.5 * self.inputs[1][k]


class CellNeuron(Neuron):
    """``value = tanh(x) / 2 + h_prev / 2`` (backward derived)."""

    def forward(self):
        self.value = math.tanh(self.inputs[0][0]) * 0.5 + self.inputs[1][0] * 0.5


class GateNeuron(Neuron):
    """``value = x * tanh(c)`` (backward derived)."""

    def forward(self):
        self.value = self.inputs[0][0] * math.tanh(self.inputs[1][0])


def _params(rng) -> dict:
    return {"w": rng.standard_normal((N, N_IN)).astype(np.float32),
            "u": (0.5 * rng.standard_normal((N, N))).astype(np.float32),
            "b": rng.standard_normal((N, 1)).astype(np.float32)}


def _elman(net, x, p):
    h = Ensemble(net, "h", RecurrentNeuron, (N,), **{k: (v, lambda o: o) for k, v in p.items()})
    add_connections(net, x, h, lambda o: (range(N_IN),))
    add_connections(net, h, h, lambda o: (range(N),), recurrent=True)
    return h


def _head(net, h, label=None):
    out = FullyConnectedLayer("out", net, h, CLASSES)
    label = label or MemoryDataLayer(net, "label", (1,))
    SoftmaxLossLayer("loss", net, out, label)


def elman(net, rng):
    _head(net, _elman(net, MemoryDataLayer(net, "x", (N_IN,)), _params(rng)))


def two_cell_cycle(net, rng):
    """``a`` reads ``b`` of the step before, ``b`` reads ``a`` of this step: a cycle of two
    ensembles, created in the order they run."""
    x = MemoryDataLayer(net, "x", (N_IN,))
    a = Ensemble(net, "a", SumNeuron, (N,))
    add_connections(net, x, a, lambda o: (range(N_IN),))
    b = FullyConnectedLayer("b", net, a, N)
    TanhLayer("b_tanh", net, b)
    add_connections(net, b, a, lambda o: (range(o - 1, o + 2),), padding=0.0, recurrent=True)
    _head(net, b)


def cell_and_hidden(net, rng):
    """Two element-wise ensembles on a cycle, like an LSTM's cell and hidden state: at level
    3 each step runs them as one loop over the step's items."""
    x = MemoryDataLayer(net, "x", (N_IN,))
    proj = FullyConnectedLayer("proj", net, x, N)
    c = Ensemble(net, "c", CellNeuron, (N,))
    add_connections(net, proj, c, lambda o: (o,))
    h = Ensemble(net, "h", GateNeuron, (N,))
    add_connections(net, proj, h, lambda o: (o,))
    add_connections(net, c, h, lambda o: (o,))
    add_connections(net, h, c, lambda o: (o,), recurrent=True)
    _head(net, h)


def delayed_and_out_of_order(net, rng):
    """An ensemble reading its input at the step before (no cycle), and a projection created
    after the recurrent cell that reads it (the step order is not the creation order)."""
    x = MemoryDataLayer(net, "x", (N_IN,))
    p = _params(rng)
    h = Ensemble(net, "h", RecurrentNeuron, (N,), **{k: (v, lambda o: o) for k, v in p.items()})
    proj = FullyConnectedLayer("proj", net, x, N_IN)
    add_connections(net, proj, h, lambda o: (range(N_IN),))
    add_connections(net, h, h, lambda o: (range(N),), recurrent=True)
    delay = Ensemble(net, "delay", SumNeuron, (N,))
    add_connections(net, h, delay, lambda o: (o,), recurrent=True)
    add_connections(net, x, delay, lambda o: (o % N_IN,))
    _head(net, delay)


def _build(make, level: int, steps: int, batch: int, threads: int = 1) -> Net:
    net = Net(batch, time_steps=steps, opt_level=level, num_threads=threads, seed=3)
    make(net, np.random.default_rng(0))
    net.init()
    return net


def _feed(net: Net, rng) -> dict:
    feed = {"x": rng.standard_normal(net.value("x").shape).astype(np.float32),
            "label": rng.integers(0, CLASSES, net.value("label").shape).astype(np.float32)}
    for name, a in feed.items():
        net.value(name)[...] = a
    return feed


@pytest.mark.parametrize("make", [elman, two_cell_cycle, cell_and_hidden,
                                  delayed_and_out_of_order])
@pytest.mark.parametrize("level,threads", [(1, 1), (2, 2), (3, 2)])
def test_bptt_matches_level_0_and_the_reference(make, level, threads):
    steps, batch = 5, 3
    base = _build(make, 0, steps, batch)
    opt = _build(make, level, steps, batch, threads)
    ref = Reference(base)
    for p, q in zip(base.params, opt.params, strict=True):
        q.value[...] = p.value
        ref.params[p.name][...] = p.value
    feed = _feed(base, np.random.default_rng(1))
    for name, a in feed.items():
        opt.value(name)[...] = a
    for net in (base, opt):
        net.forward()
        net.backward()
    ref.forward(feed)
    ref.backward()
    assert base.loss == pytest.approx(ref.loss, rel=1e-5)
    for e in base.ensembles:
        if isinstance(e, NormalizationEnsemble):
            continue
        assert base.value(e).shape == (steps, batch, *e.shape)
        assert_scaled_close(base.value(e), ref.values[e.name], 1e-5, f"value {e.name}")
        assert_scaled_close(opt.value(e.name), base.value(e), 1e-5, f"value {e.name} level {level}")
        if e.name not in ("x", "label"):
            assert_scaled_close(base.grad(e), ref.grads[e.name], 1e-5, f"grad {e.name}")
            assert_scaled_close(opt.grad(e.name), base.grad(e), 1e-5, f"grad {e.name} level {level}")
    for p, q in zip(base.params, opt.params):
        assert_scaled_close(p.grad, ref.param_grads[p.name], 1e-5, f"param grad {p.name}")
        assert_scaled_close(q.grad, p.grad, 1e-5, f"param grad {p.name} level {level}")


def test_elman_values_are_the_recurrence():
    net = _build(elman, 3, 4, 2)
    p = {k: net.params[i].value for i, k in enumerate("wub")}
    x = _feed(net, np.random.default_rng(2))["x"]
    net.forward()
    h = np.zeros((2, N))
    for t in range(4):
        h = np.tanh(x[t] @ p["w"].T + h @ p["u"].T + p["b"][:, 0])
        np.testing.assert_allclose(net.value("h")[t], h, rtol=1e-5, atol=1e-6)


def test_only_the_recurrence_runs_step_by_step():
    """The projections before and after the recurrent cell run once over all steps' items
    (one GEMM each at level 1); the cell runs in a time loop, backward in reverse."""
    net = _build(delayed_and_out_of_order, 1, 3, 2)
    loops = [s for s in net.program.forward if isinstance(s, TimeSteps)]
    outside = [k.ensemble.name for s in net.program.forward if isinstance(s, Segment)
               for k in s.kernels]
    assert [[k.ensemble.name for s in loop.steps for k in s.kernels] for loop in loops] == \
        [["h"], ["delay"]]
    assert "proj" in outside and "out" in outside
    assert [loop.reverse for loop in net.program.backward if isinstance(loop, TimeSteps)] == \
        [True, True]


def test_recurrent_weight_gradients_are_one_gemm_after_the_loop():
    """The recurrent projection's weight gradient reads h at t-1 and adds to no state the
    loop reads: it runs once after the backward loop, one GEMM over steps 1..T-1 (bias:
    all T steps); the input gradient stays in the loop."""
    steps, batch, hidden = 6, 4, 32
    net = Net(batch, time_steps=steps, opt_level=1, num_threads=1)
    x = MemoryDataLayer(net, "x", (8,))
    RNNLayer("rnn", net, x, hidden)
    net.init()
    backward = net.program.backward
    i = next(i for i, s in enumerate(backward) if isinstance(s, TimeSteps))
    after = [k for k in backward[i + 1].kernels if k.name == "rnn.hh.backward_params"]
    assert after, [k.name for k in backward[i + 1].kernels]
    (gemm,) = [n for n in walk(after[0].body) if isinstance(n, Gemm)]
    assert (gemm.m, gemm.n, gemm.k) == (hidden, hidden, (steps - 1) * batch)
    hh = next(e for e in net.ensembles if e.name == "rnn.hh")
    grads = {net.program.buffers.field_grad(hh, f) for f in ("weights", "bias")}
    written = {a.buffer for s in backward[i].steps for k in s.kernels
               for a in accesses(k.body) if a.written}
    assert not grads & written and "rnn.grad[t-1]" in {b.name for b in written}
    assert "parameter gradients once after the backward loop, over all 24 items: rnn.hh" in \
        explain_program(net.program)


def test_an_lstm_steps_gate_gradients_overwrite_instead_of_being_zeroed():
    """The cell's two kernels write each projection gradient's step rows once (four gates):
    they store instead of adding, and backward no longer zeroes those gradients; the cell
    state's gradient, which a step also adds into at ``[t-1]``, is still zeroed."""
    net = Net(2, time_steps=3, opt_level=1, num_threads=1)
    LSTMLayer("lstm", net, MemoryDataLayer(net, "x", (3,)), 5)
    net.init()
    (zero,) = [k for s in net.program.backward if isinstance(s, Segment) for k in s.kernels
               if k.name == "zero_grads"]
    zeroed = {a.buffer.name for a in accesses(zero.body)}
    assert "lstm.c.grad" in zeroed and not {"lstm.ih.grad", "lstm.hh.grad"} & zeroed
    loop = next(s for s in net.program.backward if isinstance(s, TimeSteps))
    writes = [n for s in loop.steps for k in s.kernels for n in walk(k.body)
              if isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Ref)
              and n.target.buffer.name == "lstm.ih.grad[t]"]
    assert len(writes) == 4 and all(isinstance(n, Assign) for n in writes)


def test_element_wise_ensembles_of_a_step_run_as_one_loop():
    net = _build(cell_and_hidden, 3, 3, 2, 2)
    assert net.program.fused_steps == [("forward", ("c", "h")), ("backward", ("h", "c"))]
    assert not net.program.plans[[p.ensemble.name for p in net.program.plans].index("h")
                                 ].kernels["forward"].body.stmts
    assert _build(cell_and_hidden, 2, 3, 2).program.fused_steps == []


def test_a_cycle_without_a_recurrent_connection_is_an_error():
    net = Net(2, time_steps=3)
    x = MemoryDataLayer(net, "x", (N,))
    a = Ensemble(net, "a", SumNeuron, (N,))
    add_connections(net, x, a, lambda o: (o,))
    b = FullyConnectedLayer("b", net, a, N)
    add_connections(net, b, a, lambda o: (o,))
    with pytest.raises(MappingError, match=r"cycle 'a' <- 'b' <- 'a'.*no recurrent"):
        net.init()


def test_a_normalization_on_a_cycle_is_an_error():
    net = Net(2, time_steps=3)
    x = MemoryDataLayer(net, "x", (N_IN,))
    label = MemoryDataLayer(net, "label", (1,))
    h = _elman(net, x, _params(np.random.default_rng(0)))
    loss = SoftmaxLossLayer("loss", net, h, label)
    add_connections(net, loss, h, lambda o: (0,), recurrent=True)
    with pytest.raises(MappingError, match=r"'loss'.*recurrent cycle"):
        net.init()


def test_time_steps_must_be_positive():
    with pytest.raises(Exception, match="time_steps must be positive"):
        Net(2, time_steps=0)


def test_sequences_from_arrays_are_laid_out_step_major():
    """``ArrayDataLayer`` takes ``(N, T, ...)`` samples and ``(N, T)`` labels; the loss of a
    partial last batch averages over the real items' steps only."""
    steps, batch, n = 4, 2, 5
    rng = np.random.default_rng(4)
    X = rng.standard_normal((n, steps, N_IN)).astype(np.float32)
    Y = rng.integers(0, CLASSES, (n, steps))
    net = Net(batch, time_steps=steps, seed=0)
    data, label = ArrayDataLayer(net, (X, Y), shuffle=False, prefetch=False)
    _head(net, _elman(net, data, _params(rng)), label)
    assert data.shape == (N_IN,) and label.shape == (1,)
    for lo in range(0, n, batch):
        net.forward()
        real = min(batch, n - lo)
        np.testing.assert_array_equal(net.value(data)[:, :real], X[lo:lo + real].swapaxes(0, 1))
        np.testing.assert_array_equal(net.value(label)[:, :real, 0], Y[lo:lo + real].T)
        logits = net.value("out")[:, :real].reshape(-1, CLASSES)
        want, _ = softmax_xent(logits, net.value(label)[:, :real].reshape(-1))
        assert net.loss == pytest.approx(want, rel=1e-5)


def test_sequences_of_the_wrong_length_are_an_error():
    net = Net(2, time_steps=3)
    with pytest.raises(ShapeError, match=r"time_steps=3.*\(N, 3, \.\.\.\)"):
        ArrayDataLayer(net, (np.zeros((4, 5, 2)), np.zeros((4, 5))))


def test_predict_runs_sequences():
    net = _build(elman, 3, 5, 4, 2)
    x = np.random.default_rng(5).standard_normal((7, 5, N_IN)).astype(np.float32)
    out = net.predict(x, output="h")
    assert out.shape == (7, 5, N)
    p = {k: net.params[i].value for i, k in enumerate("wub")}
    h = np.zeros((7, N))
    for t in range(5):
        h = np.tanh(x[:, t] @ p["w"].T + h @ p["u"].T + p["b"][:, 0])
        np.testing.assert_allclose(out[:, t], h, rtol=1e-5, atol=1e-6)
