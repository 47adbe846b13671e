"""Parallelization (paper 5.4.3; coarse-grain Caffe): mark loops that threads share.

- A neuron nest runs as one flat parallel loop over ``batch x tiles``: each thread runs its
  static chunk, then helps where others lag (codegen's stealing; results do not change).
  The tile loop joins the batch loop only when tiles write disjoint regions; where a
  scatter's windows overlap between neighbouring tiles (a convolution's input gradient),
  tiles of one item stay on one thread.
- Buffers the nest accumulates into outside the items an iteration owns (its item,
  Winograd's block of items, or elements no other item touches: Winograd's transformed
  tiles of the whole batch): weight and bias gradients, become thread-private copies,
  zeroed before the loop and reduced after it in thread order, so results do not depend
  on timing.
- Where ``batch x tiles`` has fewer items than threads (one image), the threads share each
  statement of a tile instead (:func:`_within`): its GEMM split, its loops over channels
  run in parallel where their iterations store to disjoint elements.
- A GEMM outside any loop (a fully connected layer over the whole batch) is split into
  slices of its larger dimension, up to :data:`SLICES` per thread (of at least
  :data:`MIN_SLICE` rows or columns), so a thread that finishes first takes a slower
  one's last slices: as many as keep the threads' shares even (:func:`slicing`), one per
  thread where each slice would stream an operand larger than half the L2 again; every
  sgemm call runs on one BLAS thread.
- Flat loops over large buffers (zeroing, the SGD update) are split into chunks.
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import (
    TID,
    Access,
    Affine,
    Assign,
    AugAssign,
    Block,
    Compare,
    Const,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    Var,
    accesses,
    rewrite,
    substitute,
    walk,
    written_refs,
)
from latte.compiler.passes.tiling import is_batch_loop, tile_loop, tile_rows

MIN_GEMM_FLOPS = 1 << 21     # smaller GEMMs are not worth a fork-join
MIN_FLAT = 1 << 15           # iterations of a loop worth splitting across threads
MIN_SHARE = 1                # (batch item, tile) pairs per thread that a flat loop needs
SLICES = 4                   # a split GEMM's slices per thread, at most ...
MIN_SLICE = 64               # ... of at least this many rows or columns


def parallelize(kernel: Kernel, bufs, l2: int) -> Kernel:
    """Mark the parallel loops of ``kernel`` (no-op for one thread); ``l2``: the bytes of
    one core's L2 (:func:`slicing`)."""
    if bufs.threads <= 1:
        return kernel
    out = []
    for s in kernel.body.stmts:
        if is_batch_loop(s) and _work(s) >= MIN_FLAT:
            out.extend(_batch_nest(s, bufs, l2))
        elif isinstance(s, Gemm):
            out.append(split_gemm(s, bufs.threads, l2))
        elif isinstance(s, Loop) and ((_flat_disjoint(s) and s.extent >= MIN_FLAT) or (
                _worth(s, bufs.threads) and _disjoint_iterations(s))):
            out.append(parallel(s, 1))
        else:
            out.append(s)
    return replace(kernel, body=Block(tuple(out)))


def _work(s) -> int:
    """A rough count of the innermost iterations (GEMM multiply-adds count too)."""
    if isinstance(s, Gemm):
        return s.m * s.n * s.k
    if isinstance(s, Loop):
        return s.extent * sum(_work(c) for c in s.body.stmts)
    if isinstance(s, (Block, If)):
        return sum(_work(c) for c in _child_stmts(s))
    return 1


def _worth(loop: Loop, threads: int) -> bool:
    """``loop`` has the work of a fork-join and an iteration for every thread."""
    return _work(loop) >= MIN_FLAT and loop.extent >= threads


def _child_stmts(s) -> list:
    return list(s.stmts) if isinstance(s, Block) else [*s.then.stmts, *s.orelse.stmts]


def parallel(loop: Loop, collapse: int) -> Loop:
    """``loop`` and the ``collapse - 1`` loops nested in it, as one flat parallel loop."""
    return replace(loop, kind=LoopKind.PARALLEL, meta=loop.meta + (("collapse", collapse),))


