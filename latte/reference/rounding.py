"""Float32 rounding bounds: where compiled code, which computes in float32, may land, entry
by entry, around what the reference computes exactly (in float64).

With bounds on (``Reference(net, bounds=True)``) every float the interpreter computes
carries an *interval* ``(lo, hi)``, arrays broadcasting like the value, holding the exact
value and every value a float32 evaluation of the same neuron bodies may give (interval
arithmetic over the extended reals, endpoints rounded outward). The rules:

- data, parameters and fields hold float32 values already: exact; a constant in a neuron
  body spans its float32 rounding;
- an operation's exact result over its operands' intervals is bounded by evaluating it at
  the endpoints (``+ - * /``, and the increasing ``exp``, ``log``, ``sqrt``, ``tanh``;
  ``max``, ``min``, ``abs`` exactly); rounding is monotone, so the endpoints then round
  outward: by ``U`` (float32's unit roundoff) of their magnitude for ``* /`` and ``sqrt``,
  by ``LIBM`` for ``exp``, ``tanh`` (``latte.compiler.mathfn``: 2 ulp) and ``log``;
- a sum rounds by ``U`` times the magnitudes of both operands, not of the result: the
  compiler's ``reassoc`` flag lets it sum in another order, whose partial sums this bounds
  where the terms cancel; in any order a partial sum lies between the sum of the terms'
  negative parts and that of their positive parts, so the sum may overflow (and stay
  infinite, or meet the other infinity: NaN) where those pass float32's range;
- a long sum (a gradient accumulated over lanes, a reduction over the batch) would be
  bounded thousands of times too loosely so (n roundings of the terms' magnitude), so its
  own rounding gets the running error bound instead (Higham, "Accuracy and Stability of
  Numerical Algorithms", 3.1): ``U * sum |s_k|`` over its partial sums ``s_k``, which holds
  for the interpreter's order; the compiler's orders (loops, vector lanes, blocked GEMMs)
  sum the same terms in subsets whose partial sums are taken to be no larger;
- an endpoint past ``LIMIT`` becomes infinite: float32 overflows past its range, and the
  evaluation the compiler chooses may form intermediates some times larger than the
  interpreter's (reassociated products; its derived adjoints combine like terms, ``2 * x``
  for ``x * x``); an operation that may meet ``0 * inf``, ``inf - inf`` or a division by an
  interval holding 0 is unbounded ``(-inf, inf)``, NaN included, and so is every function
  of an unbounded value (``exp`` of it may be NaN, not only ``[0, inf]``: case 42731, a
  softmax of an overflowed logit). Overflow is no error: ``1 / (1 + exp(212))`` is
  ``[0, 8.5e-93]``, as float32's 0 is.

Not modelled: which way a comparison goes (an ``if``, a ``max``'s gradient or an arg-max on
a near-tie: the random tester finds those by nudging inputs), results below float32's
normal range, and ``//`` or ``%`` of inexact floats (a jump: unbounded). ``Batch`` fields
are taken to hold exact values (arg-max indices, dropout masks).
"""

from __future__ import annotations

import numpy as np

U = 2.0 ** -24                       # float32's unit roundoff (round to nearest)
LIBM = 4 * U                         # exp, tanh (2 ulp, latte.compiler.mathfn) and log
BIG = float(np.finfo(np.float32).max)
LIMIT = BIG * 2.0 ** -16             # past it, some float32 evaluation may overflow
INF = float("inf")

_UNARY = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh}
_ULPS = {"exp": LIBM, "log": LIBM, "tanh": LIBM, "sqrt": U}


def exact(x) -> tuple:
    """The interval of a value float32 holds as is: ``(x, x)``; a float constant spans its
    float32 rounding."""
    if isinstance(x, (float, np.floating)):
        f = float(np.float32(x))
        return min(float(x), f), max(float(x), f)
    return x, x


