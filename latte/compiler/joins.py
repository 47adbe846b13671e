"""Zero-copy joins: the producers of a concatenation write straight into its buffers.

A concat is one ensemble ``J`` with one padded, shifted one-to-one connection per input
(``stdlib/joins.py``): compiled as it stands it costs a copy of every input, forward and
backward. Where it is safe, this step makes each input's storage a *window* of ``J``'s
buffers and drops ``J``'s kernels. It looks at the program (the mapping analysis and the
neuron's IR), never at a layer's name or class, and relies on these properties, each
checked here (the first that fails is what :class:`Join` records and ``latte explain``
prints):

1. **J is a pure join along its first axis.** Its forward is exactly ``value = inputs[0][0]
   + ... + inputs[n-1][0]`` (every input once, in any order), its backward (written or
   derived) exactly one ``grad_inputs[k][0] += grad`` per input; it has no fields;
   connection ``k`` reads its source ``P_k`` one-to-one, moved back by ``o_k`` along
   dimension 0 only, padded with 0 where that leaves ``P_k``; ``P_k`` is shaped ``(C_k,
   *J.shape[1:])`` and the slices ``[o_k, o_k + C_k)`` partition ``[0, C)``. Then every
   value of ``J`` is exactly one input value and each item of ``P_k`` is the run of ``J``'s
   item at element ``o_k * inner`` (``inner``: the elements of a channel); ``J``'s backward
   adds its gradient's run to ``P_k``'s gradient and nothing else.
2. **Nothing else uses a producer's buffers.** Let ``S_k`` be the ensemble whose buffers
   ``P_k`` uses (``P_k``, or the source an in-place activation ``P_k`` works on). ``S_k``
   is computed by compiled code (no data ensemble, which its data source fills, and no
   normalization ensemble, which Python code writes), and ``S_k`` and ``P_k`` are read by
   nothing but ``P_k`` and ``J``, through one connection. So no kernel accesses two runs of
   one join's buffer (a producer reading another is refused here), and ``P_k``'s gradient
   is ``J``'s gradient's run: ``J`` is its only reader.
3. **Nothing rewrites J's buffers in place.** No in-place activation works on ``J``: it
   would change the producers' values, which their own backward may read.
4. **No time loop.** Neither ``J`` nor any ``S_k`` runs in one, and no step view shows an
   ``S_k``'s buffers (the runtime points a step view at rows of a whole buffer; ``J``'s
   are whole buffers, which a time loop may read step by step).
5. **Every access to S_k's buffers is per item** (a neuron's own element, or the flat loop
   zeroing the whole value buffer), so it has a place in ``J``'s buffer.

Guarantees: ``S_k``'s value buffer is a window of ``J``'s (``BufferPlan.window``); every
kernel's ref to it is rewritten to ``J``'s buffer, channel ``c`` to ``c + o_k`` (a flat view
to ``o_k * inner + i`` over ``J``'s items), and its zeroing to a nest zeroing its run of each
item (which zero-init folding folds into the producer's first write). Gradients alike, but
where ``P_k`` is an in-place activation: its backward turns the gradient of its output into
``S_k``'s own in place, and ``J``'s gradient must stay d loss / d ``J``, so ``S_k``'s gradient
stays a buffer of its own, which the activation's backward now computes from ``J``'s run
(loaded into a local, the body on the local, stored whole: the loads and stores it did in
place). ``J``'s kernels are empty. Every value and gradient the runtime shows is the copy's,
and kernels rewritten here were exactly as synthesis left them (the step runs right after
synthesis, so later passes, GEMM matching first, read the rewritten affine indices). Joins
are applied in net order, so a join feeding another ends up in the outer one's buffer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from latte.compiler.buffers import BufferPlan, storage_owner
from latte.compiler.frontend import NeuronRef
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    Axis,
    BinOp,
    Block,
    Buffer,
    Const,
    Kernel,
    Load,
    Loop,
    Ref,
    Var,
    accesses,
    refs,
    rewrite,
    walk,
)
from latte.compiler.passes.tiling import ensemble_chain, is_batch_loop
from latte.compiler.passes.zero_init import whole, zeroed_region
from latte.compiler.synthesis import neuron_info, neuron_ir
from latte.lang import ActivationEnsemble, DataEnsemble, NormalizationEnsemble, readers


@dataclass(frozen=True)
class Join:
    """A concatenation the step looked at: its inputs with their first channels, and why it
    stays a copy (None: zero-copy)."""

    ensemble: object
    inputs: tuple[tuple[object, int], ...]
    why_not: str | None


def join_in_place(net, plans, bufs: BufferPlan, stepped, opt_level: int) -> list[Join]:
    """Make every safe join of ``net`` zero-copy (rewriting ``plans``' kernels and windowing
    ``bufs``); returns every join found, with why each that stays a copy does."""
    found = []
    for plan in plans:
        shifts = _shifts(plan)
        if shifts is None:
            continue
        starts = tuple((a.conn.source, s[0]) for a, s in zip(plan.accesses, shifts))
        why = _why_not(net, plan, shifts, bufs, stepped, opt_level)
        if why is None:
            why = _apply(plan, starts, plans, bufs)
        found.append(Join(plan.ensemble, starts, why))
    return found


# ------------------------------------------------------------------ property 1

def _shifts(plan) -> list[tuple[int, ...]] | None:
    """Per connection, how far it moves its source back along each dimension, if ``plan``'s
    ensemble is a join: its forward sums its inputs, each read one-to-one (moved), and each
    neuron reads one real value (more than one input: each padded)."""
    ens, accs = plan.ensemble, plan.accesses
    if isinstance(ens, ActivationEnsemble) or not accs:
        return None
    shifts = []
    for a in accs:
        if a.dims is None or len(a.dims) != len(ens.shape) or (len(accs) > 1 and a.in_bounds):
            return None
        if any(d.step != 1 or d.length != 1 or d.lo.terms != (((f"%{j}", 1),) if n > 1 else ())
               for j, (d, n) in enumerate(zip(a.dims, ens.shape))):
            return None
        shifts.append(tuple(-d.lo.const for d in a.dims))
    forward = neuron_ir(ens, "forward", neuron_info(ens, accs)).stmts
    if len(forward) != 1 or not _is(forward[0], Assign, "value"):
        return None
    return shifts if sorted(_summed(forward[0].value) or ()) == list(range(len(accs))) else None


def _is(stmt, kind: type, target: str) -> bool:
    return isinstance(stmt, kind) and isinstance(stmt.target, NeuronRef) and stmt.target.kind == target


def _summed(e) -> list[int] | None:
    """The connections ``e`` adds up as ``inputs[k][0] + ...``, or None if it is more."""
    if isinstance(e, BinOp) and e.op == "+":
        a, b = _summed(e.lhs), _summed(e.rhs)
        return None if a is None or b is None else a + b
    if isinstance(e, NeuronRef) and e.kind == "input" and e.index == (Const(0),):
        return [e.conn]
    return None


def _backward_scatters(plan) -> bool:
    """The backward is one ``grad_inputs[k][0] += grad`` per input and nothing else."""
    ens = plan.ensemble
    body = neuron_ir(ens, "backward", neuron_info(ens, plan.accesses)).stmts
    conns = [s.target.conn for s in body if _is(s, AugAssign, "grad_input") and s.op == "+"
             and s.target.index == (Const(0),) and isinstance(s.value, NeuronRef)
             and s.value.kind == "grad"]
    return len(conns) == len(body) and sorted(conns) == list(range(len(plan.accesses)))


def _pure(plan, shifts) -> str | None:
    """Why ``plan``'s join is not a pure join along its first axis (property 1)."""
    ens, accs = plan.ensemble, plan.accesses
    moved = sorted({j for s in shifts for j, o in enumerate(s) if o})
    if moved and moved != [0]:
        return f"joined along dimension {moved[-1]}, not the first: an input is no run of an item"
    slices = sorted((s[0], a.conn.source.shape[0]) for a, s in zip(accs, shifts))
    if (any(a.conn.source.shape[1:] != ens.shape[1:] for a in accs)
            or [o for o, _ in slices] != [sum(n for _, n in slices[:k]) for k in range(len(slices))]
            or sum(n for _, n in slices) != ens.shape[0]):
        return "its inputs' slices do not partition its channels"
    if any(not a.in_bounds and a.conn.padding != 0.0 for a in accs):
        return "its inputs are padded with something else than 0"
    if ens.fields:
        return f"it has fields ({', '.join(ens.fields)})"
    if not _backward_scatters(plan):
        return "its backward is not one grad_inputs[k][0] += grad per input"
    return None


