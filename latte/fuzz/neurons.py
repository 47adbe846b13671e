"""Random neuron types, written as Python source with an exact hand-derived backward.

Neuron bodies are parsed from their source (``inspect.getsourcelines``), so a generated
neuron is text: :func:`neuron_source` writes a class whose ``forward`` reduces each input
connection to a local (a weighted sum, a sum of a math function, a maximum, one element)
and combines the locals by a random tape of operations (math functions, ``max``/``min``,
``if``/``else``, conditional expressions); ``backward`` recomputes the tape and applies
each operation's adjoint in reverse. :func:`load_class` imports the text from a file.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

# unary functions: (forward of X, derivative in terms of X), arguments kept in their domains
# and results away from where float32 rounds a range of arguments to one value that a later
# comparison decides on (float32's log(1 + x*x) is 0 for |x| < 2.4e-4, float64's is not)
UNARY = {
    "tanh": ("math.tanh(X)", "(1.0 - math.tanh(X) * math.tanh(X))"),
    "logsq": ("math.log(1.25 + X * X)", "(2.0 * X / (1.25 + X * X))"),
    "sqrtsq": ("math.sqrt(1.0 + X * X)", "(X / math.sqrt(1.0 + X * X))"),
    "exptanh": ("math.exp(math.tanh(X))",
                "(math.exp(math.tanh(X)) * (1.0 - math.tanh(X) * math.tanh(X)))"),
    "abs": ("abs(X)", "(1.0 if X > 0.0 else -1.0)"),
    "relu": ("max(X, 0.0)", "(1.0 if X > 0.0 else 0.0)"),
    "cap": ("min(X, 0.5)", "(1.0 if X < 0.5 else 0.0)"),
    "softsign": ("X / (1.0 + abs(X))", "(1.0 / ((1.0 + abs(X)) * (1.0 + abs(X))))"),
    "square": ("0.5 * X * X", "X"),
}

# in-place activations: forward of self.value, backward from the activated self.value
ACTIVATIONS = {
    "tanh": (["self.value = math.tanh(self.value)"],
             ["self.grad = self.grad * (1.0 - self.value * self.value)"]),
    "sigmoid": (["self.value = 1.0 / (1.0 + math.exp(-self.value))"],
                ["self.grad = self.grad * self.value * (1.0 - self.value)"]),
    "softsign": (["self.value = self.value / (1.0 + abs(self.value))"],
                 ["self.grad = self.grad * (1.0 - abs(self.value)) * (1.0 - abs(self.value))"]),
    "leaky": (["self.value = self.value if self.value > 0.0 else 0.125 * self.value"],
              ["if self.value <= 0.0:", "    self.grad = 0.125 * self.grad"]),
    "clamp": (["if self.value < 0.0:", "    self.value = 0.0"],
              ["if self.value <= 0.0:", "    self.grad = 0.0"]),
    "gain": (["self.value = self.value * self.gain"], ["self.grad = self.grad * self.gain"]),
}

REDUCTIONS = ("dot", "wsq", "fsum", "max", "pick", "fdot")


@dataclass(frozen=True)
class FieldPlan:
    """A field of a generated neuron: kind ``Param``/``Field``/``Batch``, vector length,
    and how neurons share it (``own``: one per neuron, ``lead``: per first index, ``all``)."""

    name: str
    kind: str
    length: int
    share: str


@dataclass(frozen=True)
class NeuronPlan:
    """A generated neuron type: its class name, source text and fields."""

    name: str
    source: str
    fields: tuple[FieldPlan, ...]


class _Tape:
    """Forward lines, adjoint lines (emitted in reverse) and fields of one neuron body."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.fwd: list[str] = []       # forward computation of the locals (recomputed in backward)
        self.adj: list[list[str]] = []  # adjoint blocks, in forward order
        self.fields: list[FieldPlan] = []
        self.locals: list[str] = []
        self.stores: list[str] = []    # forward-only lines (Batch field stores)
        self.used: set[str] = set()    # locals some operation reads

    def local(self, prefix: str) -> str:
        name = f"{prefix}{len(self.locals)}"
        self.locals.append(name)
        return name

    def field(self, name: str, kind: str, length: int) -> str:
        share = str(self.rng.choice(["own", "lead", "all"])) if kind != "Batch" else "own"
        self.fields.append(FieldPlan(name, kind, length, share))
        return name


def _sub(template: str, x: str) -> str:
    return template.replace("X", x)


