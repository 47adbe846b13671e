"""Cross-layer fusion (paper 5.4.2, figures 10-12): chains of ensembles that run tile by tile.

Occam's dynamic program (:mod:`~latte.compiler.planner`) proposes where to cut the net's
chain of row-tiled layers. Within its spans, a group is a chain ``producer -> consumer -> ...``
in which each consumer is the only reader of its producer and tile ``T`` of the consumer
reads only tile ``T`` of the producer: isl
decides this on the access relation (:func:`~latte.compiler.mapping.tile_local`). Tile
heights are scaled by the strides along the chain (a 2x2 stride-2 pool after a conv doubles
the conv's tile, figure 11); of the tilings whose working set fits the cache budget, the
group takes the one a single nest would (:func:`~latte.compiler.passes.tiling.heights`).
The members' kernels are then concatenated (forward in order, backward in reverse) and
:func:`~latte.compiler.passes.fuse_nests` fuses their tile loops.

A consumer that also reads rows of the neighbouring producer tiles (a 3x3 conv after a
conv: a halo no taller than a tile) joins the group with a skewed schedule: it runs one tile
behind its producer in forward (its producer one tile behind it in backward, where its
input gradient spills into the neighbouring tiles), so nothing is recomputed and the
producer's rows are still in cache when the consumer reads them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from latte.compiler import planner
from latte.compiler.buffers import storage_owner
from latte.compiler.ir import (
    Affine,
    Block,
    BoolOp,
    Compare,
    Const,
    If,
    Kernel,
    Loop,
    Var,
    accesses,
    substitute,
    touched,
    walk,
)
from latte.compiler.mapping import tile_local
from latte.compiler.passes.localize import drop_stores
from latte.compiler.passes.tiling import (
    FLOAT_BYTES,
    MIN_TILE,
    balanced,
    busiest,
    ensemble_chain,
    heights,
    is_batch_loop,
    strip_mined,
    tile_boxes,
    tile_loop,
    windowed_components,
)
from latte.compiler.passes.winograd import takes
from latte.errors import CompileError
from latte.lang import ActivationEnsemble, FieldKind, NormalizationEnsemble, Phase, sources

ROW_DIM = 1   # ensembles are (channels, rows, cols): tiles are row planes


@dataclass
class Group:
    """Consecutive ensembles fused tile by tile, and each one's tile height."""

    plans: list
    rows: dict          # ensemble -> tile rows
    footprint: int      # bytes one tile of the whole group touches
    links: tuple = ()   # per member after the first: 1 where it reads its producer's halo
    choices: dict = field(default_factory=dict)   # member name -> Choice (keep or recompute)

    def owner(self, phase: str):
        """The member whose kernel runs the group in ``phase`` (the first to run)."""
        return self.plans[0] if phase == "forward" else self.plans[-1]

    def lag(self, plan, phase: str) -> int:
        """Tiles ``plan`` runs behind the group's leader: a consumer that reads the next
        producer tile's rows waits one tile in forward; in backward its producer waits."""
        k = self.plans.index(plan)
        return sum(self.links[:k]) if phase == "forward" else sum(self.links[k:])

    @property
    def name(self) -> str:
        return "+".join(p.ensemble.name for p in self.plans)


def fusion_groups(net, plans, budget: int, threads: int = 1) -> list[Group]:
    """The fused groups of ``net`` (only groups of two or more ensembles). Chains are cut
    where Occam's dynamic program over the net's conv/pool chain puts a partition boundary
    (least off-chip traffic under ``budget``), then where isl finds a halo that cannot be
    skewed. A skewed group runs its tiles in order, so only the batch is left to share among
    ``threads``: with fewer items than threads, halos end groups instead."""
    return _chains(net, plans, _cuts(plans, budget, net.batch_size), budget,
                   _max_lag(net, threads), share=(net.batch_size, threads))