# ------------------------------------------------------------------ properties 2-4

def _why_not(net, plan, shifts, bufs: BufferPlan, stepped, opt_level: int) -> str | None:
    """Why ``plan``'s join must stay a copy (None: it may be zero-copy)."""
    if opt_level == 0:
        return "opt level 0 runs the plain copy (the reference of the other levels)"
    if os.environ.get("LATTE_JOINS") == "0":
        return "LATTE_JOINS=0 keeps every join a copy"
    why = _pure(plan, shifts)
    if why is not None:
        return why
    ens = plan.ensemble
    act = next((r for r in readers(net, ens) if isinstance(r, ActivationEnsemble)
                and storage_owner(r) is ens), None)
    if act is not None:
        return f"the in-place activation {act.name!r} works on its buffers"
    for a in plan.accesses:
        why = _private(net, ens, a.conn.source)
        if why is not None:
            return why
    owners = [storage_owner(a.conn.source) for a in plan.accesses]
    for e in [ens, *owners]:
        if e in stepped:
            return f"{e.name!r} runs in a time loop"
    for e in owners:
        if any(b in (bufs.value(e), bufs.grad(e)) for b, _ in bufs.views.values()):
            return f"{e.name!r} is read in a time loop, a step at a time"
    return None


def _private(net, join, source) -> str | None:
    """Why the buffers of ``source`` (a join's input) are no window's to give (property 2)."""
    owner = storage_owner(source)
    if isinstance(owner, DataEnsemble):
        return f"{owner.name!r} is a data ensemble (its data source fills it)"
    if isinstance(owner, NormalizationEnsemble):
        return f"{owner.name!r} is computed by Python code (a normalization ensemble)"
    if sum(c.source is source for c in net.connections_into(join)) > 1:
        return f"{source.name!r} is joined twice"
    group = [source]   # the source and what it works on in place (one activation at most:
    while isinstance(group[-1], ActivationEnsemble):   # one on another gets a copy)
        group.append(group[-1].source)
    for e in group:
        other = [r for r in readers(net, e) if r not in group and (r is not join or e is not source)]
        if other:
            return f"{e.name!r} is also read by {other[0].name!r}"
    return None


