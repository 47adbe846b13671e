"""Helpers shared by the test files: a test loss, finite-difference gradient checks, and
running ``latte run`` (under ``mpiexec`` too) on a script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from latte import NormalizationEnsemble
from latte.reference import hosts
from latte.reference.rounding import U

OPT_LEVELS = (0, 1, 2)
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


class WeightedSumLoss(NormalizationEnsemble):
    """``loss = sum(w * x)`` for a fixed random ``w``, so ``d loss / d x = w``."""

    is_loss = True

    def __init__(self, net, name: str, input_ens, seed: int = 123):
        super().__init__(net, name, [input_ens], (1,))
        rng = np.random.default_rng(seed)
        self.w = rng.standard_normal((net.batch_size * net.time_steps, *input_ens.shape)).astype(
            np.float32)

    def forward(self, inputs, value, valid):
        terms = (self.w.astype(np.float64) * inputs[0]).reshape(len(self.w), -1).sum(axis=1)
        value[:, 0] = terms
        self.loss = float(terms.sum())

    def backward(self, inputs, grad_inputs, value, grad, valid):
        grad_inputs[0] += self.w


def _weighted_sum_bound(norm, inputs, radii, value, valid):
    """``sum(w * x)`` per item moves by ``sum(|w| r)``, plus storing it in float32."""
    terms = (np.abs(norm.w) * radii[0]).reshape(len(norm.w), -1).sum(axis=1)
    return terms[:, None] + U * np.abs(value)


hosts.register(WeightedSumLoss, _weighted_sum_bound,   # its gradient, w, is exact
               lambda norm, inputs, radii, grad, grad_radius, valid: [np.zeros(inputs[0].shape)])


def softmax_xent(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy and its gradient w.r.t. ``logits`` (float64)."""
    x = logits.reshape(len(logits), -1).astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    p = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    idx = labels.astype(np.int64)
    loss = float(-np.log(p[np.arange(len(x)), idx]).mean())
    g = p.copy()
    g[np.arange(len(x)), idx] -= 1.0
    return loss, (g / len(x)).reshape(logits.shape)


def loss_at(net) -> float:
    net.forward()
    return net.loss


def numeric_grad(net, value: np.ndarray, flat_index: int, eps: float) -> float:
    """Central difference of ``net.loss`` w.r.t. one entry of a live array."""
    flat = value.reshape(-1)
    old = float(flat[flat_index])
    flat[flat_index] = old + eps
    plus = loss_at(net)
    flat[flat_index] = old - eps
    minus = loss_at(net)
    flat[flat_index] = old
    return (plus - minus) / (2.0 * eps)


def check_gradients(net, inputs=(), *, eps: float = 1e-3, rtol: float = 1e-2, atol: float = 1e-3,
                    max_entries: int = 16, seed: int = 0) -> None:
    """Compare every ``param.grad`` and ``net.grad(e)`` for ``e`` in ``inputs`` with central
    finite differences of ``net.loss`` (at most ``max_entries`` random entries per array)."""
    net.forward()
    net.backward()
    targets = [(p.name, p.value, p.grad.copy()) for p in net.params]
    targets += [(e.name, net.value(e), net.grad(e).copy()) for e in inputs]
    assert targets, "nothing to check"
    rng = np.random.default_rng(seed)
    for name, value, analytic in targets:
        size = value.size
        idx = np.arange(size) if size <= max_entries else rng.choice(size, max_entries, replace=False)
        numeric = np.array([numeric_grad(net, value, int(i), eps) for i in idx])
        np.testing.assert_allclose(analytic.reshape(-1)[idx], numeric, rtol=rtol, atol=atol,
                                   err_msg=f"gradient of {name}")
    net.forward()  # leave the net in its unperturbed state


def fill(net, ens, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Write random normal values into ``ens`` and return a copy of them."""
    x = (scale * rng.standard_normal(net.value(ens).shape)).astype(np.float32)
    net.value(ens)[...] = x
    return x


def set_biases(net, rng: np.random.Generator, scale: float = 1.0) -> None:
    """Give every ``*.bias`` parameter random normal values (layers start them at zero), so
    that the biases show up in forward checks and their gradients are not trivially zero."""
    for p in net.params:
        if p.name.endswith(".bias"):
            p.value[...] = (scale * rng.standard_normal(p.value.shape)).astype(np.float32)


def fill_labels(net, ens, n_classes: int, rng: np.random.Generator) -> np.ndarray:
    """Write random class indices into a ``(1,)`` label ensemble and return them."""
    y = rng.integers(0, n_classes, net.batch_size)
    net.value(ens)[:, 0] = y
    return y


def run_alike(nets, classes: int) -> None:
    """The same parameters (the first net's, its biases drawn), inputs ``x`` and labels (of
    ``classes`` classes) into each net, then a forward and a backward."""
    rng = np.random.default_rng(0)
    set_biases(nets[0], rng)
    x = rng.standard_normal(nets[0].value("x").shape).astype(np.float32)
    labels = rng.integers(0, classes, nets[0].value("label").shape)
    for net in nets:
        for p, q in zip(nets[0].params, net.params, strict=True):
            q.value[...] = p.value
        net.value("x")[...] = x
        net.value("label")[...] = labels
        net.forward()
        net.backward()


def assert_scaled_close(actual, expected, rtol: float, what: str) -> None:
    """``max |actual - expected| <= rtol * max |expected|``: a tolerance relative to the
    array's scale, for float32 results of long computations checked against float64 (where
    entries near zero carry the absolute error of the largest ones)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    err = float(np.abs(actual - expected).max(initial=0.0))
    assert err <= rtol * scale, f"{what}: max error {err:.3g} is {err / scale:.3g} of the scale {scale:.3g}"


def vector_registers(monkeypatch, bits: int, count: int) -> None:
    """Compile as for a host with ``count`` vector registers of ``bits`` (wider vectors are
    correct anywhere), with stored programs off: the patched machine is not in their key."""
    import latte.compiler.pipeline as pipeline  # noqa: PLC0415

    monkeypatch.setattr(pipeline, "vector_registers", lambda: (bits, count))
    monkeypatch.setenv("LATTE_STORED_PROGRAMS", "0")


def pair(v) -> tuple[int, int]:
    """A kernel, stride or padding given as one int or a pair, as a pair."""
    return (v, v) if isinstance(v, int) else tuple(v)


def latte_run(script: Path, *args: str, ranks: int = 1, timeout: float = 120,
              **env) -> subprocess.CompletedProcess:
    """``latte run script *args`` in a fresh process (under ``mpiexec -n ranks`` for more
    than one rank), with ``env`` added to the environment (less any MPI launcher's)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_"))}
    environ.update({k: str(v) for k, v in env.items()})
    cmd = [sys.executable, "-m", "latte", "run", str(script), *args]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=timeout)


def run_results(out: Path) -> tuple[dict, dict]:
    """The ``params.npz`` and ``history.json`` a test script's rank 0 wrote into ``out``."""
    with np.load(out / "params.npz") as f:
        params = dict(f)
    return params, json.loads((out / "history.json").read_text())


def fuzz_case(item) -> int | None:
    """The random tester's case a collected test checks (None: another test): the tests
    that ask for tests/test_fuzz.py's ``checked``."""
    if "checked" not in getattr(item, "fixturenames", ()):
        return None
    return item.callspec.params["case"]