def test_groups(net, plans, groups: list[Group], budget: int, threads: int = 1) -> list[Group]:
    """The fused groups of the ``Phase.TEST`` forward that the training ``groups`` do not
    have. There, host steps that ignore their inputs (a batch norm's statistics, read from
    ``net.state``) run first and the kernels only they read (its partial sums) do not run,
    so a batch norm is one more element-wise consumer of its convolution: conv + BN + ReLU
    (+ add + ReLU) chains fuse where isl says they may. A test group holds each training
    group wholly or not at all (their kernels are merged already), at its tile rows."""
    ignored = test_ignored(net)
    if not ignored:
        return []
    fixed = {e: r for g in groups for e, r in g.rows.items()}
    parts = {p.ensemble: {q.ensemble for q in g.plans} for g in groups for p in g.plans}

    def whole(chain: list) -> bool:
        members = {p.ensemble for p in chain}
        return all(parts.get(e, members) <= members for e in members)

    alive = [p for p in plans if p.ensemble not in ignored]
    found = _chains(net, alive, _cuts(plans, budget, net.batch_size), budget,
                    _max_lag(net, threads), ignored, fixed, whole, (net.batch_size, threads))
    trained = [[p.ensemble for p in g.plans] for g in groups]
    return [g for g in found if [p.ensemble for p in g.plans] not in trained]


def test_ignored(net) -> frozenset:
    """The ensembles whose reads do not count in ``Phase.TEST``: host steps that ignore their
    inputs there, and (transitively) the ensembles only those read (a batch norm's partial
    sums: :func:`~latte.compiler.schedule.test_steps` does not run them)."""
    readers: dict = {}
    for e in net.ensembles:
        for s in sources(net, e):
            readers.setdefault(s, []).append(e)
    out = {e for e in net.ensembles
           if isinstance(e, NormalizationEnsemble) and not e.reads_inputs(Phase.TEST)}
    for e in reversed(net.ensembles):   # readers come after what they read
        if readers.get(e) and all(r in out for r in readers[e]):
            out.add(e)
    return frozenset(out)


def _max_lag(net, threads: int) -> int:
    return 1 if net.batch_size >= threads else 0


def _cuts(plans, budget: int, batch: int) -> set:
    """The ensembles before which Occam's dynamic program puts a partition boundary."""
    layers = planner_chain(plans)
    spans = planner.occam(layers, budget, batch=batch).groups if len(layers) > 1 else []
    # the planner models the leading chain only: where it ends is not a cut it chose
    return {plans[j + 1].ensemble for _, j in spans if j + 1 < len(layers)}


def _chains(net, plans, cuts: set, budget: int, max_lag: int, ignored: frozenset = frozenset(),
            fixed: dict | None = None, whole=None,
            share: tuple[int, int] = (1, 1)) -> list[Group]:
    """Runs of ``plans`` that consume each other (:func:`_consumes`, not counting the reads of
    ``ignored`` ensembles), cut into groups by :func:`_fit`."""
    groups, chain = [], []
    for plan in plans:
        if chain and plan.ensemble not in cuts and _consumes(net, chain, plan, ignored):
            chain.append(plan)
            continue
        groups += _fit(chain, budget, max_lag, fixed, whole, share)
        chain = [plan] if _tileable(plan) else []
    return groups + _fit(chain, budget, max_lag, fixed, whole, share)


def _tileable(plan) -> bool:
    shape = plan.ensemble.shape
    nests = [s for s in plan.kernels["forward"].body.stmts if is_batch_loop(s)]
    return len(shape) == 3 and shape[ROW_DIM] > 1 and bool(nests) and not any(
        strip_mined(lp) and lp.axis.dim == ROW_DIM for s in nests for lp in ensemble_chain(s))