def _reduction(t: _Tape, k: int, n: int, kind: str) -> str:
    """Reduce connection ``k`` (``n`` inputs) to a new local; return its name."""
    a, x = t.local("a"), f"self.inputs[{k}]"
    g, gx = f"g_{a}", f"self.grad_inputs[{k}]"
    idx = "i" if n == 1 or t.rng.random() < 0.7 else f"{n - 1} - i"
    if kind in ("dot", "fdot"):
        w = t.field(f"w{k}", "Param" if kind == "dot" else "Field", n)
        t.fwd += [f"{a} = 0.0", f"for i in range(len({x})):",
                  f"    {a} += self.{w}[i] * {x}[{idx}]"]
        body = [f"    {gx}[{idx}] += self.{w}[i] * {g}"]
        if kind == "dot":
            body.append(f"    self.grad_{w}[i] += {x}[{idx}] * {g}")
        t.adj.append([f"for i in range(len({x})):", *body])
    elif kind == "wsq":
        w, xi = t.field(f"w{k}", "Param", n), f"x{k}"
        t.fwd += [f"{a} = 0.0", f"for i in range(len({x})):", f"    {xi} = {x}[{idx}]",
                  f"    {a} += self.{w}[i] * {xi} * {xi}"]
        t.adj.append([f"for i in range(len({x})):", f"    {xi} = {x}[{idx}]",
                      f"    {gx}[{idx}] += 2.0 * self.{w}[i] * {xi} * {g}",
                      f"    self.grad_{w}[i] += {xi} * {xi} * {g}"])
    elif kind == "fsum":
        f, d = UNARY[str(t.rng.choice(sorted(UNARY)))]
        t.fwd += [f"{a} = 0.0", f"for i in range(len({x})):", f"    {a} += {_sub(f, f'{x}[i]')}"]
        t.adj.append([f"for i in range(len({x})):", f"    {gx}[i] += {g} * {_sub(d, f'{x}[i]')}"])
    elif kind == "max":
        m = f"m{k}"
        t.fwd += [f"{a} = {x}[0]", f"{m} = 0", f"for i in range(len({x})):",
                  f"    if {x}[i] > {a}:", f"        {a} = {x}[i]", f"        {m} = i"]
        if t.rng.random() < 0.5:   # keep the arg-max in a Batch field
            t.field(f"arg{k}", "Batch", 1)
            t.stores.append(f"self.arg{k} = {m}")
            m = f"self.arg{k}"
        t.adj.append([f"for i in range(len({x})):", f"    {gx}[i] += {g} * (i == {m})"])
    else:   # pick one element
        c = int(t.rng.integers(n))
        t.fwd.append(f"{a} = {x}[{c}]")
        t.adj.append([f"{gx}[{c}] += {g}"])
    return a


def _op(t: _Tape, out: str, args: list[str]) -> tuple[str, list[str]]:
    """A random unary or binary operation ``out = op(args)``: its line and adjoint lines."""
    g = f"g_{out}"
    if len(args) == 1 or t.rng.random() < 0.4:
        u = args[0]
        t.used.add(u)
        f, d = UNARY[str(t.rng.choice(sorted(UNARY)))]
        return f"{out} = {_sub(f, u)}", [f"g_{u} += {g} * {_sub(d, u)}"]
    u, v = args[0], args[1]
    t.used |= {u, v}
    kind = str(t.rng.choice(["+", "-", "*", "max", "min"]))
    if kind == "+":
        return f"{out} = {u} + {v}", [f"g_{u} += {g}", f"g_{v} += {g}"]
    if kind == "-":
        return f"{out} = {u} - {v}", [f"g_{u} += {g}", f"g_{v} -= {g}"]
    if kind == "*":
        return f"{out} = {u} * {v}", [f"g_{u} += {g} * {v}", f"g_{v} += {g} * {u}"]
    cmp = ">=" if kind == "max" else "<="
    return (f"{out} = {kind}({u}, {v})",
            [f"g_{u} += {g} if {u} {cmp} {v} else 0.0", f"g_{v} += 0.0 if {u} {cmp} {v} else {g}"])


