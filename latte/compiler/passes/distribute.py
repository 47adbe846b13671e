"""Loop distribution: split a neuron nest into one nest per independent statement group.

Synthesis puts a neuron's whole body under one loop nest; the GEMM matcher needs each
multiply-accumulate alone under a perfect nest (paper section 5.3, "pattern matching").

Distributing a loop runs every iteration of one group before the next group starts, which
is legal when the groups exchange data only within one iteration. Checked here: every
buffer a group writes and another group uses is either accessed at one index expression
in both that is injective over the iterations of the loop and the loops inside it (so an
element is shared only within one iteration; a mixed-radix test on the affine offset), or
only accumulated into (``+=``, never loaded) by both; statements sharing a local scalar
stay together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from latte.compiler.ir import (
    Assign,
    AugAssign,
    Block,
    Buffer,
    Kernel,
    Load,
    Loop,
    Ref,
    Var,
    children,
    remembered,
    walk,
    written_refs,
)


def distribute_loops(kernel: Kernel) -> Kernel:
    """Distribute every loop whose body holds several independent statement groups."""
    return replace(kernel, body=_block(kernel.body))


def _block(block: Block) -> Block:
    out = []
    for s in block.stmts:
        if isinstance(s, Loop):
            out.extend(_loop(s))
        else:
            out.append(s)
    return Block(tuple(out))


def _loop(loop: Loop) -> list[Loop]:
    body = _block(loop.body)
    found = groups(body.stmts)
    if len(found) > 1 and _independent(found, loop):
        return [replace(loop, body=_block(Block(tuple(g)))) for g in found]
    return [replace(loop, body=body)]


def _locals(stmt) -> frozenset[str]:
    """The names ``stmt`` reads or writes that none of its loops binds."""
    names, loop_vars = _names(stmt)
    return names - loop_vars


def _names(node) -> tuple[frozenset[str], frozenset[str]]:
    """The variable names below ``node`` and the loop variables among its loops (remembered
    by the node: nested loops ask for their statements' at every level)."""
    def find() -> tuple[frozenset[str], frozenset[str]]:
        names, loop_vars = set(), set()
        for child in children(node):
            more, bound = _names(child)
            names |= more
            loop_vars |= bound
        if isinstance(node, Var):
            names.add(node.name)
        if isinstance(node, Loop):
            loop_vars.add(node.var)
        return frozenset(names), frozenset(loop_vars)
    return remembered(node, "_names", find)


def groups(stmts, unlinked: frozenset[str] = frozenset()) -> list[list]:
    """Statement groups in order; statements linked by a local scalar (other than
    ``unlinked``) share a group."""
    groups: list[list] = []
    names: list[set[str]] = []
    for s in stmts:
        mine = _locals(s) - unlinked
        linked = [i for i, n in enumerate(names) if n & mine]
        if linked:  # merge everything from the first linked group on, keeping order
            first = linked[0]
            groups[first:] = [[x for g in groups[first:] for x in g] + [s]]
            names[first:] = [set().union(*names[first:], mine)]
        else:
            groups.append([s])
            names.append(set(mine))
    return groups


@dataclass
class _Use:
    """How one statement group uses one buffer."""

    indices: set = field(default_factory=set)
    loaded: bool = False
    accumulated_only: bool = True   # every store is a ``+=``


def uses(group) -> dict[Buffer, _Use]:
    uses: dict[Buffer, _Use] = {}
    for s in group:
        for n in walk(s):
            if isinstance(n, Ref):
                uses.setdefault(n.buffer, _Use()).indices.add((n.index, n.view))
            elif isinstance(n, Load) and isinstance(n.ref, Ref):
                uses.setdefault(n.ref.buffer, _Use()).loaded = True
            elif isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Ref) and not (
                    isinstance(n, AugAssign) and n.op == "+"):
                uses.setdefault(n.target.buffer, _Use()).accumulated_only = False
    return uses


def injective(index: tuple, view: tuple, loop: Loop, extents: dict[str, int]) -> bool:
    """Do two different iterations of ``loop`` (whatever the loops inside it, of
    ``extents``, do) reach different elements through ``index``? Sufficient: the offset
    depends on ``loop.var`` and, sorted by size, each stride exceeds the span of the
    smaller ones (the loop variables are digits of the offset)."""
    off = Ref(None, index, view).offset()
    if off is None or (loop.extent > 1 and not off.coef(loop.var)):
        return False
    span = 0
    for c, n in sorted((abs(c), extents[v]) for v, c in off.terms if extents.get(v, 1) > 1):
        if c <= span:
            return False
        span += c * (n - 1)
    return True


def _independent(groups, loop: Loop) -> bool:
    extents = {n.var: n.extent for n in walk(loop) if isinstance(n, Loop)}
    written = [{r.buffer for s in g for r in written_refs(s)} for g in groups]
    used = [uses(g) for g in groups]
    for i in range(len(groups)):
        for j in range(len(groups)):
            if i == j:
                continue
            for buf in written[i] & used[j].keys():
                a, b = used[i][buf], used[j][buf]
                points = a.indices | b.indices
                same_point = len(points) == 1 and injective(*next(iter(points)), loop, extents)
                commutative = (a.accumulated_only and b.accumulated_only
                               and not a.loaded and not b.loaded)
                if not (same_point or commutative):
                    return False
    return True