def _stores(s) -> list[Access]:
    return [a for a in accesses(s) if a.written and not _is_scratch(a.buffer)]


def per_item(a: Access, batch: str) -> bool:
    """The access lands in the batch item ``batch`` of a batched buffer."""
    if not a.buffer.batched:
        return False
    if a.index is not None:
        return a.index[0] == Affine.of(batch)
    return a.offset is not None and a.offset.coef(batch) == a.buffer.size // a.buffer.shape[0]


def _own_items(a: Access, nest: Loop, extents: dict[str, int]) -> bool:
    """The access lands in batch items no other iteration of the batch loop ``nest`` touches:
    its item is the loop's (:func:`per_item`), or ``k * var + e`` where ``e``, over the loops
    inside (``extents``), moves by less than ``k`` (Winograd's blocks of items)."""
    if per_item(a, nest.var):
        return True
    if not a.buffer.batched or a.index is None or not isinstance(a.index[0], Affine):
        return False
    first = a.index[0]
    step = first.coef(nest.var)
    inner = [(v, k) for v, k in first.terms if v != nest.var]
    return step >= 1 and all(v in extents for v, _ in inner) and \
        sum(abs(k) * (extents[v] - 1) for v, k in inner) < step


def _items_apart(buf, found: list[Access], batch: str, extents: dict[str, int]) -> bool:
    """Every access of ``buf`` in the batch nest is a ref of one view, and they share an
    index component that takes a different value for every (item, inner loop values): its
    coefficients are mixed radices, each larger than what the smaller ones reach (Winograd's
    transformed tiles of the whole batch, each item's columns beside the others'). The
    items then touch disjoint elements."""
    mine = [a for a in found if a.buffer is buf]
    if any(a.index is None for a in mine) or len({a.view for a in mine}) != 1:
        return False
    return any(len(set(forms)) == 1 and isinstance(forms[0], Affine)
               and _injective(forms[0], batch, extents) for forms in zip(*(a.index for a in mine)))


def _injective(form: Affine, var: str, extents: dict[str, int]) -> bool:
    """``form`` over the loops of ``extents`` takes distinct values, and moves with ``var``."""
    reach = 0
    for v, k in sorted(form.terms, key=lambda term: abs(term[1])):
        if v not in extents or abs(k) <= reach:
            return False
        reach += abs(k) * (extents[v] - 1)
    return bool(form.coef(var))


def _is_scratch(buf) -> bool:
    return buf.key[0] == "scratch"


def _batch_nest(nest: Loop, bufs, l2: int) -> list:
    extents = {n.var: n.extent for n in walk(nest) if isinstance(n, Loop)}
    # in order of first store: a set of buffers (hashed by address) would order the copies,
    # and with them the generated code, differently in every process
    found = accesses(nest)
    outside = dict.fromkeys(a.buffer for a in _stores(nest) if not _own_items(a, nest, extents))
    private = [b for b in outside if not _items_apart(b, found, nest.var, extents)]
    collapse = 1
    tile = tile_loop(nest)
    # a skewed tile loop's tiles depend on earlier ones
    if tile is not None and not dict(tile.meta).get("skew") and all(
            _disjoint_tiles(a.offset, a.span, tile.var, extents)
            or tile_rows(a, nest.var, tile.var) is not None
            for a in _stores(nest) if a.buffer not in private):
        collapse = 2
    items = nest.extent * (tile.extent if collapse == 2 else 1)
    if items < bufs.threads * MIN_SHARE or not all(_only_accumulated(nest, b) for b in private):
        return [_within(nest, bufs.threads, l2)]
    copies = {b: bufs.private(b) for b in private}
    body = rewrite(nest.body, lambda n: _privatize(n, copies))
    out = [_flat(p, f"_pz{i}", Const(0.0)) for i, p in enumerate(copies.values())]
    out.append(parallel(replace(nest, body=body), collapse))
    out += [_reduce(b, p, bufs.threads, f"_pr{i}") for i, (b, p) in enumerate(copies.items())]
    return out


