"""Reverse mode by tape for the reference interpreter: the gradient of a neuron without a
hand-written ``backward``, taken from the operations its ``forward`` actually ran.

This is independent of the compiler's derived backward (a transformation of the neuron IR):
here every traced operation records its local derivatives while it runs, and
:func:`backprop` walks the recorded graph from the outputs back to the leaves. The tie
conventions follow the language's definitions: ``max(a, b)`` is ``a if a > b else b`` (a tie
sends the gradient to ``b``), ``min(a, b)`` is ``a if a < b else b``, ``abs'(0) = 0``.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np

_order = itertools.count()


class Node:
    """A traced float value; ``parents`` pairs each operand node with its vector-Jacobian
    product, ``sink`` (leaves) receives the node's total gradient."""

    __slots__ = ("value", "parents", "sink", "order")

    def __init__(self, value, parents: tuple = (), sink: Callable[[np.ndarray], None] | None = None):
        self.value = value
        self.parents = parents
        self.sink = sink
        self.order = next(_order)


def raw(x: Any):
    """The plain value of a possibly traced one."""
    return x.value if isinstance(x, Node) else x


def unbroadcast(g: np.ndarray, like) -> Any:
    """Sum ``g`` down to the shape of ``like`` (a scalar or an array numpy broadcast to g)."""
    shape = np.shape(like)
    if np.shape(g) == shape:
        return g
    if not shape:
        return float(np.sum(g))
    g = np.sum(g, axis=tuple(range(np.ndim(g) - len(shape)))) if np.ndim(g) > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and np.shape(g)[i] != 1)
    return np.sum(g, axis=axes, keepdims=True) if axes else g


def make(value, operands: tuple, vjps: tuple[Callable, ...]):
    """``value`` traced from ``operands`` (each gets ``vjp(g)``), or plain if none is traced."""
    parents = tuple((a, f) for a, f in zip(operands, vjps) if isinstance(a, Node))
    return Node(value, parents) if parents else value


def binop(op: str, a, b, out):
    """Trace ``out = a <op> b`` for the differentiable binary operators."""
    x, y = raw(a), raw(b)
    if op == "+":
        vjps = (lambda g: g, lambda g: g)
    elif op == "-":
        vjps = (lambda g: g, lambda g: -g)
    elif op == "*":
        vjps = (lambda g: g * y, lambda g: g * x)
    elif op == "/":
        vjps = (lambda g: g / y, lambda g: -g * x / (y * y))
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
    return make(out, (a, b), tuple(_fit(f, v) for f, v in zip(vjps, (x, y))))


def call(fn: str, a, out):
    """Trace ``out = fn(a)`` for exp, log, tanh, sqrt, abs and neg."""
    x = raw(a)
    vjp = {"exp": lambda g: g * out, "log": lambda g: g / x, "tanh": lambda g: g * (1.0 - out * out),
           "sqrt": lambda g: g / (2.0 * out), "abs": lambda g: g * np.sign(x),
           "neg": lambda g: -g}[fn]
    return make(out, (a,), (_fit(vjp, x),))


def where(mask, a, b, out):
    """Trace ``out = a where mask else b``."""
    return make(out, (a, b), (_fit(lambda g: g * mask, raw(a)), _fit(lambda g: g * ~mask, raw(b))))


def _fit(vjp: Callable, like) -> Callable:
    return lambda g: unbroadcast(vjp(g), like)


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
            grads[id(n)] = grads.get(id(n), 0.0) + g
    for n in sorted(nodes.values(), key=lambda n: -n.order):
        g = grads.pop(id(n), None)
        if g is None:
            continue
        if n.sink is not None:
            n.sink(g)
        for p, vjp in n.parents:
            grads[id(p)] = grads.get(id(p), 0.0) + vjp(g)
