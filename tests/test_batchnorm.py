"""BatchNormLayer against PyTorch's BatchNorm1d/2d in float64: training forward, input and
parameter gradients, running statistics over several steps, test-mode forward, partial
batches; net.state saved and loaded; the reference interpreter and ``latte check``."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WeightedSumLoss

from latte import Net, Phase
from latte.check import check
from latte.compiler import HostStep, Segment
from latte.errors import LatteError, ShapeError
from latte.reference import Reference
from latte.stdlib import BatchNormLayer, ConvolutionLayer, MemoryDataLayer, ReLULayer, SoftmaxLossLayer

torch = pytest.importorskip("torch")

RTOL = 1e-4   # float32 latte against float64 torch, relative to the array's largest entry


class PartialBatch:
    """A data source whose batches have ``valid`` real items (the user writes the values)."""

    def __init__(self, valid: int):
        self.valid = valid

    def load(self, net, phase) -> int:
        return self.valid


def _close(got: np.ndarray, want, what: str) -> None:
    want = np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(np.asarray(got, np.float64).reshape(want.shape) - want).max() / scale
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


def _build(shape, batch: int, opt_level: int, **kwargs):
    net = Net(batch, opt_level=opt_level, num_threads=2)
    x = MemoryDataLayer(net, "x", shape)
    bn = BatchNormLayer("bn", net, x, **kwargs)
    loss = WeightedSumLoss(net, "loss", bn)
    net.init()
    return net, x, bn, loss


def _torch_bn(shape, **kwargs):
    cls = torch.nn.BatchNorm2d if len(shape) == 3 else torch.nn.BatchNorm1d
    return cls(shape[0], **kwargs).double()


def _params(net, bn) -> dict:
    return {p.name: p for p in net.params if p.name.startswith(f"{bn.name}.")}


@pytest.mark.parametrize("opt_level", [0, 3])
@pytest.mark.parametrize("shape,batch", [((5,), 4), ((4, 7), 3), ((3, 6, 5), 2), ((2, 9, 9), 1),
                                         ((6, 4, 4), 5)])
def test_matches_torch(shape, batch, opt_level):
    """Three training steps (forward, gradients, running statistics), then a test forward."""
    rng = np.random.default_rng(len(shape) * 10 + batch)
    net, x, bn, loss = _build(shape, batch, opt_level, eps=1e-3, momentum=0.3)
    ref = _torch_bn(shape, eps=1e-3, momentum=0.3)
    params = _params(net, bn)
    scale = rng.uniform(0.5, 2.0, shape[0]).astype(np.float32)
    shift = rng.standard_normal(shape[0]).astype(np.float32)
    params["bn.scale"].value[...] = scale.reshape(params["bn.scale"].value.shape)
    params["bn.shift"].value[...] = shift.reshape(params["bn.shift"].value.shape)
    with torch.no_grad():
        ref.weight[:] = torch.from_numpy(scale.astype(np.float64))
        ref.bias[:] = torch.from_numpy(shift.astype(np.float64))
    w = torch.from_numpy(loss.w.astype(np.float64))
    for step in range(3):
        xs = (rng.standard_normal((batch, *shape)) * (step + 1) + step).astype(np.float32)
        net.value(x)[...] = xs
        net.forward()
        net.backward()
        ref.zero_grad()
        xt = torch.from_numpy(xs.astype(np.float64)).requires_grad_()
        y = ref(xt)
        (y * w).sum().backward()
        _close(net.value(bn), y.detach(), f"forward, step {step}")
        _close(net.grad(x), xt.grad, f"input gradient, step {step}")
        _close(params["bn.scale"].grad, ref.weight.grad, f"scale gradient, step {step}")
        _close(params["bn.shift"].grad, ref.bias.grad, f"shift gradient, step {step}")
        _close(net.state["bn.running_mean"], ref.running_mean, f"running mean, step {step}")
        _close(net.state["bn.running_var"], ref.running_var, f"running variance, step {step}")
    net.forward(Phase.TEST)
    ref.eval()
    _close(net.value(bn), ref(torch.from_numpy(xs.astype(np.float64))).detach(), "test forward")


@pytest.mark.parametrize("opt_level", [0, 2])
def test_partial_batch_uses_valid_items(opt_level):
    shape, batch, valid = (3, 4, 4), 5, 3
    rng = np.random.default_rng(7)
    net, x, bn, loss = _build(shape, batch, opt_level)
    x.source = PartialBatch(valid)
    loss.w[valid:] = 0.0   # a loss over the valid items only, as the stdlib losses are
    xs = rng.standard_normal((batch, *shape)).astype(np.float32)
    xs[valid:] = 1e3       # padding that would show in any statistic
    net.value(x)[...] = xs
    net.forward()
    net.backward()
    ref = _torch_bn(shape)
    xt = torch.from_numpy(xs[:valid].astype(np.float64)).requires_grad_()
    y = ref(xt)
    (y * torch.from_numpy(loss.w[:valid].astype(np.float64))).sum().backward()
    _close(net.value(bn)[:valid], y.detach(), "forward")
    _close(net.grad(x)[:valid], xt.grad, "input gradient")
    _close(_params(net, bn)["bn.scale"].grad, ref.weight.grad, "scale gradient")
    _close(net.state["bn.running_var"], ref.running_var, "running variance")


def test_state_is_live_and_saved(tmp_path):
    shape = (3, 5, 5)
    rng = np.random.default_rng(3)
    net, x, bn, _ = _build(shape, 4, 3)
    assert set(net.state) == {"bn.running_mean", "bn.running_var"}
    for _ in range(2):
        net.value(x)[...] = rng.standard_normal((4, *shape)) * 3 + 1
        net.forward()
    saved = {k: v.copy() for k, v in net.state.items()}
    assert not np.allclose(saved["bn.running_mean"], 0.0)
    xs = rng.standard_normal((4, *shape)).astype(np.float32)
    net.value(x)[...] = xs
    net.forward(Phase.TEST)
    want = net.value(bn).copy()
    net.save(tmp_path / "bn.npz")

    other, ox, obn, _ = _build(shape, 4, 0)
    other.load(tmp_path / "bn.npz")
    for k, v in saved.items():
        np.testing.assert_array_equal(other.state[k], v)
    other.value(ox)[...] = xs
    other.forward(Phase.TEST)
    np.testing.assert_allclose(other.value(obn), want, rtol=1e-5, atol=1e-5)

    other.state["bn.running_var"][...] = 4.0   # live: the test forward reads it
    other.state["bn.running_mean"][...] = 1.0
    other.forward(Phase.TEST)
    np.testing.assert_allclose(other.value(obn), (xs - 1.0) / np.sqrt(4.0 + 1e-5), rtol=1e-5, atol=1e-5)

    bare, *_ = _build((3, 5, 5), 4, 0, momentum=0.5)
    bare_path = tmp_path / "bare.npz"
    np.savez(bare_path, __state__=np.array("{}"),
             **{f"{k}/{p.name}": getattr(p, k) for p in bare.params for k in ("value", "history")})
    with pytest.raises(LatteError, match="state/bn.running_mean"):
        bare.load(bare_path)


def test_reference_interpreter_agrees_and_keeps_state():
    shape = (2, 3, 4)
    rng = np.random.default_rng(5)
    net, x, bn, _ = _build(shape, 3, 0)
    xs = rng.standard_normal((3, *shape)).astype(np.float32)
    ref = Reference(net)
    net.value(x)[...] = xs
    for phase in (Phase.TEST, Phase.TRAIN):
        net.forward(phase)
        ref.forward({"x": xs}, phase)
        _close(net.value(bn), ref.values["bn"], f"reference, {phase}")
    net.backward()
    ref.backward()
    _close(net.grad(x), ref.grads["x"], "reference input gradient")
    ref.forward({"x": xs})
    # the reference ran two training forwards on its own copies of the running statistics
    _close(net.state["bn.running_mean"], 0.1 * xs.mean(axis=(0, 2, 3)), "net's running mean")


def _conv_bn_net(opt_level: int, **kwargs) -> Net:
    net = Net(3, opt_level=opt_level, seed=1, **kwargs)
    x = MemoryDataLayer(net, "x", (2, 6, 6))
    label = MemoryDataLayer(net, "label", (1,))
    # no bias: before a batch norm its gradient is zero, and float32 rounding noise would
    # be compared with rounding noise
    conv = ConvolutionLayer("conv", net, x, 3, 3, pad=1, bias=False)
    bn = BatchNormLayer("bn", net, conv)
    relu = ReLULayer("relu", net, bn)
    SoftmaxLossLayer("loss", net, relu, label)
    return net


def test_latte_check_agrees():
    """Level 3 against level 0, level 0 against finite differences, BN after a conv."""
    report = check(_conv_bn_net(3, num_threads=2), _conv_bn_net(0, profile=True))
    assert not report.failed(), report.format()
    rows = {r.name: r for r in report.rows}
    assert rows["bn"].fd_params is not None and rows["conv"].fd_grad is not None


@pytest.mark.parametrize("opt_level", [0, 3])
def test_test_phase_runs_no_statistics(opt_level):
    """In Phase.TEST the statistics come from net.state: their host steps run first and the
    kernels of the batch's partial sums are not in the test program."""
    net, *_ = _build((3, 4, 4), 2, opt_level)
    steps = net.program.test
    assert [s.ensemble.name for s in steps[:2] if isinstance(s, HostStep)] == ["bn_mean", "bn_inv_std"]
    ran = {k.ensemble.name for s in steps if isinstance(s, Segment) for k in s.kernels}
    assert "bn" in ran and not ran & {"bn_part_mean", "bn_part_var"}
    trained = {k.ensemble.name for s in net.program.forward if isinstance(s, Segment) for k in s.kernels}
    assert {"bn_part_mean", "bn_part_var"} <= trained


def test_one_value_per_channel_is_an_error():
    net, x, bn, _ = _build((4,), 1, 0)
    with pytest.raises(ShapeError, match="'bn'.*more than one value per channel"):
        net.forward()
    net.forward(Phase.TEST)   # running statistics: fine


def test_bad_arguments():
    net = Net(2)
    x = MemoryDataLayer(net, "x", (3,))
    with pytest.raises(ValueError, match="momentum"):
        BatchNormLayer("bn", net, x, momentum=1.5)
    with pytest.raises(ValueError, match="eps"):
        BatchNormLayer("bn", net, x, eps=0.0)