def _consumes(net, chain: list, plan, ignored: frozenset = frozenset()) -> bool:
    """``plan``'s ensemble reads the last member of ``chain`` through one connection, and
    nothing else (but ``ignored`` ensembles) reads that member. Its other inputs (a
    residual's shortcut, statistics) must come from outside the chain: they are complete
    before the group runs."""
    ens, prod = plan.ensemble, chain[-1].ensemble
    if isinstance(ens, ActivationEnsemble):   # in place: reads its source's own tile
        return ens.source is prod and _tileable(plan)
    if not _tileable(plan) or any(a.dims is None for a in plan.accesses):
        return False
    mine = [a for a in plan.accesses if a.conn.source is prod]
    members = {storage_owner(p.ensemble) for p in chain}
    if len(mine) != 1 or any(storage_owner(a.conn.source) in members
                             for a in plan.accesses if a is not mine[0]):
        return False
    readers = [c for c in net.connections if c.source is prod and c.sink not in ignored]
    host = [e for e in net.ensembles if isinstance(e, NormalizationEnsemble)
            and prod in e.inputs and e not in ignored]
    return len(readers) == 1 and readers[0].sink is ens and not host


def _from(plan, prod):
    """``plan``'s access of ``prod``'s values."""
    return next(a for a in plan.accesses if a.conn.source is prod)


def _scale(plan, prod) -> int:
    """Producer rows per consumer row (the stride along the row dimension)."""
    if isinstance(plan.ensemble, ActivationEnsemble):
        return 1
    return abs(_from(plan, prod).dims[ROW_DIM].lo.coef(f"%{ROW_DIM}")) or 1


def _fit(chain: list, budget: int, max_lag: int, fixed: dict | None = None,
         whole=None, share: tuple[int, int] = (1, 1)) -> list[Group]:
    """``chain`` cut into groups: from each start, the longest run with a tiling that is legal
    and fits ``budget`` (a halo or an overflow ends a group; the next one starts after it),
    gives the ensembles in ``fixed`` their rows there, and that ``whole`` accepts; ``share``:
    the batch and the threads its tiles are shared among."""
    groups = []
    while len(chain) > 1:
        for end in range(len(chain), 1, -1):
            fit = None if whole and not whole(chain[:end]) else _rows(
                chain[:end], budget, max_lag, fixed or {}, share)
            if fit is not None:
                groups.append(Group(list(chain[:end]), *fit))
                chain = chain[end:]
                break
        else:
            chain = chain[1:]
    return groups


def _rows(chain: list, budget: int, max_lag: int, fixed: dict,
          share: tuple[int, int]) -> tuple[dict, int, tuple] | None:
    """Each member's tile rows, the tile's working set and the links: of the legal tilings
    that fit ``budget``, the one with the lowest tiles in which every member with weights
    (a product's operand) gets ``MIN_TILE`` elements per channel (a conv after a 2x2 pool
    has tiles a quarter as wide as its producer's); unless another (one that fits, or
    overflows only by what one member overflows alone) shares the tiles of the batch out
    more evenly among the threads (``share``, :func:`~latte.compiler.passes.tiling.balanced`;
    not where :func:`_shared_by_rows` says no, nor for a skewed group, whose tiles run in
    order). None where no tiling is legal."""
    last = chain[-1].ensemble.shape[ROW_DIM]
    per_row = [1]   # each member's rows per row of the last member
    for prod, plan in reversed(list(zip(chain, chain[1:]))):
        per_row.insert(0, per_row[0] * _scale(plan, prod.ensemble))
    weighted = [(k, p.ensemble.shape) for k, p in zip(per_row, chain) if p.ensemble.params]
    weighted = weighted or [(per_row[0], chain[0].ensemble.shape)]
    order = heights(last, lambda r: all(r * k * math.prod(shape[ROW_DIM + 1:]) >= MIN_TILE
                                        for k, shape in weighted))
    tried: dict = {}

    def usable(r: int) -> bool:   # overflowing only by what one member overflows alone
        if r not in tried:
            tried[r] = _tiling(chain, per_row, r, max_lag, fixed)
        return tried[r] is not None and tried[r][1] - tried[r][3] <= budget

    def fits(r: int) -> bool:
        return usable(r) and tried[r][1] <= budget

    first = next((r for r in order if fits(r) or (r == order[0] and usable(r))), None)
    if first is not None and not any(tried[first][2]):   # a skewed group's tiles run in order
        shared = functools.cache(lambda: _shared_by_rows(chain))
        first = balanced(first, order, fits, lambda r: busiest(share[0], last, r, share[1]),
                         lambda r: shared() and usable(r) and not any(tried[r][2]))
    return None if first is None else tried[first][:3]


