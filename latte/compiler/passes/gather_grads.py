"""Input gradients of same-size stride-1 windows as gathers (a transposed convolution).

A convolution's backward synthesizes its input gradient as a scatter: each output position
adds its window's share, ``src.grad[n, c, y + d*i - p, x + d*j - p] += w(o, c, i, j) *
g[n, o, y, x]``, which data-copy computes as a product into a tile buffer (``k``: the output
channels) and a scatter-add of its ``kh * kw`` shifted planes. Where the window moves by one
and keeps the size (``p = d*(k - 1)/2``), the same sums are a forward convolution of the
output gradient with the filters transposed and flipped:

    src.grad[n, c, y, x] += wt[c, o, i, j] * (g[n, o, y + d*i - p, x + d*j - p] if inside else 0)

with ``wt[c, o, i, j] = w(o, c, kh-1-i, kw-1-j)`` copied at the start of the kernel (the
weights change between runs). The Winograd pass then computes the gather as it computes a
forward convolution, with no scatter-add: the rewrite is kept only where its pattern
matches (3x3 windows, enough channels and tiles); as im2col and a GEMM (``k``: output
channels x window) the gather ran no faster than the scatter, and slower at 7x7 pixels.
The rewritten nest loops over the source's dimensions (its tiles are the source's rows); in
a fused group it reads the output gradient's rows up to ``p`` past its tile, and
:func:`~latte.compiler.fusion.merge` runs it that many tiles behind (the batch loop's
``reads_ahead``).

Only the pattern above is rewritten: one multiply-accumulate of a weight read by the output
channel and the window, and the ensemble's own gradient at its own position, under the
window's bounds test, into a source of the output's size. Opt level 2 and up (where
Winograd runs); ``LATTE_GATHER_GRADS=0`` (or ``LATTE_WINOGRAD=0``) keeps the scatter.
"""

from __future__ import annotations

import os
from dataclasses import replace

from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Buffer,
    Compare,
    Const,
    If,
    Kernel,
    Load,
    Loop,
    Ref,
    Select,
    to_affine,
)
from latte.compiler.passes import winograd
from latte.compiler.passes.data_copy import conj, nest
from latte.compiler.passes.tiling import ensemble_chain, is_batch_loop


def gather_input_grads(kernel: Kernel, bufs, sources: dict) -> Kernel:
    """``kernel`` (a backward) with each matching input-gradient scatter computed as a
    gather; ``sources`` maps gradient buffers to their ensembles (the new loops' axes)."""
    if kernel.phase != "backward" or "0" in (os.environ.get("LATTE_GATHER_GRADS"),
                                             os.environ.get("LATTE_WINOGRAD")):
        return kernel
    copies, stmts = [], []
    for k, s in enumerate(kernel.body.stmts):
        found = _match(s, sources) if is_batch_loop(s) else None
        if found is None:
            stmts.append(s)
            continue
        name = f"{kernel.name}.flipped{k}"
        # as im2col + GEMM the gather gains nothing: try it with a buffer the program does
        # not allocate, keep it (and allocate the copy) where Winograd takes it
        _, gather = _rewrite(s, *found, lambda shape, n=name: Buffer(("unallocated", n), n, shape))
        if winograd.match(gather) is None:
            stmts.append(s)
            continue
        copy, gather = _rewrite(s, *found,
                                lambda shape, n=name: bufs.derived((n,), n, shape, transient=True))
        copies.append(copy)
        stmts.append(gather)
    return replace(kernel, body=Block((*copies, *stmts))) if copies else kernel


def _match(nest_: Loop, sources: dict):
    """``(window loops, target, weight load, gradient load, source ensemble, pads,
    dilations)`` if ``nest_`` is a same-size stride-1 scatter (the module's docstring)."""
    chain = ensemble_chain(nest_)
    dims = chain[1:]
    if len(dims) != 3 or [lp.axis.dim for lp in dims] != [0, 1, 2] or any(lp.start for lp in dims):
        return None
    window, leaf = [], chain[-1].body
    while len(leaf.stmts) == 1 and isinstance(leaf.stmts[0], Loop) and leaf.stmts[0].axis is None:
        window.append(leaf.stmts[0])
        leaf = leaf.stmts[0].body
    if len(leaf.stmts) != 1 or len(window) != 3 or any(lp.start for lp in window):
        return None
    stmt, guard = leaf.stmts[0], None
    if isinstance(stmt, If) and not stmt.orelse.stmts and len(stmt.then.stmts) == 1:
        stmt, guard = stmt.then.stmts[0], stmt.cond
    if not (isinstance(stmt, AugAssign) and stmt.op == "+" and isinstance(stmt.target, Ref)
            and isinstance(stmt.value, BinOp) and stmt.value.op == "*"):
        return None
    n, (o, y, x), (c, i, j) = nest_.var, (lp.var for lp in dims), (lp.var for lp in window)
    own = (Affine.of(n), Affine.of(o), Affine.of(y), Affine.of(x))
    loads = (stmt.value.lhs, stmt.value.rhs)
    if not all(isinstance(e, Load) and all(isinstance(a, Affine) for a in e.ref.index)
               for e in loads):
        return None
    grads = [e for e in loads if e.ref.index == own]
    if len(grads) != 1:
        return None
    weight = loads[1] if grads[0] is loads[0] else loads[0]
    if not {v for a in weight.ref.index for v in a.vars} <= {o, c, i, j}:
        return None
    target, src = stmt.target, sources.get(stmt.target.buffer)
    if (src is None or target.view != (target.view[0], *src.shape)
            or target.buffer in (weight.ref.buffer, grads[0].ref.buffer)
            or not all(isinstance(a, Affine) for a in target.index)):
        return None
    tn, tc, ty, tx = target.index
    shape = [lp.extent for lp in dims]
    pads, dilations = [], []
    for a, out, win, extent, size in ((ty, y, i, shape[1], src.shape[1]),
                                     (tx, x, j, shape[2], src.shape[2])):
        kernel_size = next(lp.extent for lp in window if lp.var == win)
        d, p = a.coef(win), -a.const
        if (a.vars != {out, win} or a.coef(out) != 1 or d < 1 or extent != size
                or d * (kernel_size - 1) != 2 * p):
            return None
        pads.append(p)
        dilations.append(d)
    if (tn != Affine.of(n) or tc != Affine.of(c) or src.shape[0] != window[0].extent
            or (guard is not None and not _bounds_only(guard, ty, tx, src.shape))):
        return None
    return window, target, weight, grads[0], src, tuple(pads), tuple(dilations)