def outward(lo, hi, down, up) -> tuple:
    """``[lo - down, hi + up]`` (a rounding; an infinite end stays: ``[inf, inf]`` is a
    sure overflow), infinite past ``LIMIT``, unbounded where an end is NaN."""
    with np.errstate(invalid="ignore"):
        lo = np.where(np.isinf(lo), lo, lo - down)
        hi = np.where(np.isinf(hi), hi, hi + up)
        bad = np.isnan(lo) | np.isnan(hi)
        return (np.where(bad | (lo < -LIMIT), -INF, lo), np.where(bad | (hi > LIMIT), INF, hi))


def _rounded(lo, hi, ulp) -> tuple:
    return outward(lo, hi, ulp * np.abs(lo), ulp * np.abs(hi))


def parts(lo, hi, total) -> tuple:
    """What :func:`summed` needs of terms in ``[lo, hi]``, summed by ``total``: the
    endpoints' sums, their magnitudes, the negative parts of the low ends and the positive
    parts of the high ends."""
    with np.errstate(invalid="ignore"):
        return ((total(lo), total(hi)), (total(np.abs(lo)), total(np.abs(hi))),
                (total(np.minimum(lo, 0.0)), total(np.maximum(hi, 0.0))))


def summed(n: int, sums: tuple, mags: tuple, signed: tuple) -> tuple:
    """The interval of a sum in any order, ``n`` additions each rounding by at most ``U``
    times the partial sum (at most the terms' magnitudes ``mags``, at either end), from the
    endpoints' ``sums``; infinite on a side where the ``signed`` parts may overflow."""
    lo, hi = outward(*sums, *((n * U * m for m in mags) if n else (0.0, 0.0)))
    return np.where(signed[0] < -LIMIT, -INF, lo), np.where(signed[1] > LIMIT, INF, hi)


def _corners(f, a: tuple, b: tuple) -> tuple:
    """The smallest and largest of ``f`` at the corners of the box ``a x b`` (NaN if any
    corner is: ``minimum`` and ``maximum`` keep NaN)."""
    with np.errstate(all="ignore"):
        c = [f(x, y) for x in a for y in b]
    return (np.minimum(np.minimum(c[0], c[1]), np.minimum(c[2], c[3])),
            np.maximum(np.maximum(c[0], c[1]), np.maximum(c[2], c[3])))


def binop(op: str, x, y, a: tuple, b: tuple) -> tuple:
    """The interval of ``x <op> y`` given the operands' intervals ``a``, ``b`` (``x``,
    ``y``: their values, which say whether one is a mask)."""
    with np.errstate(all="ignore"):
        if op in ("+", "-"):
            b = b if op == "+" else (-b[1], -b[0])
            return summed(1, (a[0] + b[0], a[1] + b[1]),
                          (np.abs(a[0]) + np.abs(b[0]), np.abs(a[1]) + np.abs(b[1])),
                          (np.minimum(a[0], 0.0) + np.minimum(b[0], 0.0),
                           np.maximum(a[1], 0.0) + np.maximum(b[1], 0.0)))
        if op in ("max", "min"):
            f = np.maximum if op == "max" else np.minimum
            return _keep_unbounded((f(a[0], b[0]), f(a[1], b[1])), a, b)
        if op == "*":
            lo, hi = _corners(np.multiply, a, b)
            return _rounded(lo, hi, 0.0 if _mask(x) or _mask(y) else U)
        if op == "/":
            lo, hi = _corners(np.true_divide, a, b)
            zero = (b[0] <= 0) & (b[1] >= 0)
            return _rounded(np.where(zero, np.nan, lo), np.where(zero, np.nan, hi), U)
        whole = np.equal(a[0], a[1]) & np.equal(b[0], b[1])   # // and %: exact operands only
        out = np.floor_divide(a[0], b[0]) if op == "//" else np.remainder(a[0], b[0])
        return outward(np.where(whole, out, np.nan), np.where(whole, out, np.nan), 0.0, 0.0)