def _combine(t: _Tape, values: list[str], steps: int) -> str:
    """Append ``steps`` random operations over ``values`` (and their results)."""
    for _ in range(steps):
        out = t.local("t")
        args = [str(v) for v in t.rng.choice(values, size=2)]
        shape = t.rng.random()
        if shape < 0.2:    # if/else statement, a different operation on each branch
            c, cut = str(t.rng.choice(values)), float(t.rng.choice([0.0, 0.25, -0.5]))
            line1, adj1 = _op(t, out, args)
            line2, adj2 = _op(t, out, [str(v) for v in t.rng.choice(values, size=2)])
            t.fwd += [f"if {c} > {cut}:", f"    {line1}", "else:", f"    {line2}"]
            t.adj.append([f"if {c} > {cut}:", *("    " + s for s in adj1), "else:",
                          *("    " + s for s in adj2)])
        elif shape < 0.3:  # conditional expression
            c, cut = str(t.rng.choice(values)), float(t.rng.choice([0.0, 0.5]))
            u, v = args
            t.used |= {u, v}
            t.fwd.append(f"{out} = {u} if {c} > {cut} else {v}")
            g = f"g_{out}"
            t.adj.append([f"g_{u} += {g} if {c} > {cut} else 0.0",
                          f"g_{v} += 0.0 if {c} > {cut} else {g}"])
        else:
            line, adj = _op(t, out, args)
            t.fwd.append(line)
            t.adj.append(adj)
        values.append(out)
    rest = [v for v in values[:-1] if v not in t.used]
    if not rest:
        return values[-1]
    out = t.local("t")   # every reduction and result reaches the value
    t.fwd.append(f"{out} = {' + '.join([values[-1], *rest])}")
    t.adj.append([f"g_{v} += g_{out}" for v in [values[-1], *rest]])
    return out


def neuron_source(name: str, input_lengths: list[int], rng: np.random.Generator,
                  backward: bool = True) -> NeuronPlan:
    """A random neuron type over connections with the given input lengths; without
    ``backward`` the compiler derives it."""
    t = _Tape(rng)
    values = [_reduction(t, k, n, str(rng.choice(REDUCTIONS if n > 1 else ("dot", "fsum", "pick"))))
              for k, n in enumerate(input_lengths)]
    out = _combine(t, values, int(rng.integers(1, 4)))
    tail = str(rng.choice(["plain", "bias", "scale"]))
    fwd = [*t.fwd, *t.stores]
    seed = [f"g_{out} += self.grad"]
    if tail == "bias":
        t.field("b", "Param", 1)
        fwd.append(f"self.value = {out} + self.b[0]")
        seed.append("self.grad_b[0] += self.grad")
    elif tail == "scale":
        t.field("s", "Field", 1)
        fwd.append(f"self.value = {out} * self.s")
        seed = [f"g_{out} += self.grad * self.s"]
    else:
        fwd.append(f"self.value = {out}")
    if fwd[0] == "a0 = 0.0" and fwd[2].startswith("    a0 += ") and rng.random() < 0.5:
        # the first sum accumulates in self.value (zero on entry), as stdlib neurons do
        fwd[:3] = [fwd[1], fwd[2].replace("a0 +=", "self.value +="), "a0 = self.value"]
    bwd = [*t.fwd, *(f"g_{v} = 0.0" for v in t.locals), *seed]
    for block in reversed(t.adj):
        bwd += block
    return NeuronPlan(name, class_text(name, t.fields, fwd, bwd if backward else None),
                      tuple(t.fields))


def activation_source(name: str, kind: str) -> NeuronPlan:
    """An in-place activation neuron type (for an ``ActivationEnsemble``)."""
    fwd, bwd = ACTIVATIONS[kind]
    fields = (FieldPlan("gain", "Field", 1, "own"),) if kind == "gain" else ()
    return NeuronPlan(name, class_text(name, fields, fwd, bwd), fields)


def class_text(name: str, fields, fwd: list[str], bwd: list[str] | None) -> str:
    """The module text of neuron class ``name`` with ``fields`` and the body lines (no
    ``backward`` method when ``bwd`` is None)."""
    decl = [f"    {f.name}: {f.kind}" for f in fields]
    back = ["", "    def backward(self):", *("        " + s for s in bwd)] if bwd is not None else []
    return "\n".join(["import math", "", "from latte import Batch, Field, Neuron, Param", "", "",
                      f"class {name}(Neuron):", *decl, "",
                      "    def forward(self):", *("        " + s for s in fwd), *back, ""])


_DIR: str | None = None


def source_dir() -> str:
    """The directory generated neuron modules are written to (one per process)."""
    global _DIR
    if _DIR is None:
        _DIR = tempfile.mkdtemp(prefix="latte-fuzz-")
        atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
    return _DIR


def load_class(plan: NeuronPlan) -> type:
    """Write ``plan.source`` to a module file and import the class from it."""
    digest = hashlib.sha1(plan.source.encode()).hexdigest()[:10]   # one file per text
    path = os.path.join(source_dir(), f"{plan.name}_{digest}.py")
    with open(path, "w") as f:
        f.write(plan.source)
    spec = importlib.util.spec_from_file_location(f"latte_fuzz_{plan.name}_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # inspect finds classes through their module
    spec.loader.exec_module(module)
    return getattr(module, plan.name)