def _bounds_only(guard, ty: Affine, tx: Affine, shape) -> bool:
    """Does ``guard`` test only that the written row and column lie in the source?"""
    allowed = {(ty, ">="), (ty - shape[1], "<"), (tx, ">="), (tx - shape[2], "<")}
    terms = guard.values if isinstance(guard, BoolOp) and guard.op == "and" else (guard,)
    for t in terms:
        lhs = to_affine(t.lhs) if isinstance(t, Compare) else None
        rhs = to_affine(t.rhs) if isinstance(t, Compare) else None
        if lhs is None or rhs is None or (lhs - rhs, t.op) not in allowed:
            return False
    return True


def _rewrite(scatter: Loop, window: list, target: Ref, weight: Load, grad: Load, src,
             pads: tuple, dilations: tuple, flipped_buffer) -> tuple[Loop, Loop]:
    """The nest copying the flipped, transposed weights (into ``flipped_buffer(shape)``),
    and the gather nest."""
    chain = ensemble_chain(scatter)
    (o_lp, y_lp, x_lp), (c_lp, i_lp, j_lp) = chain[1:], window
    o, y, x = o_lp.var, y_lp.var, x_lp.var
    c, i, j = c_lp.var, i_lp.var, j_lp.var
    kh, kw = i_lp.extent, j_lp.extent
    flipped = flipped_buffer((c_lp.extent, o_lp.extent, kh, kw))
    wt = Ref(flipped, (Affine.of(c), Affine.of(o), Affine.of(i), Affine.of(j)), flipped.shape)
    # wt[c, o, i, j] = w(o, c, kh-1-i, kw-1-j), read through the weight's own index
    flip = {i: Affine.of(i, -1, kh - 1), j: Affine.of(j, -1, kw - 1)}
    at = tuple(_subst(a, flip) for a in weight.ref.index)
    copy = nest([replace(c_lp, body=Block(())), replace(o_lp, axis=None, body=Block(())),
                 replace(i_lp, body=Block(())), replace(j_lp, body=Block(()))],
                Assign(wt, Load(replace(weight.ref, index=at))))
    # src.grad[n, c, y, x] += wt[c, o, i, j] * g[n, o, y + d*i - p, x + d*j - p] (inside)
    rows = [Affine.build({y: 1, i: dilations[0]}, -pads[0]),
            Affine.build({x: 1, j: dilations[1]}, -pads[1])]
    read = replace(grad.ref, index=(grad.ref.index[0], Affine.of(o), *rows))
    inside = conj([Compare(">=", rows[0], Const(0)), Compare("<", rows[0], Const(y_lp.extent)),
                   Compare(">=", rows[1], Const(0)), Compare("<", rows[1], Const(x_lp.extent))])
    value = BinOp("*", Load(wt), Select(inside, Load(read), Const(0.0)))
    write = replace(target, index=(target.index[0], Affine.of(c), Affine.of(y), Affine.of(x)))
    loops = [replace(c_lp, axis=replace(o_lp.axis, ensemble=src, dim=0, ensemble_name=src.name)),
             replace(y_lp, axis=replace(y_lp.axis, ensemble=src, ensemble_name=src.name)),
             replace(x_lp, axis=replace(x_lp.axis, ensemble=src, ensemble_name=src.name)),
             replace(o_lp, axis=None), i_lp, j_lp]
    gather = nest([replace(lp, body=Block(())) for lp in loops], AugAssign(write, "+", value))
    ahead = max(d * (k - 1) - p for d, k, p in zip(dilations, (kh, kw), pads))
    return copy, replace(scatter, body=Block((gather,)),
                         meta=scatter.meta + (("reads_ahead", ahead),))


def _subst(a: Affine, mapping: dict) -> Affine:
    for var, repl in mapping.items():
        a = a.substitute(var, repl)
    return a
