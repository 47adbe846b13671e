"""Line buffers: a fused group's intermediates in per-thread buffers of a few rows (paper
5.4.2, Occam's row buffers).

A ``Phase.TEST`` forward runs no backward, so nothing reads a fused group's intermediate
values (a conv's output inside conv -> ReLU -> conv -> pool) once the group is done; in
training, a ``Batch`` field that backward recomputes per tile (a max-pool's arg-max) is
read only in the tile that recomputed it. Such a buffer ``(batch, channels, rows, ...)``
becomes a per-thread buffer of the rows one iteration ``t`` of the group's tile loop
touches, ``[step*t + lo, step*t + hi)``: row ``y`` lives at ``y - step*t - lo``. Under a
skewed schedule (a 3x3 conv a tile behind its producer) consecutive iterations share rows;
after each iteration they shift down by one step, which turns the buffer into Occam's
rolling line buffer without modular indexing.

Everything is checked on the kernel itself: every access to the buffer lies in one tiled
nest, its row index is affine in ``t`` with the same ``step`` everywhere, a GEMM operand
walks whole rows of channels. Anything else leaves the buffer where it was.

An intermediate that one statement stores and only the statements after it in the same
block read back, element for element (a batch norm's output inside batch norm -> add ->
ReLU), needs no buffer at all: :func:`keep_in_locals` keeps it in a local.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from latte.compiler.ir import (
    TID,
    Affine,
    Assign,
    AugAssign,
    Block,
    Buffer,
    Gemm,
    Kernel,
    Load,
    Loop,
    Ref,
    Var,
    accesses,
    refs,
    rewrite,
    touched,
    walk,
)
from latte.compiler.passes.tiling import tile_loop

ROW = 2   # (batch, channels, rows, cols, ...): buffers of (channels, rows, cols) ensembles


def drop_stores(node, dead: set[Buffer]):
    """``node`` (a kernel or a statement) without its stores (``=`` and ``+=``) to ``dead``,
    buffers nothing reads afterwards."""
    def fn(n):
        if (isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Ref)
                and n.target.buffer in dead):
            return Block()
        return None
    return rewrite(node, fn)


def keep_in_locals(kernel: Kernel, candidates: set[Buffer]) -> Kernel:
    """``kernel`` with each of ``candidates`` that a block's statement stores to (``=``), and
    only the straight-line statements after it in that block then read, at the stored
    element, held in a local variable instead: nothing else reads the element, so it never
    needs memory."""
    found: dict[Buffer, int] = {}
    for r in refs(kernel.body):
        if r.buffer in candidates:
            found[r.buffer] = found.get(r.buffer, 0) + 1
    names = {n.name for n in walk(kernel.body) if isinstance(n, Var)}
    body = kernel.body
    for buf in sorted(found, key=lambda b: b.name):
        local = Var(next(f"_lv{i}" for i in range(len(names) + 1) if f"_lv{i}" not in names))
        new = rewrite(body, functools.partial(_in_local, buf=buf, count=found[buf], local=local))
        if new is not body:
            names.add(local.name)
            body = new
    return kernel if body is kernel.body else replace(kernel, body=body)


def _in_local(node, buf: Buffer, count: int, local: Var):
    """The block ``node`` with the store to ``buf`` and its ``count - 1`` loads after it
    (every ref of ``buf`` in the kernel) turned into ``local``; None where they are not all
    there (:func:`keep_in_locals`)."""
    if not isinstance(node, Block):
        return None
    for i, s in enumerate(node.stmts):
        if not (isinstance(s, Assign) and isinstance(s.target, Ref) and s.target.buffer is buf):
            continue
        later = node.stmts[i + 1:]
        if buf in touched(s.value) or any(
                not isinstance(t, (Assign, AugAssign)) or
                (isinstance(t.target, Ref) and t.target.buffer is buf) for t in later
                if buf in touched(t)):
            return None
        loads = [r for t in later for r in refs(t) if r.buffer is buf]
        if len(loads) + 1 != count or any(r != s.target for r in loads):
            return None
        read = {Load(s.target): local}
        return replace(node, stmts=(*node.stmts[:i], Assign(local, s.value, s.loc),
                                    *(rewrite(t, read.get) if buf in touched(t) else t
                                      for t in later)))
    return None


def localize(kernel: Kernel, candidates: set[Buffer], bufs) -> Kernel:
    """``kernel`` with each of ``candidates`` that only one tiled nest of it touches moved into
    a line buffer of that nest."""
    stmts = list(kernel.body.stmts)
    used = [touched(s) for s in stmts]
    for buf in sorted(candidates, key=lambda b: b.name):
        users = [i for i, t in enumerate(used) if buf in t]
        if len(users) != 1 or tile_loop(stmts[users[0]]) is None:
            continue
        batch = stmts[users[0]]
        tile = tile_loop(batch)
        window = _window(tile, batch.var, buf)
        if window is None:
            continue
        step, lo, hi = window
        if hi - lo > step and dict(batch.meta).get("collapse", 1) > 1:
            continue   # rows carried between iterations need the tiles of an item in order
        stmts[users[0]] = replace(batch, body=Block((_move(tile, batch.var, buf, window, bufs),)))
    if all(a is b for a, b in zip(stmts, kernel.body.stmts)):
        return kernel
    return replace(kernel, body=Block(tuple(stmts)))


def _window(tile: Loop, n: str, buf: Buffer) -> tuple[int, int, int] | None:
    """``(step, lo, hi)``: iteration ``t`` of ``tile`` touches rows ``[step*t + lo,
    step*t + hi)`` of ``buf``; None if some access does not fit the pattern."""
    if len(buf.shape) < 4 or not buf.batched:
        return None
    steps, lows, highs = set(), [], []
    for acc in accesses(tile.body):
        if acc.buffer is not buf:
            continue
        rows = _ref_rows(acc, n) if acc.index is not None else _gemm_rows(acc, n, tile.var)
        if rows is None:
            return None
        row, count = rows
        rest, ranges = row.substitute(tile.var, Affine()), acc.ranges()
        if not rest.vars <= ranges.keys():
            return None
        steps.add(row.coef(tile.var))
        low, high = rest.bounds(ranges)
        lows.append(low)
        highs.append(high + count)
    if len(steps) != 1 or not lows:
        return None
    return steps.pop(), min(lows), max(highs)


def _ref_rows(acc, n: str) -> tuple[Affine, int] | None:
    """The row a ref touches (one); None unless it indexes the whole buffer with the batch
    index ``n``."""
    if (acc.view != acc.buffer.shape or acc.index[0] != Affine.of(n)
            or not isinstance(acc.index[ROW], Affine)):
        return None
    return acc.index[ROW], 1


def _gemm_rows(acc, n: str, t: str) -> tuple[Affine, int] | None:
    """The first row a GEMM operand touches (affine) and how many; None unless it walks
    whole rows of a block of channels of batch item ``n``."""
    row = _gemm_row(acc.offset, n, t, acc.buffer)
    row_len = _row_len(acc.buffer)
    (ld, _), (_, ncols) = acc.block
    if row is None or ld != row_len * acc.buffer.shape[ROW] or ncols % row_len:
        return None
    return row, ncols // row_len


def _row_len(buf: Buffer) -> int:
    size = 1
    for d in buf.shape[ROW + 1:]:
        size *= d
    return size


def _gemm_row(off: Affine | None, n: str, t: str, buf: Buffer) -> Affine | None:
    """The first row a GEMM operand's flat offset addresses, from channel 0 of batch item
    ``n``; None unless every other term is whole rows and only the tile variable ``t`` moves
    by whole channel planes. A flat offset cannot tell a channel offset from rows, so
    operands that start at another channel keep their buffer."""
    row_len = _row_len(buf)
    plane = row_len * buf.shape[ROW]
    if off is None or off.coef(n) != plane * buf.shape[1]:
        return None
    rest = off.substitute(n, Affine())
    if (rest.const % row_len or not 0 <= rest.const // row_len + buf.shape[ROW] < 2 * buf.shape[ROW]
            or any(c % row_len or (c % plane == 0 and v != t) for v, c in rest.terms)):
        return None
    return Affine.build({v: c // row_len for v, c in rest.terms}, rest.const // row_len)


def _move(tile: Loop, n: str, buf: Buffer, window: tuple[int, int, int], bufs) -> Loop:
    """``tile`` with ``buf`` replaced by a per-thread line buffer of ``hi - lo`` rows."""
    step, lo, hi = window
    rows = hi - lo
    line = bufs.scratch((buf.key, "lines"), f"{buf.name}.lines", (buf.shape[1], rows, *buf.shape[ROW + 1:]))
    base = Affine.of(tile.var, step, lo)          # the buffer's row 0 in iteration t
    tid = Affine.of(TID)
    row_len = _row_len(buf)

    def fn(node):
        if isinstance(node, Ref) and node.buffer is buf:
            index = list(node.index)
            index[0], index[ROW] = tid, index[ROW] - base
            return Ref(line, tuple(index), line.shape)
        if isinstance(node, Gemm) and buf in (node.a_buf, node.b_buf, node.c_buf):
            return _move_gemm(node, n, tile.var, buf, line, base)
        return None

    body = rewrite(tile.body, fn)
    if rows > step:   # rows the next iteration reads again move down by one step
        c, r, x = (f"_ln{i}" for i in range(3))
        src = Ref(line, (tid, Affine.of(c), Affine.of(r, 1, step), Affine.of(x)),
                  (line.shape[0], line.shape[1], line.shape[2], row_len))
        dst = Ref(line, (tid, Affine.of(c), Affine.of(r), Affine.of(x)), src.view)
        shift = Loop(c, 0, line.shape[1], Block((Loop(r, 0, rows - step, Block((
            Loop(x, 0, row_len, Block((Assign(dst, Load(src)),))),))),)))
        body = Block((*body.stmts, shift))
    return replace(tile, body=body)


def _move_gemm(g: Gemm, n: str, t: str, buf: Buffer, line: Buffer, base: Affine) -> Gemm:
    """``g`` with its operands on ``buf`` moved to ``line`` (rows relative to ``base``)."""
    row_len = _row_len(buf)
    rows = line.shape[2]
    changes = {}
    for op in ("a", "b", "c"):
        if getattr(g, f"{op}_buf") is not buf:
            continue
        row = _gemm_row(getattr(g, f"{op}_off"), n, t, buf)
        off = Affine.of(TID, line.size // line.shape[0]) + (row - base) * row_len
        changes.update({f"{op}_buf": line, f"{op}_off": off, f"ld{op}": rows * row_len})
    return replace(g, **changes)