def call(fn: str, a: tuple) -> tuple:
    """The interval of ``fn(x)`` given the argument's interval ``a``."""
    if fn == "neg":
        return -a[1], -a[0]
    if fn == "abs":
        lo = np.where(a[0] >= 0, a[0], np.where(a[1] <= 0, -a[1], 0.0))
        return _keep_unbounded((lo, np.maximum(np.abs(a[0]), np.abs(a[1]))), a)
    if fn == "sigmoid":   # 1 / (1 + exp(-x)): its three roundings
        one = exact(1.0)
        return binop("/", 1.0, 1.0, one, binop("+", 1.0, 1.0, one, call("exp", call("neg", a))))
    with np.errstate(all="ignore"):
        return _keep_unbounded(_rounded(_UNARY[fn](a[0]), _UNARY[fn](a[1]), _ULPS[fn]), a)


def _keep_unbounded(out: tuple, *args: tuple) -> tuple:
    """``out``, unbounded where an argument is: ``(-inf, inf)`` stands for NaN as well,
    which a function of it keeps."""
    nan = False
    for lo, hi in args:
        nan = nan | (np.isneginf(lo) & np.isposinf(hi))
    return np.where(nan, -INF, out[0]), np.where(nan, INF, out[1])


def where(mask, a: tuple, b: tuple) -> tuple:
    """The interval of ``a if mask else b``."""
    return np.where(mask, a[0], b[0]), np.where(mask, a[1], b[1])


def _mask(x) -> bool:
    """A boolean factor (a mask): multiplying by it does not round."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, np.ndarray) and x.dtype == bool)


def total(x, a: tuple, axis: tuple, keepdims: bool = False) -> tuple:
    """The interval of a sum of the terms ``x`` (intervals ``a``) over ``axis``: the
    endpoints' sums (:func:`summed`, no rounding) widened by the sum's own rounding
    (:func:`spread` of its partial sums)."""
    lo, hi = summed(0, *parts(*a, lambda t: np.sum(t, axis=axis, keepdims=keepdims)))
    lead = np.moveaxis(np.asarray(x, np.float64), axis, tuple(range(-len(axis), 0)))
    partial = np.cumsum(lead.reshape(*lead.shape[:lead.ndim - len(axis)], -1), axis=-1)
    sizes = np.sum(np.abs(partial), axis=-1)
    if keepdims:
        sizes = np.expand_dims(sizes, axis)
    return spread(lo, hi, sizes)


def accumulation(before: tuple, added: tuple) -> tuple:
    """The interval of an entry in ``before`` after terms are added into it (``added``:
    their :func:`parts`), the additions' rounding left out (see :func:`partials`)."""
    own = parts(*before, lambda x: x)
    return summed(0, *(tuple(x + y for x, y in zip(a, b)) for a, b in zip(own, added)))


def partials(lin: np.ndarray, terms: np.ndarray, before: np.ndarray) -> np.ndarray:
    """The magnitudes of the partial sums, summed by destination (flat ``before``'s shape),
    of adding ``terms`` in order into the entries ``lin`` of ``before``."""
    if not lin.size:
        return np.zeros(before.shape)
    order = np.argsort(lin, kind="stable")
    lin, terms = lin[order], terms[order]
    run = np.cumsum(terms)
    first = np.flatnonzero(np.r_[True, lin[1:] != lin[:-1]])   # each destination's first term
    base = np.repeat(run[first] - terms[first], np.diff(np.r_[first, len(lin)]))
    partial = before.reshape(-1)[lin] + run - base
    return np.bincount(lin, np.abs(partial), before.size).reshape(before.shape)


def spread(lo, hi, sizes) -> tuple:
    """``[lo, hi]`` widened by the rounding of a sum whose partial sums' magnitudes total
    ``sizes``: ``U * sizes`` either way."""
    return outward(lo, hi, U * sizes, U * sizes)


def radius(value, interval: tuple):
    """How far from ``value`` the interval reaches, either way (infinite if unbounded)."""
    with np.errstate(invalid="ignore"):
        r = np.maximum(value - interval[0], interval[1] - value)
    return np.where(np.isnan(r), INF, r)


def around(value, r) -> tuple:
    """The interval ``value +- r``, infinite past float32's range."""
    return outward(value, value, r, r)
