"""Reverse mode by tape for the reference interpreter: the gradient of a neuron without a
hand-written ``backward``, taken from the operations its ``forward`` actually ran.

This is independent of the compiler's derived backward (a transformation of the neuron IR):
here every traced operation records its local derivatives while it runs, and
:func:`backprop` walks the recorded graph from the outputs back to the leaves. The tie
conventions follow the language's definitions: ``max(a, b)`` is ``a if a > b else b`` (a tie
sends the gradient to ``b``), ``min(a, b)`` is ``a if a < b else b``, ``abs'(0) = 0``.
Derivatives are written as the compiler's derived backward writes them (through an
operation's result where it can: ``-(g * (a / b)) / b`` for ``a / b``, ``g * s * (1 - s)``
for a sigmoid ``s``): equal to other forms in float64, and so the bounds of a derived
backward bound the rounding compiled code does.

A node may also carry a float32 rounding bound, its ``interval`` (:mod:`latte.reference.rounding`):
operations on bounded values give bounded results, and the vector-Jacobian products, written
as arithmetic on the nodes, bound the gradients they compute as well.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np

from latte.reference import rounding

_order = itertools.count()


class Node:
    """A traced or bounded float value; ``parents`` pairs each traced operand with its
    vector-Jacobian product, ``sink`` (traced leaves) receives the node's total gradient,
    ``interval`` (None: not bounded), ``(lo, hi)``, holds ``value`` and what float32 may
    compute instead. Arithmetic on nodes computes plain (untraced) values, bounded where an
    operand is."""

    __slots__ = ("value", "parents", "sink", "order", "interval")
    __array_ufunc__ = None   # ``array * node`` is the node's ``__rmul__``, not an object array

    def __init__(self, value, parents: tuple = (), sink: Callable[[np.ndarray], None] | None = None,
                 interval: tuple | None = None):
        self.value = value
        self.parents = parents
        self.sink = sink
        self.order = next(_order)
        self.interval = interval

    @property
    def traced(self) -> bool:
        return self.sink is not None or bool(self.parents)

    def __add__(self, other):
        return arith("+", self, other)

    def __radd__(self, other):
        return arith("+", other, self)

    def __sub__(self, other):
        return arith("-", self, other)

    def __rsub__(self, other):
        return arith("-", other, self)

    def __mul__(self, other):
        return arith("*", self, other)

    def __rmul__(self, other):
        return arith("*", other, self)

    def __truediv__(self, other):
        return arith("/", self, other)

    def __rtruediv__(self, other):
        return arith("/", other, self)

    def __neg__(self):
        return bounded(-self.value, rounding.call("neg", self.interval) if is_bounded(self) else None)


def raw(x: Any):
    """The plain value of a possibly traced or bounded one."""
    return x.value if isinstance(x, Node) else x


def is_bounded(x: Any) -> bool:
    return isinstance(x, Node) and x.interval is not None


def interval(x: Any) -> tuple:
    """``x``'s interval (:func:`rounding.exact` for a plain value)."""
    if is_bounded(x):
        return x.interval
    return rounding.exact(raw(x))


def bounded(value, iv: tuple | None):
    """``value`` bounded by the interval ``iv`` (plain when ``iv`` is None)."""
    return value if iv is None else Node(value, interval=iv)


_ARITH = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide}


def arith(op: str, a, b):
    """``a <op> b`` untraced, bounded when either operand is."""
    x, y = raw(a), raw(b)
    with np.errstate(all="ignore"):
        out = _ARITH[op](x, y)
    if not (is_bounded(a) or is_bounded(b)):
        return out
    return bounded(out, rounding.binop(op, x, y, interval(a), interval(b)))


def total(g, axis: tuple, keepdims: bool = False):
    """``g.sum(axis)``, bounded when ``g`` is."""
    out = np.sum(raw(g), axis=axis, keepdims=keepdims)
    if not is_bounded(g):
        return out
    shape = np.shape(g.value)
    ends = tuple(np.broadcast_to(e, shape) for e in g.interval)
    return bounded(out, rounding.total(g.value, ends, axis, keepdims))


