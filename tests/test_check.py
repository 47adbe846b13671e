"""``latte check``: the examples and a small user net agree; a wrong backward or a level-L
result that differs from level 0 makes it exit 1 naming the ensemble."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from latte import Net
from latte.check import CLOSE, FD_RTOL, check
from latte.cli import main
from latte.stdlib import FullyConnectedLayer, MemoryDataLayer, SoftmaxLossLayer, TanhLayer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# a user net: MemoryDataLayer inputs, dropout, an in-place tanh, a user neuron ``value = x**2``
# whose backward is right (FACTOR = 2.0) or forgets the 2 (FACTOR = 1.0)
USER_NET = """
import numpy as np
from latte import Ensemble, Neuron, Net, add_connections
from latte.solvers import SGD, LRPolicy, SolverParameters, solve
from latte.stdlib import (DropoutLayer, FullyConnectedLayer, MemoryDataLayer, SoftmaxLossLayer,
                          TanhLayer)


class SquareNeuron(Neuron):
    def forward(self):
        self.value = self.inputs[0][0] * self.inputs[0][0]

    def backward(self):
        self.grad_inputs[0][0] += {factor} * self.grad * self.inputs[0][0]


net = Net(4, seed=3)
x = MemoryDataLayer(net, "x", (6,))
label = MemoryDataLayer(net, "label", (1,))
fc1 = FullyConnectedLayer("fc1", net, x, 5)
t1 = TanhLayer("tanh1", net, fc1)
sq = Ensemble(net, "sq", SquareNeuron, (5,))
add_connections(net, t1, sq, lambda i: (i,))
drop = DropoutLayer("drop", net, sq, 0.3)
fc2 = FullyConnectedLayer("fc2", net, drop, 3)
SoftmaxLossLayer("loss", net, fc2, label)
solve(SGD(SolverParameters(LRPolicy.Fixed(0.1))), net)
"""


def _script(tmp_path: Path, factor: float) -> Path:
    path = tmp_path / "user_net.py"
    path.write_text(textwrap.dedent(USER_NET.format(factor=factor)))
    return path


def _rows(out: str) -> dict[str, list[str]]:
    """The table's rows: ensemble name -> its cells."""
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]
            if line and not line.startswith("opt level")}


def _check(capsys, *args: object) -> tuple[int, str, str]:
    status = main(["check", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("example", ["digits_mlp.py", "lenet.py"])
def test_examples_agree(capsys, example):
    status, out, err = _check(capsys, EXAMPLES / example)
    assert status == 0, out + err
    rows = _rows(out)
    assert "all agree" in out
    assert {"data", "label", "ip1", "ip2", "loss"} <= rows.keys()
    # every parameter gradient was measured against finite differences, none inconclusive
    assert float(rows["ip1"][3]) <= FD_RTOL and float(rows["ip2"][3]) <= FD_RTOL
    assert float(rows["ip1"][2]) <= FD_RTOL   # d loss / d ip1 (pre-ReLU) by differences
    assert "inconclusive" not in out


def test_user_net_agrees(capsys, tmp_path):
    status, out, err = _check(capsys, _script(tmp_path, 2.0), "--opt-level", 2)
    assert status == 0, out + err
    assert "opt level 2 vs 0" in out
    rows = _rows(out)
    for name in ("fc1", "sq", "drop", "fc2"):
        assert rows[name][0] != "-" or name == "fc1"   # fc1's values are tanh1's, in place
    assert float(rows["sq"][2]) <= FD_RTOL


def test_wrong_backward_is_named(capsys, tmp_path):
    status, out, err = _check(capsys, _script(tmp_path, 1.0), "--opt-level", 1)
    assert status == 1
    rows = _rows(out)
    # the gradient sq sends back is wrong, the one it receives right: sq is the suspect
    assert float(rows["fc1"][2]) > FD_RTOL and float(rows["fc1"][3]) > FD_RTOL
    assert float(rows["sq"][2]) <= FD_RTOL
    assert "suspect" in " ".join(rows["sq"]) and "suspect" not in " ".join(rows["fc1"])
    assert re.search(r"\bsq \(backward\)", out)
    assert "sq" in err.split("latte check:")[1]


def test_opt_level_is_honoured(capsys, tmp_path, monkeypatch):
    levels = []
    original = Net.init

    def init(net):
        levels.append(net.opt_level)
        original(net)
    monkeypatch.setattr(Net, "init", init)
    status, out, _ = _check(capsys, _script(tmp_path, 2.0), "--opt-level", 1)
    assert status == 0 and "opt level 1 vs 0" in out
    assert sorted(levels) == [0, 1]


def _mlp(opt_level: int, **kwargs) -> Net:
    net = Net(3, opt_level=opt_level, **kwargs)
    x = MemoryDataLayer(net, "x", (7,))
    label = MemoryDataLayer(net, "label", (1,))
    fc1 = FullyConnectedLayer("fc1", net, x, 5)
    t1 = TanhLayer("tanh1", net, fc1)
    fc2 = FullyConnectedLayer("fc2", net, t1, 4)
    SoftmaxLossLayer("loss", net, fc2, label)
    return net


def test_level_l_that_differs_from_level_0_is_named():
    net, ref = _mlp(3), _mlp(0, profile=True)
    report = check(net, ref)
    assert not report.failed()
    net, ref = _mlp(3), _mlp(0, profile=True)
    original = net.backward

    def backward():   # a miscompiled level L: fc2's weight gradient 1% off
        original()
        net.params[2].grad[...] *= 1.01
    net.backward = backward
    report = check(net, ref)
    assert [r.name for r in report.failed()] == ["fc2"]
    assert report.failed()[0].failures() == ["grad"]
    assert report.failed()[0].grad == pytest.approx(0.01, rel=0.05) and CLOSE < 0.01


def _conv_bn(opt_level: int, **kwargs) -> Net:
    from latte.stdlib import BatchNormLayer, ConvolutionLayer, ReLULayer
    net = Net(4, opt_level=opt_level, seed=3, **kwargs)
    x = MemoryDataLayer(net, "x", (3, 8, 8))
    label = MemoryDataLayer(net, "label", (1,))
    conv = ConvolutionLayer("conv", net, x, 6, 3, pad=1)   # a bias before a batch norm
    relu = ReLULayer("relu", net, BatchNormLayer("bn", net, conv))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, relu, 5), label)
    return net


