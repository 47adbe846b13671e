"""Loop distribution: split a neuron nest into one nest per independent statement group.

Synthesis puts a neuron's whole body under one loop nest; the GEMM matcher needs each
multiply-accumulate alone under a perfect nest (paper section 5.3, "pattern matching").

Assumes: statements of a body exchange data only within one iteration (a neuron reads its
own value and grad) or through ``+=`` accumulation. Guarantees: a group is moved out only
when every buffer it shares with another group is accessed at the same index in both, or is
only accumulated into by both; statements sharing a local scalar stay together.
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import Assign, AugAssign, Block, Kernel, Load, Loop, Ref, Var, walk, written_refs


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
    groups = _groups(body.stmts)
    if len(groups) > 1 and _independent(groups):
        return [replace(loop, body=_block(Block(tuple(g)))) for g in groups]
    return [replace(loop, body=body)]


def _locals(stmt) -> set[str]:
    loop_vars = {n.var for n in walk(stmt) if isinstance(n, Loop)}
    return {n.name for n in walk(stmt) if isinstance(n, Var)} - loop_vars


def _groups(stmts) -> list[list]:
    """Statement groups in order; statements linked by a local scalar share a group."""
    groups: list[list] = []
    names: list[set[str]] = []
    for s in stmts:
        mine = _locals(s)
        linked = [i for i, n in enumerate(names) if n & mine]
        if linked:  # merge everything from the first linked group on, keeping order
            first = linked[0]
            groups[first:] = [[x for g in groups[first:] for x in g] + [s]]
            names[first:] = [set().union(*names[first:], mine)]
        else:
            groups.append([s])
            names.append(set(mine))
    return groups


def _accesses(group) -> dict:
    """buffer -> (set of index tuples, loaded?, only accumulated with +=?)"""
    acc: dict = {}
    for s in group:
        for n in walk(s):
            if isinstance(n, Ref):
                idx, loaded, accum = acc.get(n.buffer, (set(), False, True))
                acc[n.buffer] = (idx | {n.index}, loaded, accum)
            if isinstance(n, Load) and isinstance(n.ref, Ref):
                idx, _, accum = acc[n.ref.buffer] if n.ref.buffer in acc else (set(), False, True)
                acc[n.ref.buffer] = (idx | {n.ref.index}, True, accum)
            if isinstance(n, Assign) and isinstance(n.target, Ref) or (
                    isinstance(n, AugAssign) and isinstance(n.target, Ref) and n.op != "+"):
                idx, loaded, _ = acc.get(n.target.buffer, (set(), False, True))
                acc[n.target.buffer] = (idx, loaded, False)
    return acc


def _independent(groups) -> bool:
    written = [{r.buffer for s in g for r in written_refs(s)} for g in groups]
    acc = [_accesses(g) for g in groups]
    for i in range(len(groups)):
        for j in range(len(groups)):
            if i == j:
                continue
            for buf in written[i] & set(acc[j]):
                idx_i, loaded_i, accum_i = acc[i][buf]
                idx_j, loaded_j, accum_j = acc[j][buf]
                same_point = len(idx_i | idx_j) == 1
                commutative = accum_i and accum_j and not loaded_i and not loaded_j
                if not (same_point or commutative):
                    return False
    return True