def unbroadcast(g, like) -> Any:
    """Sum ``g`` down to the shape of ``like`` (a scalar or an array numpy broadcast to g)."""
    shape = np.shape(like)
    if np.shape(raw(g)) == shape:
        return g
    if not shape:
        return total(g, tuple(range(np.ndim(raw(g)))))
    lead = np.ndim(raw(g)) - len(shape)
    g = total(g, tuple(range(lead))) if lead > 0 else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and np.shape(raw(g))[i] != 1)
    return total(g, axes, keepdims=True) if axes else g


def make(value, operands: tuple, vjps: tuple[Callable, ...], iv: tuple | None = None):
    """``value`` traced from ``operands`` (each traced one gets ``vjp(g)``) and bounded by
    the interval ``iv``, or plain if neither."""
    parents = tuple((a, f) for a, f in zip(operands, vjps) if isinstance(a, Node) and a.traced)
    return Node(value, parents, interval=iv) if parents or iv is not None else value


def binop(op: str, a, b, out):
    """Trace and bound ``out = a <op> b`` (comparisons and the like come out plain)."""
    x, y = raw(a), raw(b)
    if op == "+":
        vjps = (lambda g: g, lambda g: g)
    elif op == "-":
        vjps = (lambda g: g, lambda g: -g)
    elif op == "*":
        vjps = (lambda g: g * b, lambda g: g * a)
    elif op == "/":
        vjps = (lambda g: g / b, lambda g: -((g * node) / b))
    elif op == "//":
        vjps = (lambda g: 0.0 * g, lambda g: 0.0 * g)
    elif op == "%":
        vjps = (lambda g: g, lambda g: -g * np.floor_divide(x, y))
    elif op == "max":
        vjps = (lambda g: g * (x > y), lambda g: g * ~np.greater(x, y))
    elif op == "min":
        vjps = (lambda g: g * (x < y), lambda g: g * ~np.less(x, y))
    else:
        return raw(out)
    iv = (rounding.binop(op, x, y, interval(a), interval(b)) if is_bounded(a) or is_bounded(b)
          else None)
    node = make(out, (a, b), tuple(_fit(f, v) for f, v in zip(vjps, (x, y))), iv)
    return node   # the vjps read the result as computed


def call(fn: str, a, out):
    """Trace and bound ``out = fn(a)`` for exp, log, tanh, sqrt, abs, neg and sigmoid."""
    x = raw(a)
    vjp = {"exp": lambda g: g * node, "log": lambda g: g / a,
           "tanh": lambda g: g * (1.0 - node * node), "sqrt": lambda g: g / (2.0 * node),
           "abs": lambda g: g * np.sign(x), "neg": lambda g: -g,
           "sigmoid": lambda g: g * (node * (1.0 - node))}[fn]
    iv = rounding.call(fn, a.interval) if is_bounded(a) else None
    node = make(out, (a,), (_fit(vjp, x),), iv)   # the vjps read the result as computed
    return node


def where(mask, a, b, out):
    """Trace and bound ``out = a where mask else b``."""
    iv = (rounding.where(mask, interval(a), interval(b)) if is_bounded(a) or is_bounded(b)
          else None)
    return make(out, (a, b), (_fit(lambda g: g * mask, raw(a)),
                              _fit(lambda g: g * ~mask, raw(b))), iv)


def _fit(vjp: Callable, like) -> Callable:
    return lambda g: unbroadcast(vjp(g), like)


def _add(grads: dict, key: int, g) -> None:
    grads[key] = grads[key] + g if key in grads else g


def backprop(seeds: list[tuple[Any, np.ndarray]]) -> None:
    """Propagate each ``(node, gradient)`` seed to the leaves' sinks."""
    nodes: dict[int, Node] = {}
    stack = [n for n, _ in seeds if isinstance(n, Node)]
    while stack:
        n = stack.pop()
        if id(n) not in nodes:
            nodes[id(n)] = n
            stack.extend(p for p, _ in n.parents)
    grads: dict[int, Any] = {}
    for n, g in seeds:
        if isinstance(n, Node):
            _add(grads, id(n), g)
    for n in sorted(nodes.values(), key=lambda n: -n.order):
        g = grads.pop(id(n), None)
        if g is None:
            continue
        if n.sink is not None:
            n.sink(g)
        for p, vjp in n.parents:
            _add(grads, id(p), vjp(g))