def _shared_by_rows(chain: list) -> bool:
    """Whether the threads' share of ``chain``'s tiles decides its tile rows: a member reads a
    sliding window along the rows (the work the tiles hold; an element-wise group keeps the
    rows its producers' tiles would have, so that the test forward's groups still form
    around them), and Winograd takes none (its tiles are best a multiple of its output
    tiles)."""
    nests = [s for p in chain for s in p.kernels["forward"].body.stmts if is_batch_loop(s)]
    return not any(takes(s) for s in nests) and any(
        windowed_components(s, lp.var) for s in nests for lp in ensemble_chain(s)[1:]
        if lp.axis.dim == ROW_DIM)


def _tiling(chain: list, per_row: list[int], r: int, max_lag: int,
            fixed: dict) -> tuple[dict, int, tuple, int] | None:
    """The members' tile rows, the working set, the links and the largest member's own
    working set of ``chain`` in tiles of ``r`` rows of its last member; None where that
    tiling is not legal."""
    last = chain[-1].ensemble.shape[ROW_DIM]
    tiles, sizes = last // r, [r * k for k in per_row]
    if any(p.ensemble.shape[ROW_DIM] != s * tiles or fixed.get(p.ensemble, s) != s
           for p, s in zip(chain, sizes)):
        return None
    links = tuple(_link(p, q.ensemble, s, s_prev, tiles, max_lag)
                  for (q, p), s, s_prev in zip(zip(chain, chain[1:]), sizes[1:], sizes))
    if None in links:
        return None
    boxes: dict = {}
    own = []
    for p, s in zip(chain, sizes):
        mine = _boxes(p, s)
        own.append(sum(mine.values()) * FLOAT_BYTES)
        for key, n in mine.items():
            boxes[key] = max(boxes.get(key, 0), n)
    return ({p.ensemble: s for p, s in zip(chain, sizes)}, sum(boxes.values()) * FLOAT_BYTES,
            links, max(own))


def _link(plan, prod, rows: int, producer_rows: int, tiles: int, max_lag: int) -> int | None:
    """0 if tile T of ``plan`` reads only its producer's tile T; 1 if it also reads rows of
    the neighbouring tiles (a halo no taller than a tile: the schedule is then skewed by one
    tile, and nothing is recomputed); None otherwise."""
    if isinstance(plan.ensemble, ActivationEnsemble):
        return 0
    for lag in range(max_lag + 1):
        if tile_local(_from(plan, prod), ROW_DIM, rows, ROW_DIM, producer_rows, tiles, lag):
            return lag
    return None


def _boxes(plan, rows: int) -> dict:
    """Elements per buffer a forward tile of ``rows`` rows of ``plan``'s ensemble touches."""
    boxes: dict = {}
    for nest in plan.kernels["forward"].body.stmts:
        if not is_batch_loop(nest):
            continue
        row = next((lp for lp in ensemble_chain(nest) if lp.axis.dim == ROW_DIM), None)
        if row is not None:
            extents = {n.var: n.extent for n in walk(nest) if isinstance(n, Loop)}
            for key, n in tile_boxes(nest, extents, nest.var, row.var, rows).items():
                boxes[key] = max(boxes.get(key, 0), n)
    return boxes


@dataclass(frozen=True)
class Choice:
    """What a member does with the ``Batch`` fields its backward reads (a max-pool's arg-max),
    and the off-chip bytes the planner estimates for each way."""

    fields: tuple          # the fields' buffers
    keep_bytes: int        # stored in forward, loaded in backward
    recompute_bytes: int   # inputs backward must load again to recompute them per tile

    @property
    def recompute(self) -> bool:
        return self.recompute_bytes < self.keep_bytes


