"""Stored programs: a net described like one compiled before loads that program instead of
compiling (a warm ``net.init()``), bound to its own ensembles, and runs as the compiled one
does; the description changes with everything the compiler reads; a net the encoder cannot
describe, a damaged entry or a watched compile goes through the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import WeightedSumLoss, fill
from test_user_neuron import LocalNeuron  # a user's neuron: a window's weighted sum

from latte import Ensemble, Net, add_connections
from latte.compiler import machine, pipeline, stored
from latte.compiler.description import Undescribable, describe
from latte.compiler.program import Program
from latte.stdlib import ConvolutionLayer, MemoryDataLayer, ReLULayer

BATCH = 4
STRIDE = 1   # a global the mapping function reads
WORKER = Path(__file__).with_name("net_worker.py")
WORKER_NETS = ("lenet", "vgg_block", "mlp")   # convolutions, a fused group, FC layers


class ScaledNeuron(LocalNeuron):
    """Another forward body (only described here, never compiled)."""

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += 2.0 * self.weights[i] * self.inputs[0][i]


def _net(batch=BATCH, width=3, shift=0, neuron=LocalNeuron, name="dot", channels=4, seed=0,
         extra=None, shared=False):
    """Images through a conv and a ReLU, then a user neuron over a window of each row (of
    the conv's output if ``shared``: the ReLU then works on a copy the compiler adds)."""
    net = Net(batch, num_threads=1, seed=seed)
    x = MemoryDataLayer(net, "x", (2, 8, 8))
    conv = ConvolutionLayer("conv", net, x, 3, 3, pad=1)
    top = ReLULayer("relu", net, conv)
    if shared:
        WeightedSumLoss(net, "relu_loss", top)
        top = conv
    w = np.random.default_rng(seed).standard_normal((channels, width)).astype(np.float32)
    dot = Ensemble(net, name, neuron, (channels,), weights=w)
    add_connections(net, top, dot,
                    lambda o: (range(0, 1), range(o * STRIDE + shift, o * STRIDE + shift + width),
                               range(extra is not None, 1 + (extra is not None))))
    WeightedSumLoss(net, "loss", dot)
    return net, x


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """Stored programs on (not watched), an empty cache; counts the compiler's runs."""
    monkeypatch.delenv("LATTE_DUMP", raising=False)
    monkeypatch.delenv("LATTE_STORED_PROGRAMS", raising=False)
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    runs = []
    run_steps = pipeline._run_steps
    monkeypatch.setattr(pipeline, "_run_steps", lambda *a: runs.append(1) or run_steps(*a))
    return runs


def _train(net, x, steps=2):
    rng = np.random.default_rng(5)
    out = []
    for _ in range(steps):
        fill(net, x, rng)
        net.forward()
        net.backward()
        net.update(0.05, 0.9)
        out += [net.loss] + [p.value.copy() for p in net.params] + [p.grad.copy() for p in net.params]
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_an_equal_net_loads_the_stored_program_and_runs_alike(shared, compiles, tmp_path):
    first, x1 = _net(shared=shared)
    first.init()
    assert len(compiles) == 1 and len(list(tmp_path.glob("*.program"))) == 1
    second, x2 = _net(shared=shared)
    second.init()
    assert len(compiles) == 1   # loaded, not compiled
    assert second.program.stored and not first.program.stored
    assert second.program is not first.program
    assert [e.name for e in second.ensembles] == [e.name for e in first.ensembles]
    assert any(e.name == "relu.in" for e in second.ensembles) == shared
    ensembles = {id(e) for e in second.ensembles}
    assert all(id(p.ensemble) in ensembles for p in second.program.plans)
    assert all(id(e) in ensembles for e, _ in second.program.params)
    for a, b in zip(_train(first, x1), _train(second, x2), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("variable", ["LATTE_DUMP=ir:synthesize", "LATTE_STORED_PROGRAMS=0"])
def test_a_watched_compile_runs_the_compiler(variable, compiles, monkeypatch, capfd):
    _net()[0].init()
    monkeypatch.setenv(*variable.split("="))
    _net()[0].init()
    assert len(compiles) == 2
    assert ("after synthesize" in capfd.readouterr().err) == variable.startswith("LATTE_DUMP")


VARIANTS = {
    "batch": dict(batch=BATCH + 2),
    "closure": dict(width=2),
    "another closure value": dict(shift=1),
    "neuron code": dict(neuron=ScaledNeuron),
    "ensemble name": dict(name="dot2"),
    "shape": dict(channels=3),
    "captured object": dict(extra=object),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_key_follows_what_the_compiler_reads(variant, compiles):
    key = describe(_net()[0], (3, False, 1)).key
    assert describe(_net(**VARIANTS[variant])[0], (3, False, 1)).key != key


def test_the_key_follows_globals_settings_and_variables(compiles, monkeypatch):
    net = _net()[0]
    key = describe(net, (3, False, 1)).key
    assert describe(_net(seed=1)[0], (3, False, 1)).key == key   # weights are not compiled in
    assert len({key, describe(net, (2, False, 1)).key, describe(net, (3, True, 1)).key,
                describe(net, (3, False, 2)).key}) == 4
    monkeypatch.setattr(sys.modules[__name__], "STRIDE", 0)
    assert describe(net, (3, False, 1)).key != key
    monkeypatch.setattr(sys.modules[__name__], "STRIDE", 1)
    monkeypatch.setenv("LATTE_WINOGRAD", "0")
    assert describe(net, (3, False, 1)).key != key


def test_the_key_follows_the_blas_kernels(compiles, monkeypatch):
    """Whether the micro-kernel or BLAS runs a product is timed against the host's OpenBLAS
    kernels (``OPENBLAS_CORETYPE`` picks others): a program stored under one set of them is
    not loaded under another."""
    net = _net()[0]
    key = describe(net, (3, False, 1)).key
    host = machine.host()
    monkeypatch.setattr(machine, "host", lambda: {**host, "blas": host["blas"] + " Haswell"})
    assert describe(net, (3, False, 1)).key != key


def test_the_key_follows_a_users_module_a_mapping_reads(compiles, monkeypatch):
    """A mapping calling ``helpers.first(o)``: the module is the user's, so the function it
    names in it is part of the key, not the module's name alone."""
    helpers = types.ModuleType("user_helpers")
    helpers.first = lambda o: o
    monkeypatch.setattr(sys.modules[__name__], "user_helpers", helpers, raising=False)

    def build():
        net = Net(BATCH, num_threads=1, seed=0)
        x = MemoryDataLayer(net, "x", (8,))
        dot = Ensemble(net, "dot", LocalNeuron, (4,), weights=np.ones((4, 3), np.float32))
        add_connections(net, x, dot, lambda o: (range(user_helpers.first(o), user_helpers.first(o) + 3),))  # noqa: F821
        return net

    key = describe(build(), (3, False, 1)).key
    helpers.first = lambda o: o + 1
    assert describe(build(), (3, False, 1)).key != key


def test_a_net_the_encoder_cannot_describe_compiles_every_time(compiles, tmp_path):
    lock = threading.Lock()
    for _ in range(2):
        net, _ = _net()
        net.ensembles[-1].guard = lock   # host code's lock: no value a key can hold
        with pytest.raises(Undescribable, match="lock"):
            describe(net, (3, False, 1))
        net.init()
    assert len(compiles) == 2 and not list(tmp_path.glob("*.program"))


def test_a_module_attribute_that_raises_when_read_compiles_every_time(compiles, monkeypatch):
    """A lazy module whose ``__getattr__`` raises (not ``AttributeError``) for a name the
    mapping uses: the net is undescribable, and compiles as it always did."""
    lazy = types.ModuleType("user_lazy")
    lazy.__getattr__ = lambda name: (_ for _ in ()).throw(ImportError(f"no {name}"))
    monkeypatch.setattr(sys.modules[__name__], "user_lazy", lazy, raising=False)
    net = Net(BATCH, num_threads=1, seed=0)
    x = MemoryDataLayer(net, "x", (8,))
    dot = Ensemble(net, "dot", LocalNeuron, (4,), weights=np.ones((4, 3), np.float32))
    add_connections(net, x, dot, lambda o: (range(o, o + 3),) if user_lazy else ())  # noqa: F821
    WeightedSumLoss(net, "loss", dot)
    with pytest.raises(Undescribable, match="ImportError"):
        describe(net, (3, False, 1))
    net.init()
    assert len(compiles) == 1 and not net.program.stored


def test_a_damaged_entry_is_reported_and_compiled_anew(compiles, tmp_path):
    _net()[0].init()
    (entry,) = tmp_path.glob("*.program")
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF
    entry.write_bytes(bytes(data))
    net, x = _net()
    with pytest.warns(RuntimeWarning, match="damaged cache entry"):
        net.init()
    assert len(compiles) == 2
    fresh, x2 = _net()
    fresh.init()
    assert len(compiles) == 2   # the rebuilt entry loads
    for a, b in zip(_train(net, x), _train(fresh, x2), strict=True):
        np.testing.assert_array_equal(a, b)


class _Thing:
    """A user's object the description never met."""


def test_a_program_holding_an_object_from_outside_the_net_is_not_stored(compiles):
    net = _net()[0]
    desc = describe(net, (3, False, 1))
    conv = net.ensembles[1]
    stored.store(desc, Program(None, [], [], [], [(conv, "weights")], [], 3), "fp", 3)
    assert stored.load(desc)[0].params[0][0] is conv   # the net's own: named by its place
    other = describe(_net(name="other")[0], (3, False, 1))
    stored.store(other, Program(None, [], [], [], [(_Thing(), "w")], [], 3), "fp", 3)
    assert stored.load(other) is None   # a copy would part from the user's object


def test_a_new_process_loads_the_stored_programs(tmp_path):
    """The case stored programs exist for: ``net.init()`` in a new process, whose objects lie
    at other addresses (``--junk``), loads each net's program and trains as the first
    process did."""
    env = {k: v for k, v in os.environ.items() if k not in ("LATTE_DUMP", "LATTE_STORED_PROGRAMS")}
    env["LATTE_CACHE_DIR"] = str(tmp_path)
    runs = []
    for junk in ("0", "5000"):
        out = subprocess.run([sys.executable, str(WORKER), *WORKER_NETS, "--junk", junk],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append({r["net"]: r for r in map(json.loads, out.stdout.splitlines())})
    first, second = runs
    for name in WORKER_NETS:
        assert not first[name]["stored"] and second[name]["stored"], name
        for what in ("results", "loop_ir", "key", "groups"):
            assert second[name][what] == first[name][what], (name, what)