def _within(nest: Loop, threads: int, l2: int) -> Loop:
    """``nest`` with its batch and tile loops serial, and each statement in a tile shared by
    the threads: a GEMM split into slices, a loop whose iterations store to disjoint elements
    (:func:`_disjoint_iterations`) run as a parallel loop. For a batch too small to feed the
    threads (one image), or accumulations that cannot be privatized. Every statement runs
    whole before the next one starts, as in the serial nest, so the tile buffers are shared
    by the threads (slot 0) instead of one per thread."""
    def share(loop: Loop) -> Loop:
        stmts = []
        for s in loop.body.stmts:
            if loop.kind is not LoopKind.TILE_OUTER and tile_loop(loop) is s:
                s = share(s)
            elif isinstance(s, Gemm):
                s = split_gemm(s, threads, l2)
            elif isinstance(s, Loop) and _worth(s, threads) and _disjoint_iterations(s):
                s = parallel(s, 1)
            stmts.append(s)
        return replace(loop, body=Block(tuple(stmts)))
    return share(substitute(nest, {TID: Affine()}))


def _disjoint_iterations(loop: Loop) -> bool:
    """No iteration of ``loop`` touches an element another one stores to: every buffer it
    stores to is accessed (loaded and stored) either by refs of one view that share an
    index component (the same form in the same position) advancing with ``loop.var`` by
    more than the loops inside ``loop`` move it (sound: the verifier proves every component
    inside its extent), or only as GEMM blocks at one offset that advances by more than the
    block spans (a loop around GEMMs)."""
    if not _own_locals(loop):
        return False
    inner = {n.var: n.extent for n in walk(loop.body) if isinstance(n, Loop)}

    def reach(form: Affine, span: int = 0) -> bool:
        moved = span + sum(abs(k) * (inner[v] - 1) for v, k in form.terms if v in inner)
        return moved < abs(form.coef(loop.var))

    found = accesses(loop)
    for buf in {a.buffer: None for a in found if a.written}:
        mine = [a for a in found if a.buffer is buf]
        if all(a.index is None for a in mine):   # GEMM blocks
            if len({a.offset for a in mine}) != 1 or mine[0].offset is None or not all(
                    reach(a.offset, a.span) for a in mine):
                return False
        elif any(a.index is None for a in mine) or len({a.view for a in mine}) != 1 or not any(
                len(set(forms)) == 1 and isinstance(forms[0], Affine) and reach(forms[0])
                for forms in zip(*(a.index for a in mine))):
            return False
    return True


def _own_locals(loop: Loop) -> bool:
    """Every local ``loop`` reads is one it assigns (a parallel body starts with fresh
    locals)."""
    assigned = {n.target.name for n in walk(loop)
                if isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Var)}
    loop_vars = {n.var for n in walk(loop) if isinstance(n, Loop)}
    return all(n.name in assigned | loop_vars for n in walk(loop) if isinstance(n, Var))


def _only_accumulated(nest, buf) -> bool:
    """``buf`` is only ever ``+=``-ed in ``nest`` (so per-thread partial sums add up)."""
    for n in walk(nest):
        if isinstance(n, Gemm):
            if buf in (n.a_buf, n.b_buf) or (n.c_buf is buf and n.beta != 1.0):
                return False
        elif isinstance(n, Load) and isinstance(n.ref, Ref) and n.ref.buffer is buf:
            return False
        elif isinstance(n, AugAssign) and isinstance(n.target, Ref) and n.target.buffer is buf \
                and n.op != "+":
            return False
        elif isinstance(n, Assign) and isinstance(n.target, Ref) and n.target.buffer is buf:
            return False
    return True


def _disjoint_tiles(off: Affine | None, span: int, tile: str, extents) -> bool:
    """Consecutive tiles of a store at offset ``off`` (and ``span``) write disjoint ranges."""
    if off is None:
        return False
    reach = span + sum(abs(c) * (extents[v] - 1) for v, c in off.terms
                       if v != tile and v in extents)
    return reach < abs(off.coef(tile))