def keep_or_recompute(group: Group, bufs) -> None:
    """Per member whose backward reads ``Batch`` fields its forward writes: keep them (their
    bytes are written in forward and read in backward) or recompute them in backward, tile by
    tile, with the member's own forward loops (which cost the bytes of the inputs that no
    member's backward loads in the same tile anyway: a pool after a ReLU recomputes its
    arg-max from the rows whose mask the ReLU's backward reads). Each decision is recorded as
    a :class:`Choice`; where recomputing is cheaper, it rewrites the member's kernels."""
    loaded = {a.buffer for p in group.plans for a in accesses(p.kernels["backward"].body)
              if not a.written}
    for plan in group.plans:
        ens, fwd, bwd = plan.ensemble, plan.kernels["forward"], plan.kernels["backward"]
        mine = [bufs.field(ens, f.name) for f in ens.fields.values() if f.spec.kind is FieldKind.BATCH]
        fwd_acc = {id(s): accesses(s) for s in fwd.body.stmts}
        bwd_acc = {id(s): accesses(s) for s in bwd.body.stmts}
        written = {a.buffer for found in fwd_acc.values() for a in found if a.written}
        used = {a.buffer for found in bwd_acc.values() for a in found}
        kept = tuple(b for b in mine if b in written and b in used)
        if not kept:
            continue
        value = bufs.value_home(ens)   # a zero-copy join's, for its input
        nests = [s for s in fwd.body.stmts if {a.buffer for a in fwd_acc[id(s)]} & set(kept)]
        users = [s for s in bwd.body.stmts if {a.buffer for a in bwd_acc[id(s)]} & set(kept)]
        found = [a for s in nests for a in fwd_acc[id(s)]]
        if (any(tile_loop(s) is None for s in nests + users)
                or any(a.buffer in (value, *kept) and not a.written for a in found)):
            continue   # recomputing needs tiled loops that do not read what they produce
        inputs = {a.buffer for a in found if not a.written and a.buffer.batched} - loaded
        choice = Choice(kept, 2 * sum(b.size for b in kept) * FLOAT_BYTES,
                        sum(b.size for b in inputs) * FLOAT_BYTES)
        group.choices[ens.name] = choice
        if not choice.recompute:
            continue
        again = tuple(drop_stores(s, {value}) for s in nests)
        plan.kernels["forward"] = replace(fwd, body=Block(tuple(
            drop_stores(s, set(kept)) for s in fwd.body.stmts)))
        stmts = bwd.body.stmts
        first = next(i for i, s in enumerate(stmts) if s is users[0])
        plan.kernels["backward"] = replace(bwd, body=Block((*stmts[:first], *again, *stmts[first:])))


def merge(group: Group, phase: str) -> Kernel:
    """The members' kernels of ``phase`` as one kernel (backward runs in reverse order). With
    a halo link the members' tile loops become one, skewed: iteration ``t`` runs tile
    ``t - lag`` of each member (see :meth:`Group.lag`), so a consumer's rows are complete."""
    plans = group.plans if phase == "forward" else group.plans[::-1]
    first = group.owner(phase).kernels[phase]
    name = f"{group.name}.{phase}"
    if not any(group.links):
        stmts = tuple(s for p in plans for s in p.kernels[phase].body.stmts)
        return replace(first, name=name, body=Block(stmts))
    lags = [group.lag(p, phase) for p in plans]
    nests = [(lag + _ahead(s), s) for p, lag in zip(plans, lags) for s in p.kernels[phase].body.stmts
             if tile_loop(s) is not None]
    split = _untiled([s for p in plans for s in p.kernels[phase].body.stmts])
    if split is None:
        raise CompileError(f"fused group {group.name}: a statement without tiles depends on "
                           "tiles both before and after it (check mergeable() first)")
    before, after = split
    batch, tile = nests[0][1], nests[0][1].body.stmts[0]
    skew = max(lag for lag, _ in nests)
    body: list = []
    for lag, nest in nests:
        t = nest.body.stmts[0]
        shift = {nest.var: Affine.of(batch.var), t.var: Affine.of(tile.var) - lag}
        inner = substitute(t.body, shift)
        cond = [Compare("<", Var(tile.var), Const(t.extent + lag))]
        if lag:
            cond.insert(0, Compare(">=", Var(tile.var), Const(lag)))
        cond = cond[0] if len(cond) == 1 else BoolOp("and", tuple(cond))
        if body and body[-1].cond == cond:   # one guard per run of equally lagged nests
            body[-1] = If(cond, Block(body[-1].then.stmts + inner.stmts))
        else:
            body.append(If(cond, inner))
    fused = replace(tile, stop=tile.extent + skew, body=Block(tuple(body)),
                    meta=tile.meta + (("skew", skew),))
    nest = replace(batch, body=Block((fused,)))
    return replace(first, name=name, body=Block((*before, nest, *after)))


