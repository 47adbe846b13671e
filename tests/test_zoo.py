"""Every zoo net equals its PyTorch twin (float64) with the same weights, loaded by name.

Each net is built narrow (``width``) at a small input size, so that the file runs in a
minute or two; the topology (groups, LRN, projections, bottlenecks, concats) is the
published one. Forward logits, the loss, the input gradient and every parameter gradient
are compared in training mode, and for nets with batch norm the running statistics after
that step and the test-mode logits computed from them.

Tolerances are relative to each array's largest magnitude, not per element: latte computes
in float32, so each layer adds rounding of about ``sqrt(K) * 6e-8`` of its outputs' scale
(K the terms of a dot product), compounded over 10-50 layers, and batch norm over a small
batch divides by standard deviations that amplify it. Entries near zero carry the same
absolute error as the largest ones, so an element-wise relative tolerance would fail on
correct code; ``RTOL`` of the array's scale does not, and a wrong index, weight layout or
missing term shows up as an error of order one.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from helpers import assert_scaled_close

import latte.stdlib as stdlib
from latte import Net, Phase
from latte.stdlib import MemoryDataLayer, SoftmaxLossLayer
from latte.zoo import NETS

torch = pytest.importorskip("torch")
from latte.zoo import torch_twin  # noqa: E402  (needs torch)

RTOL = 2e-4
BATCH, CLASSES = 4, 10
# net: (input channels, input size, width)
CASES = {"alexnet": (3, 67, 1 / 8), "vgg16": (3, 32, 1 / 8), "resnet18": (3, 32, 1 / 8),
         "resnet50": (3, 32, 1 / 16), "inception": (3, 32, 1 / 8),
         "digits_resnet": (1, 8, 1 / 4)}


def _build(name: str, net, x, lib):
    """``NETS[name]`` without dropout (its masks are random: neither side could match)."""
    build = NETS[name]
    kwargs = {"dropout": 0.0} if "dropout" in inspect.signature(build).parameters else {}
    _, _, width = CASES[name]
    return build(net, x, CLASSES, width=width, lib=lib, **kwargs)


def _randomize(net, rng: np.random.Generator) -> None:
    """Nonzero biases and shifts, scales away from one: layers start them at 0 and 1,
    where a wrong gradient or a swapped parameter could hide."""
    for p in net.params:
        field = p.name.rsplit(".", 1)[1]
        if field in ("bias", "shift"):
            p.value[...] = 0.1 * rng.standard_normal(p.value.shape)
        elif field in ("scale", "slope"):
            p.value[...] = 1.0 + 0.2 * rng.standard_normal(p.value.shape)


@pytest.mark.parametrize("opt_level", [0, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_zoo_net_equals_torch(name, opt_level):
    channels, size, _ = CASES[name]
    net = Net(BATCH, opt_level=opt_level, seed=0)
    data = MemoryDataLayer(net, "data", (channels, size, size))
    label = MemoryDataLayer(net, "label", (1,))
    logits = _build(name, net, data, stdlib)
    SoftmaxLossLayer("loss", net, logits, label)
    net.init()
    rng = np.random.default_rng(0)
    _randomize(net, rng)
    x = rng.standard_normal((BATCH, channels, size, size)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH)
    net.value(data)[...] = x
    net.value(label)[:, 0] = y

    twin = torch_twin.TwinNet((channels, size, size), dtype=torch.float64)
    twin.output = _build(name, twin, twin.input, torch_twin)
    twin.load_from(net)                       # before training updates the running stats

    net.forward()
    net.backward()
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out = twin.train()(xt)
    loss = torch.nn.functional.cross_entropy(out, torch.tensor(y))
    loss.backward()

    assert net.loss == pytest.approx(loss.item(), rel=RTOL)
    assert_scaled_close(net.value(logits), out.detach().numpy(), RTOL, "logits")
    assert_scaled_close(net.grad(data), xt.grad.numpy(), RTOL, "input gradient")
    grads = twin.grads()
    assert {p.name for p in net.params} == set(grads)
    for p in net.params:
        assert_scaled_close(p.grad, grads[p.name].reshape(p.grad.shape), RTOL, p.name)
    if not twin.state:
        return
    for key, tensor in twin.state.items():
        assert_scaled_close(net.state[key], tensor.numpy().reshape(net.state[key].shape),
                            RTOL, key)
    net.forward(Phase.TEST)
    with torch.no_grad():
        expected = twin.eval()(xt).numpy()
    assert_scaled_close(net.value(logits), expected, RTOL, "test-mode logits")
