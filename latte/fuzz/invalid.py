"""Random invalid programs: each kind must be rejected at compile time with a latte error.

:func:`invalid_net` builds a small net whose neuron body (written to a file like every
generated neuron) or mapping breaks one rule: an index out of its vector (constant,
negative, loop-dependent, behind an ``if``), a non-integer index, a local read before it is
assigned on some path, or a mapping that leaves the source for a few neurons of an ensemble
too large to check by sampling.
"""

from __future__ import annotations

import numpy as np

from latte import Ensemble, Net, add_connections
from latte.fuzz.neurons import FieldPlan, NeuronPlan, class_text, load_class
from latte.stdlib import MemoryDataLayer

OK_BACKWARD = ["for i in range(len(self.inputs[0])):",
               "    self.grad_inputs[0][i] += self.grad * self.w[0]"]


def _bodies(kind: str, n: int, k: int) -> tuple[list[str], list[str]]:
    """Forward and backward lines of a neuron over ``n`` inputs that breaks rule ``kind``;
    ``k >= 1`` varies the offending index."""
    x = "self.inputs[0]"
    if kind == "const_index":
        return [f"self.value = {x}[{n - 1 + k}] * self.w[0]"], OK_BACKWARD
    if kind == "negative_index":
        return [f"self.value = {x}[{-k}] * self.w[0]"], OK_BACKWARD
    if kind == "loop_index":
        return ["for i in range(len(self.inputs[0])):",
                f"    self.value += {x}[i + {k}] * self.w[0]"], OK_BACKWARD
    if kind == "guarded_index":
        return [f"if {x}[0] > 0.0:", f"    self.value = self.w[{k}]"], OK_BACKWARD
    if kind == "guarded_loop_index":
        return [f"if {x}[0] > 0.0:", "    for i in range(len(self.inputs[0])):",
                f"        self.value += {x}[i + {k}]"], OK_BACKWARD
    if kind == "grad_index":
        return ([f"self.value = {x}[0] * self.w[0]"],
                [f"self.grad_inputs[0][{n - 1 + k}] += self.grad * self.w[0]"])
    if kind == "float_index":
        return [f"self.value = {x}[{k - 0.5}] * self.w[0]"], OK_BACKWARD
    if kind == "unassigned_local":
        return [f"if {x}[0] > 0.0:", f"    t = {x}[0] * self.w[0]", "self.value = t"], OK_BACKWARD
    raise ValueError(f"unknown kind {kind!r}")


BODY_KINDS = ("const_index", "negative_index", "loop_index", "guarded_index",
              "guarded_loop_index", "grad_index", "float_index", "unassigned_local")
KINDS = (*BODY_KINDS, "mapping_large")


def invalid_net(kind: str, seed: int) -> tuple[Net, str]:
    """An uncompiled net that breaks rule ``kind``, and what its error must name (the
    neuron's file, or the ensemble for a mapping)."""
    rng = np.random.default_rng(seed)
    net = Net(int(rng.integers(1, 4)), opt_level=int(rng.integers(0, 4)), num_threads=1, seed=seed)
    if kind == "mapping_large":   # 65 x 65 > 4096 neurons: one row of them leaves the source
        side, row = 65, int(rng.integers(1, 64))
        x = MemoryDataLayer(net, "x", (side, side))
        name = f"bad{kind}{seed}"
        plan = _plan(name, ["self.value = self.inputs[0][0] * self.w[0]"], OK_BACKWARD)
        ens = Ensemble(net, name, load_class(plan), (side, side),
                       w=(np.ones((1, 1), np.float32), lambda *i: 0))
        add_connections(net, x, ens, lambda i, j: (i, j + 1 if i == row else j))
        return net, name
    n = int(rng.integers(2, 9))
    x = MemoryDataLayer(net, "x", (n,))
    name = f"bad{kind}{seed}"
    plan = _plan(name, *_bodies(kind, n, int(rng.integers(1, 4))))
    ens = Ensemble(net, name, load_class(plan), (int(rng.integers(1, 6)),),
                   w=(np.ones((1, 1), np.float32), lambda *i: 0))
    add_connections(net, x, ens, lambda *i: (range(n),))
    return net, f"N{name}_"   # the file's name starts so


def _plan(name: str, fwd: list[str], bwd: list[str]) -> NeuronPlan:
    fields = (FieldPlan("w", "Param", 1, "all"),)
    return NeuronPlan(f"N{name}", class_text(f"N{name}", fields, fwd, bwd), fields)