def _ahead(nest: Loop) -> int:
    """Tiles a nest runs behind its member: one that reads rows past its tile of a gradient
    the members before it write (an input gradient computed as a gather)."""
    rows = dict(nest.meta).get("reads_ahead", 0)
    return -(-rows // dict(tile_loop(nest).meta)["tile_size"])


def mergeable(group: Group, phases: tuple = ("forward", "backward")) -> bool:
    """Whether :func:`merge` can order each phase's statements without tiles (below): a
    group without halo links keeps its members' statements in order, which is always legal."""
    return not any(group.links) or all(
        _untiled([s for p in group.plans for s in p.kernels[ph].body.stmts]) is not None
        for ph in phases)


def _untiled(stmts: list) -> tuple[list, list] | None:
    """The statements without a tile loop (zeroing, a member's nests that were not tiled),
    split into those that run before the skewed tile loop and those that run after it. A
    statement runs before when that moves it past no tiled statement it conflicts with (it
    touches nothing they write and writes nothing they read), else after when that is legal
    (a 1x1 conv's backward GEMMs need the whole input gradient the next conv's tiles write);
    None when neither is. Moving before passes the statements already sent after too (a
    Winograd weight gradient's sums run after the tiles, so its transform back must)."""
    tiled = [i for i, s in enumerate(stmts) if tile_loop(s) is not None]
    before, after = [], []
    for i, s in enumerate(stmts):
        if tile_loop(s) is not None:
            continue
        if _commutes(s, [stmts[j] for j in tiled if j < i] + after):
            before.append(s)
        elif _commutes(s, [stmts[j] for j in tiled if j > i]):
            after.append(s)
        else:
            return None
    return before, after


def _commutes(s, others: list) -> bool:
    mine = accesses(s)
    written = {a.buffer for a in mine if a.written}
    return not any(written & touched(t)
                   or touched(s) & {a.buffer for a in accesses(t) if a.written} for t in others)


def planner_chain(plans) -> list:
    """The net's leading chain of (channels, rows, cols) ensembles, each reading the one
    before, as planner layers (the model :mod:`~latte.compiler.planner` estimates traffic
    on)."""
    chain, last = [], None
    for plan in plans:
        ens = plan.ensemble
        if len(ens.shape) != 3:
            break
        if isinstance(ens, ActivationEnsemble):
            if chain and ens.source is not last:
                break
            chain.append(planner.layer(ens.name, "eltwise", ens.shape))
            last = ens
            continue
        if len(plan.accesses) != 1 or plan.accesses[0].dims is None:
            break
        src, dims = plan.accesses[0].conn.source, plan.accesses[0].dims
        if len(src.shape) != 3 or (chain and src is not last):
            break
        kind = "pool" if dims[0].lo.coef("%0") else "conv"   # a pool reads its own channel
        row = dims[ROW_DIM]
        kernel, stride, pad = row.length, _scale(plan, src), -row.lo.const
        if pad < 0 or any(n + 2 * pad < kernel for n in src.shape[1:]) or (
                kind == "pool" and ens.shape[0] != src.shape[0]):
            break   # not a conv or pool (a row at a fixed offset, a channel window): stop
        chain.append(planner.layer(ens.name, kind, src.shape, out_channels=ens.shape[0],
                                   kernel=kernel, stride=stride, pad=pad))
        if chain[-1].out_shape != tuple(ens.shape):   # not a square conv/pool: stop the model
            chain.pop()
            break
        last = ens
    return chain