def _privatize(node, copies):
    if isinstance(node, Ref) and node.buffer in copies:
        p = copies[node.buffer]
        return Ref(p, (Affine.of(TID), *node.index), (p.shape[0], *node.view))
    if isinstance(node, Gemm) and node.c_buf in copies:
        p = copies[node.c_buf]
        return replace(node, c_buf=p, c_off=node.c_off + Affine.of(TID, node.c_buf.size))
    return None


def _flat(buf, var: str, value) -> Loop:
    loop = Loop(var, 0, buf.size, Block((Assign(Ref(buf, (Affine.of(var),), (buf.size,)), value),)))
    return parallel(loop, 1) if buf.size >= MIN_FLAT else loop


def _reduce(buf, private, threads: int, var: str) -> Loop:
    """``buf += private[0] + private[1] + ...``, always in thread order."""
    e = Affine.of(var)
    body = Block(tuple(AugAssign(Ref(buf, (e,), (buf.size,)), "+",
                                 Load(Ref(private, (Affine((), t), e), (threads, buf.size))))
                       for t in range(threads)))
    loop = Loop(var, 0, buf.size, body)
    return parallel(loop, 1) if buf.size >= MIN_FLAT else loop


def slicing(size: int, threads: int, shared: int, l2: int) -> tuple[int, int]:
    """``(chunk, pieces)``: ``size`` rows or columns cut in pieces of ``chunk`` (whole
    vectors of 16 floats past 16; the last piece shorter) that ``threads`` finish soonest,
    counting a thread's load as the pieces it would take largest first (stealing evens out
    what the static split leaves; 784 columns: two pieces of 400 and 384, not seven of 112,
    of which one thread would run four). Of equally soon ones, the most pieces (they keep
    stealing useful when a core is slow), but one per thread where the operand that every
    piece reads whole (``shared`` bytes) exceeds half the ``l2``: each piece would stream it
    from memory again (or BLAS pack it again)."""
    most = 1 if shared > l2 // 2 else SLICES
    best = None
    for per_thread in range(1, max(1, min(most, size // (MIN_SLICE * threads))) + 1):
        chunk = -(-size // (threads * per_thread))
        if chunk > 16:
            chunk = -(-chunk // 16) * 16
        pieces = -(-size // chunk)
        loads = [0] * threads
        for piece in [chunk] * (pieces - 1) + [size - chunk * (pieces - 1)]:
            loads[loads.index(min(loads))] += piece
        if best is None or (max(loads), -pieces) < best[0]:
            best = (max(loads), -pieces), chunk, pieces
    return best[1], best[2]


def _flat_disjoint(loop: Loop) -> bool:
    """Every store of ``loop`` lands on an element of its own iteration."""
    if any(isinstance(n, (Loop, Gemm)) for n in walk(loop.body)):
        return False
    writes = list(written_refs(loop))
    return bool(writes) and all(
        (off := r.offset()) is not None and off.terms == ((loop.var, 1),) for r in writes)


def split_gemm(g: Gemm, threads: int, l2: int):
    """Slices of the larger of M and N, one to :data:`SLICES` per thread (:func:`slicing`)."""
    if 2 * g.m * g.n * g.k < MIN_GEMM_FLOPS:
        return g
    along_n = g.n >= g.m
    size = g.n if along_n else g.m
    chunk, pieces = slicing(size, threads, 4 * g.k * (g.m if along_n else g.n), l2)
    c = Affine.of("_c")
    if along_n:
        sliced = replace(g, b_off=g.b_off + c * (chunk * g.ldb if g.trans_b else chunk),
                         c_off=g.c_off + c * chunk)
    else:
        sliced = replace(g, a_off=g.a_off + c * (chunk if g.trans_a else chunk * g.lda),
                         c_off=g.c_off + c * (chunk * g.ldc))
    last = size - chunk * (pieces - 1)
    full = replace(sliced, **{"n" if along_n else "m": chunk})
    body = full if last == chunk else If(Compare("<", Var("_c"), Const(pieces - 1)), Block((full,)),
                                         Block((replace(full, **{"n" if along_n else "m": last}),)))
    return parallel(Loop("_c", 0, pieces, Block((body,))), 1)
