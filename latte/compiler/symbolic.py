"""Symbolic evaluation of mapping functions: call one on affine "integers" of the sink index.

A mapping such as ``lambda c, y, x: (range(C), range(2*y - 1, 2*y + 2), x)`` is called once
with :class:`Sym` arguments (affine forms of the sink index) and ``range`` replaced in its
globals by :func:`sym_range`. Straight-line arithmetic (``+ - *`` by integers) on them gives
the mapping's result at every sink index at once, which proves an affine fit for every
neuron, however large the ensemble. A sink index floor-divided by a positive constant
(``o // 4``, a group of channels) becomes a variable of its own, :func:`quot_var`, which
makes the result quasi-affine (``o % 4`` is ``o - 4 * (o // 4)``). Anything else (a
comparison or branch on the index, ``//`` of a sum, indexing a table, converting to
``int``) raises :class:`Untraceable`, and the caller falls back to evaluating the mapping at
every neuron.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import numpy as np

from latte.compiler.ir import Affine


class Untraceable(Exception):
    """The callable did something with a symbolic index that is not affine arithmetic."""


def _refuse(*_args, **_kwargs):
    raise Untraceable


def quot_var(name: str, q: int) -> str:
    """The variable standing for ``floor(name / q)``."""
    return f"{name}//{q}"


def split_var(var: str) -> tuple[str, int]:
    """``(name, q)`` of a variable made by :func:`quot_var` (``q = 1`` for a plain one)."""
    name, _, q = var.partition("//")
    return name, int(q) if q else 1


class Sym:
    """An integer that is an affine form of the sink index."""

    __slots__ = ("aff",)
    __hash__ = None   # dict/set lookups would compare values: refuse them

    def __init__(self, aff: Affine):
        self.aff = aff

    def __add__(self, other):
        o = _affine(other)
        return NotImplemented if o is None else Sym(self.aff + o)

    __radd__ = __add__

    def __sub__(self, other):
        o = _affine(other)
        return NotImplemented if o is None else Sym(self.aff - o)

    def __rsub__(self, other):
        o = _affine(other)
        return NotImplemented if o is None else Sym(o - self.aff)

    def __mul__(self, other):
        if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
            return Sym(self.aff * int(other))
        raise Untraceable

    __rmul__ = __mul__

    def __floordiv__(self, other):
        """``index // q`` of a plain sink index (not a sum, not already a quotient)."""
        if not (isinstance(other, (int, np.integer)) and not isinstance(other, bool) and other > 0
                and self.aff.const == 0 and len(self.aff.terms) == 1):
            raise Untraceable
        (var, coef), = self.aff.terms
        if coef != 1 or split_var(var)[1] != 1:
            raise Untraceable
        return self if other == 1 else Sym(Affine.of(quot_var(var, int(other))))

    def __mod__(self, other):
        """``index % q == index - q * (index // q)`` (a channel shuffle's ``o % g``)."""
        return self - (self // other) * int(other)

    def __neg__(self):
        return Sym(self.aff * -1)

    def __pos__(self):
        return self

    __bool__ = __index__ = __int__ = __float__ = __eq__ = __ne__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __rfloordiv__ = _refuse
    __rmod__ = __truediv__ = __rtruediv__ = __pow__ = __abs__ = _refuse
    __array__ = __iter__ = __len__ = __format__ = _refuse


def _affine(x) -> Affine | None:
    if isinstance(x, Sym):
        return x.aff
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return Affine((), int(x))
    return None


@dataclass(frozen=True)
class SymRange:
    """``range(lo, lo + step * length, step)`` with ``lo`` affine in the sink index."""

    lo: Affine
    step: int
    length: int


def sym_range(*args):
    """``range`` for the traced call: a real range of ints, a :class:`SymRange` otherwise."""
    if not any(isinstance(a, Sym) for a in args):
        return range(*args)
    start, stop, step = (0, args[0], 1) if len(args) == 1 else (*args[:2], 1) if len(args) == 2 \
        else args
    lo, hi = _affine(start), _affine(stop)
    if lo is None or hi is None or not isinstance(step, (int, np.integer)) or step == 0:
        raise Untraceable
    diff = hi - lo
    if diff.terms:   # the length would depend on the neuron
        raise Untraceable
    return SymRange(lo, int(step), len(range(0, diff.const, int(step))))


def trace(fn: Callable, names: list[str]):
    """``fn(*sink_index)`` with the sink index's entries the variables ``names``, or raise
    :class:`Untraceable`. Entries of the result are ints, :class:`Sym`, ranges or
    :class:`SymRange`."""
    code = getattr(fn, "__code__", None)
    if code is None or not isinstance(getattr(fn, "__globals__", None), dict):
        raise Untraceable
    traced = types.FunctionType(code, {**fn.__globals__, "range": sym_range}, fn.__name__,
                                fn.__defaults__, fn.__closure__)
    traced.__kwdefaults__ = fn.__kwdefaults__
    try:
        return traced(*(Sym(Affine.of(n)) for n in names))
    except Exception as exc:  # noqa: BLE001 - whatever the user's code does with a Sym
        raise Untraceable from exc