def test_a_zero_gradient_is_judged_at_the_rounding_of_its_sum():
    """The bias before a batch norm has a zero gradient: both levels return float32 noise,
    which must not fail the check, while a 1% error in the weights still does."""
    report = check(_conv_bn(3), _conv_bn(0, profile=True))
    assert not report.failed(), report.format()
    net, ref = _conv_bn(3), _conv_bn(0, profile=True)
    original = net.backward

    def backward():
        original()
        net.params[0].grad[...] *= 1.01
    net.backward = backward
    report = check(net, ref)
    assert [r.name for r in report.failed()] == ["conv"], report.format()


def test_check_feeds_labels_and_shares_parameters():
    net, ref = _mlp(2, seed=1), _mlp(0, seed=2, profile=True)
    check(net, ref, seed=5)
    for p, q in zip(net.params, ref.params, strict=True):
        np.testing.assert_array_equal(p.value, q.value)
        assert p.value.any()   # zero biases were given values
    labels = net.value("label")
    np.testing.assert_array_equal(labels, ref.value("label"))
    assert set(np.unique(labels)) <= {0.0, 1.0, 2.0, 3.0}


def test_console_script_exit_status(tmp_path):
    env = dict(os.environ, LATTE_CACHE_DIR=os.environ.get("LATTE_CACHE_DIR", str(tmp_path)))
    result = subprocess.run([sys.executable, "-m", "latte", "check", str(_script(tmp_path, 1.0))],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "sq" in result.stderr and "Traceback" not in result.stderr


def test_a_recurrent_net_agrees(capsys, tmp_path):
    """Time nets: data shaped (T, batch, ...), ids for an embedding, each parameter of an
    LSTM (published under the layer's name) probed by rerunning its time loop whole."""
    script = tmp_path / "lstm_net.py"
    script.write_text(
        "from latte import Net\n"
        "from latte.stdlib import (EmbeddingLayer, FullyConnectedLayer, LSTMLayer,\n"
        "                          MemoryDataLayer, SoftmaxLossLayer)\n"
        "net = Net(2, time_steps=3, seed=0)\n"
        "x = MemoryDataLayer(net, 'x', (1,))\n"
        "label = MemoryDataLayer(net, 'label', (1,))\n"
        "h = LSTMLayer('lstm', net, EmbeddingLayer('emb', net, x, 7, 4), 5)\n"
        "SoftmaxLossLayer('loss', net, FullyConnectedLayer('out', net, h, 7), label)\n")
    status, out, err = _check(capsys, script)
    assert status == 0, out + err
    rows = _rows(out)
    for name in ("emb", "lstm.ih", "lstm.hh", "out"):
        assert float(rows[name][3]) <= FD_RTOL, name   # its parameters, by differences