# ------------------------------------------------------------------ property 5: the rewrite

def _apply(plan, starts, plans, bufs: BufferPlan) -> str | None:
    """Window the inputs' buffers into ``plan``'s and rewrite the kernels that access them;
    None, or why a kernel cannot be rewritten (then nothing changes)."""
    ens = plan.ensemble
    inner = ens.size // ens.shape[0]
    moves: dict[Buffer, tuple[Buffer, int]] = {}
    acts: dict[object, tuple[Buffer, int]] = {}
    for source, first in starts:
        owner = storage_owner(source)
        moves[bufs.value(owner)] = (bufs.value(ens), first * inner)
        if source is owner:
            moves[bufs.grad(owner)] = (bufs.grad(ens), first * inner)
        else:
            acts[source] = (bufs.grad(ens), first * inner)
    new = {}
    for other in (p for p in plans if p is not plan):
        for phase, kernel in other.kernels.items():
            out = kernel
            if phase == "backward" and other.ensemble in acts:
                out = _out_of_place(out, bufs.grad(other.ensemble), *acts[other.ensemble])
            if out is not None and any(a.buffer in moves for a in accesses(out.body)):
                out = _moved_kernel(out, moves)
            if out is None:
                return (f"a kernel of {other.ensemble.name!r} accesses an input's buffers "
                        "otherwise than an item's elements")
            if out is not kernel:
                new[other.ensemble, phase] = out
    for other in plans:
        for phase in other.kernels:
            other.kernels[phase] = new.get((other.ensemble, phase), other.kernels[phase])
    for phase, kernel in plan.kernels.items():
        plan.kernels[phase] = replace(kernel, body=Block(()))
    for buf, (within, offset) in moves.items():
        bufs.window(buf, within, offset)
    return None


