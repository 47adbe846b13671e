"""Every opt level computes what opt_level=0 (plain synthesized loops) computes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WeightedSumLoss, fill, fill_labels

from latte import Ensemble, Net, add_connections
from latte.compiler import format_ir
from latte.compiler.explain import explain_program
from latte.compiler.ir import Gemm, walk
from latte.stdlib import FullyConnectedLayer, MemoryDataLayer, ReLULayer, SoftmaxLossLayer, TanhLayer
from latte.stdlib.convolution import UnbiasedNeuron

BATCH = 8


def _mlp(opt_level: int):
    """x(32) -> fc1(16) -> relu -> fc2(16) -> tanh -> fc3(4) -> softmax loss."""
    net = Net(BATCH, opt_level=opt_level, seed=7)
    x = MemoryDataLayer(net, "x", (32,))
    label = MemoryDataLayer(net, "label", (1,))
    fc1 = FullyConnectedLayer("fc1", net, x, 16)
    r1 = ReLULayer("relu1", net, fc1)
    fc2 = FullyConnectedLayer("fc2", net, r1, 16)
    t2 = TanhLayer("tanh2", net, fc2)
    fc3 = FullyConnectedLayer("fc3", net, t2, 4)
    SoftmaxLossLayer("loss", net, fc3, label)
    net.init()
    return net


def _run(net, params: list[np.ndarray]) -> dict[str, object]:
    """Load ``params``, feed a fixed batch, run forward/backward/update twice; record it all."""
    rng = np.random.default_rng(0)
    for p, v in zip(net.params, params):
        p.value[...] = v
    fill(net, "x", rng)
    fill_labels(net, "label", 4, rng)
    net.forward()
    out = {f"value:{e}": net.value(e).copy() for e in ("fc1", "fc2", "fc3")}
    out["loss"] = net.loss
    net.backward()
    out |= {f"grad:{e}": net.grad(e).copy() for e in ("x", "fc1", "fc2", "fc3")}
    out |= {f"grad:{p.name}": p.grad.copy() for p in net.params}
    net.update(0.1, 0.9, 0.01)
    net.forward()
    net.backward()
    net.update(0.1, 0.9, 0.01)
    out |= {f"updated:{p.name}": p.value.copy() for p in net.params}
    return out


@pytest.fixture(scope="module")
def reference():
    net = _mlp(0)
    params = [p.value.copy() for p in net.params]
    for p in params[1::2]:  # non-zero biases
        p[...] = np.random.default_rng(1).standard_normal(p.shape)
    return params, _run(net, params)


@pytest.mark.parametrize("opt_level", [1, 2, 3])
def test_opt_levels_match_level_0(reference, opt_level):
    params, ref = reference
    got = _run(_mlp(opt_level), params)
    assert got.keys() == ref.keys()
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)
    updated = [v for k, v in got.items() if k.startswith("updated:")]
    assert all(not np.allclose(u, p) for u, p in zip(updated, params, strict=True))


def _gemms(net, name: str, phase: str) -> list[Gemm]:
    plan = next(p for p in net.program.plans if p.ensemble.name == name)
    return [n for n in walk(plan.kernels[phase]) if isinstance(n, Gemm)]


@pytest.fixture(scope="module")
def plain_and_opt():
    return _mlp(0), _mlp(1)


def test_gemm_matched_at_level_1_only(plain_and_opt):
    plain, opt = plain_and_opt
    for name in ("fc1", "fc2"):
        for phase in ("forward", "backward"):
            assert not _gemms(plain, name, phase)
    fwd = _gemms(opt, "fc1", "forward")
    assert len(fwd) == 1
    g = fwd[0]
    # value[n, o] += x[n, i] * W[o, i]: m = batch, n = outputs, k = inputs, B transposed
    assert (g.m, g.n, g.k, g.trans_a, g.trans_b) == (BATCH, 16, 32, False, True)
    assert (g.a_buf.name, g.b_buf.name, g.c_buf.name) == ("x.value", "fc1.weights", "fc1.value")
    assert (g.lda, g.ldb, g.ldc) == (32, 32, 16)
    # backward: grad of the input and of the weights
    bwd = {g.c_buf.name: g for g in _gemms(opt, "fc1", "backward")}
    assert set(bwd) == {"x.grad", "fc1.grad_weights"}
    assert (bwd["x.grad"].m, bwd["x.grad"].n, bwd["x.grad"].k) == (BATCH, 32, 16)
    assert (bwd["fc1.grad_weights"].m, bwd["fc1.grad_weights"].n,
            bwd["fc1.grad_weights"].k) == (16, 32, BATCH)
    assert len(_gemms(opt, "fc2", "forward")) == 1
    assert not _gemms(opt, "fc3", "forward")  # 8x4x16: below the size where a call pays off


def test_explain_reports_the_plan(plain_and_opt):
    plain, opt = plain_and_opt
    text = explain_program(opt.program)
    assert text.startswith("opt_level 1")
    assert "== ensemble 'fc1': WeightedNeuron x (16,)" in text
    assert "input 0 from 'x': 32 values per neuron (affine); shared along dim 0 (size 16)" in text
    assert "forward: 1 GEMM match(es)" in text and "backward: 2 GEMM match(es)" in text
    assert "sgemm(NT, m=8, n=16, k=32, A=x.value[0:] lda=32, B=fc1.weights[0:] ldb=32" in text
    assert "forward: 1 GEMM match(es)" not in explain_program(plain.program)
    fwd = format_ir(plain.program.plans[0].kernels["forward"])
    assert fwd.splitlines()[0] == "def fc1.forward():"
    assert "fc1.value[_n, _d0] += (fc1.weights[_d0, i_0] * x.value[_n, i_0])" in fwd


def _padded_conv(opt_level: int) -> dict[str, np.ndarray]:
    """A 3x3 convolution whose window reads 0.5 outside its input: its value and the
    gradients of its input and weights."""
    net = Net(2, opt_level=opt_level, seed=3)
    x = MemoryDataLayer(net, "x", (2, 8, 8))
    w = np.random.default_rng(4).standard_normal((4, 18)).astype(np.float32)
    conv = Ensemble(net, "conv", UnbiasedNeuron, (4, 8, 8), weights=(w, lambda c, y, x_: c))
    add_connections(net, x, conv, lambda c, y, x_: (range(2), range(y - 1, y + 2),
                                                    range(x_ - 1, x_ + 2)), padding=0.5)
    WeightedSumLoss(net, "loss", conv)
    net.init()
    fill(net, x, np.random.default_rng(5))
    net.forward()
    net.backward()
    assert bool(_gemms(net, "conv", "forward")) == (opt_level > 0)   # gathered, then GEMMs
    return {"value": net.value(conv), "grad:x": net.grad(x),
            "grad:weights": net.params[0].grad}


@pytest.mark.parametrize("opt_level", [1, 3])
def test_gathered_windows_keep_their_padding_value(opt_level):
    """Data-copy gathers a window into a tile for the GEMM: where the window leaves its
    input, the tile holds the connection's padding value (it held 0.0, whatever the
    padding: random case 2781)."""
    want, got = _padded_conv(0), _padded_conv(opt_level)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
