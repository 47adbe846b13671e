"""Every zoo net equals its PyTorch twin (float64) with the same weights, loaded by name.

Each net is built narrow (``width``) at a small input size, so that the file runs in a
minute or two; the topology (groups, LRN, projections, bottlenecks, concats) is the
published one. Forward logits, the loss, the input gradient and every parameter gradient
are compared in training mode, and for nets with batch norm the running statistics after
that step and the test-mode logits computed from them (at opt 3 for one of them only, see
``TEST_MODE_AT_3``: compile time).

Tolerances are relative to each array's largest magnitude, not per element (entries near
zero carry the absolute error of the largest ones), and scaled to what float32 can do on
the case: latte computes in float32, and training-mode batch norm over a few values per
channel (a 1x1 feature map of a small batch) divides by standard deviations that can
amplify rounding a thousandfold, in any float32 implementation. So each array must be
within ``RTOL`` of the float64 twin's, or within ``FACTOR`` times the error of the same
twin run in float32, whichever is larger; a case where float32 itself is off by more than
``CONDITIONED`` tests nothing and fails. A wrong index, weight layout or missing term
gives errors of order one.
"""

from __future__ import annotations

import copy
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

RTOL, FACTOR, CONDITIONED = 1e-4, 10.0, 1e-2
# the test phase is another program; at opt 3 it is compiled for the smallest net with batch
# norm only (the same blocks as the ResNets: conv, BN, add, ReLU, projections)
TEST_MODE_AT_3 = "digits_resnet"
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


@pytest.mark.parametrize(("name", "opt_level"), [(n, level) for n in CASES for level in (0, 3)])
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
    twin32 = copy.deepcopy(twin).float()

    net.forward()
    net.backward()
    train64, train32 = (_torch_step(t, x, y) for t in (twin, twin32))
    latte = {"loss": np.array(net.loss), "logits": net.value(logits),
             "input gradient": net.grad(data)} | {p.name: p.grad for p in net.params}
    assert set(latte) == set(train64)                  # the same parameters, by name
    for key, actual in latte.items():
        _assert_close(actual, train64[key], train32[key], key)
    if not twin.state or (opt_level > 0 and name != TEST_MODE_AT_3):
        return
    for key, tensor in twin.state.items():
        _assert_close(net.state[key], tensor, twin32.state[key], key)
    net.forward(Phase.TEST)
    with torch.no_grad():
        test64, test32 = (t.eval()(torch.tensor(x, dtype=t.dtype)) for t in (twin, twin32))
    _assert_close(net.value(logits), test64, test32, "test-mode logits")


def _torch_step(twin, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """A training forward and backward of ``twin``: loss, logits, input and parameter
    gradients (float64 arrays, by latte's names)."""
    xt = torch.tensor(x, dtype=twin.dtype, requires_grad=True)
    out = twin.train()(xt)
    loss = torch.nn.functional.cross_entropy(out, torch.tensor(y))
    loss.backward()
    return {"loss": loss.detach().double().numpy(), "logits": out.detach().double().numpy(),
            "input gradient": xt.grad.double().numpy()} | twin.grads()


def _assert_close(actual, expected64, expected32, what: str) -> None:
    """``actual`` (latte, float32) against the float64 twin, within ``RTOL`` of the array's
    scale or ``FACTOR`` times the float32 twin's error (see the module docstring)."""
    e64, e32 = (np.asarray(torch.as_tensor(e).double()) for e in (expected64, expected32))
    e64, e32 = e64.reshape(np.shape(actual)), e32.reshape(np.shape(actual))
    scale = max(float(np.abs(e64).max()), 1e-30)
    float32_error = float(np.abs(e32 - e64).max()) / scale
    assert float32_error <= CONDITIONED, f"{what}: float32 itself is off by {float32_error:.2g}"
    assert_scaled_close(actual, e64, max(RTOL, FACTOR * float32_error), what)