def _moved(ref: Ref, within: Buffer, offset: int) -> Ref | None:
    """``ref`` to a window's item ``(n, i, ...)`` as the ref to ``within``'s item that holds
    it (the window starts at element ``offset`` of each of ``within``'s items); None unless
    ``ref``'s view is ``(items, first, *rest)`` over whole items and ``rest`` divides
    ``offset`` and ``within``'s items."""
    buf, view = ref.buffer, ref.view
    tail = 1
    for extent in view[2:]:
        tail *= extent
    item, whole = buf.size // buf.shape[0], within.size // within.shape[0]
    if (len(view) < 2 or view[0] != buf.shape[0] or view[1] * tail != item or offset % tail
            or whole % tail or not isinstance(ref.index[1], Affine)):
        return None
    index = (ref.index[0], ref.index[1] + offset // tail, *ref.index[2:])
    return Ref(within, index, (view[0], whole // tail, *view[2:]))


def _moved_kernel(kernel: Kernel, moves: dict) -> Kernel | None:
    """``kernel`` with every access to a buffer of ``moves`` (window -> (buffer, offset)) in
    that buffer, or None if one is not per item."""
    failed = []

    def move(node):
        if isinstance(node, Ref) and node.buffer in moves:
            out = _moved(node, *moves[node.buffer])
            failed.extend([node] if out is None else [])
            return out
        return None

    stmts = []
    for s in kernel.body.stmts:
        zeroed = _flat_zeroing(s)
        stmts.append(_zero_items(zeroed, kernel.ensemble, *moves[zeroed])
                     if zeroed in moves else rewrite(s, move))
    return None if failed else replace(kernel, body=Block(tuple(stmts)))


def _flat_zeroing(s) -> Buffer | None:
    """The buffer ``s`` zeroes, if it clears all of one."""
    found = zeroed_region(s)
    return found[0] if found is not None and found[1] == whole(found[0]) else None


def _zero_items(buf: Buffer, ens, within: Buffer, offset: int) -> Loop:
    """Zeroing window ``buf``: its run of each item of ``within``, a nest over the items."""
    items, item = buf.shape[0], buf.size // buf.shape[0]
    ref = _moved(Ref(buf, (Affine.of("_zn"), Affine.of("_zi")), (items, item)), within, offset)
    inner = Loop("_zi", 0, item, Block((Assign(ref, Const(0.0)),)))
    return Loop("_zn", 0, items, Block((inner,)), axis=Axis(ens, -1, ens.name))


def _out_of_place(kernel: Kernel, grad: Buffer, within: Buffer, offset: int) -> Kernel | None:
    """An in-place activation's backward reading its output's gradient from ``within`` (from
    element ``offset`` of each item) and storing the whole of ``grad``, its input's: its
    neuron body works on a local loaded from ``within`` first and stored to ``grad`` last."""
    stmts = kernel.body.stmts
    if len(stmts) != 1 or not is_batch_loop(stmts[0]):
        return None
    chain = ensemble_chain(stmts[0])
    own = {r for r in refs(kernel.body) if r.buffer is grad}
    if len(own) != 1:
        return None
    (ref,) = own
    load = _moved(ref, within, offset)
    if load is None:
        return None
    names = {n.name if isinstance(n, Var) else n.var for n in walk(kernel.body)
             if isinstance(n, (Var, Loop))}
    local = Var(next(f"_g{k}" for k in range(len(names) + 1) if f"_g{k}" not in names))

    def to_local(node):
        if isinstance(node, Load) and node.ref == ref:
            return local
        if isinstance(node, (Assign, AugAssign)) and node.target == ref:
            return replace(node, target=local)
        return None

    body = rewrite(chain[-1].body, to_local)
    block = Block((Assign(local, Load(load)), *body.stmts, Assign(ref, local)))
    for lp in reversed(chain):
        block = Block((replace(lp, body=block),))
    return replace(kernel, body=block)
