"""Time steps: which ensembles run step by step, and the order everything runs in.

With ``Net(batch, time_steps=T)`` every ensemble has a value at each step. An ensemble that
reads nothing of an earlier step runs once over all ``T x batch`` items (its input
projection is one GEMM); the ensembles on a cycle through a recurrent connection (and
those that read an earlier step) run in a time loop: step t of each, in order, then step
t + 1. Backward runs the loop's steps in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from latte.errors import MappingError
from latte.lang.ensemble import NormalizationEnsemble, source_links, sources


@dataclass(frozen=True, eq=False)
class TimeLoop:
    """Ensembles run step by step, in this order within a step."""

    ensembles: tuple

    @property
    def name(self) -> str:
        return "+".join(e.name for e in self.ensembles)


def check_time(net) -> None:
    """Raise :class:`MappingError` for a cycle that passes through no recurrent connection,
    a recurrent connection in a net without time steps and a normalization ensemble (an
    array operation over every step at once) in a time loop."""
    recurrent = [c for c in net.connections if c.recurrent]
    if recurrent and net.time_steps <= 1:
        raise MappingError(f"{recurrent[0].describe()} is recurrent (it reads the previous time "
                           "step), but the net has time_steps=1: give Net(..., time_steps=T)")
    cycle = _cycle(net)
    if cycle:
        raise MappingError("the connections form a cycle "
                           f"{' <- '.join(repr(e.name) for e in cycle)} that passes through no "
                           "recurrent connection: mark the one that reads the previous time "
                           "step with add_connections(..., recurrent=True)")
    for e in _stepped(net):
        if isinstance(e, NormalizationEnsemble):
            raise MappingError(f"ensemble {e.name!r} is an array operation over the whole batch "
                               "and all time steps; it cannot be on a recurrent cycle")


def time_loops(net) -> list[TimeLoop]:
    """The net's time loops, in net order (after :func:`order_for_time`)."""
    loops, current = [], []
    stepped = _stepped(net)
    for ens in net.ensembles:
        group = stepped.get(ens)
        if current and (group is None or group != stepped[current[-1]]):
            loops.append(TimeLoop(tuple(current)))
            current = []
        if group is not None:
            current.append(ens)
    if current:
        loops.append(TimeLoop(tuple(current)))
    return loops


def order_for_time(net) -> None:
    """Reorder ``net.ensembles`` so that each time loop's ensembles are consecutive and every
    ensemble comes after what it reads in the same step (creation order where it already
    does: a net without recurrence keeps its order)."""
    if not any(c.recurrent for c in net.connections):
        return
    index = {e: i for i, e in enumerate(net.ensembles)}
    comp = _components(net)
    members: dict[int, list] = {}
    for e in net.ensembles:
        members.setdefault(comp[e], []).append(e)
    # components in dependency order (recurrent reads across components too), stable
    after: dict[int, set] = {c: set() for c in members}
    for e in net.ensembles:
        for src in sources(net, e):
            if src in comp and comp[src] != comp[e]:
                after[comp[e]].add(comp[src])
    done: set = set()
    order = []
    while len(done) < len(members):
        ready = min((c for c in members if c not in done and after[c] <= done),
                    key=lambda c: index[members[c][0]])
        done.add(ready)
        order += _step_order(net, members[ready], index)
    net.ensembles[:] = order


def _step_order(net, group: list, index: dict) -> list:
    """``group`` ordered so that each ensemble follows what it reads in the same step."""
    inside = set(group)
    needs = {e: {s for s, rec in source_links(net, e) if s in inside and not rec and s is not e}
             for e in group}
    out: list = []
    while len(out) < len(group):
        ready = min((e for e in group if e not in out and needs[e] <= set(out)),
                    key=lambda e: index[e])
        out.append(ready)
    return out


def _stepped(net) -> dict:
    """Ensemble -> the id of its time loop, for every ensemble that runs step by step."""
    comp = _components(net)
    sizes: dict[int, int] = {}
    for c in comp.values():
        sizes[c] = sizes.get(c, 0) + 1
    out = {}
    for e in net.ensembles:
        if sizes[comp[e]] > 1 or any(rec or s is e for s, rec in source_links(net, e)):
            out[e] = comp[e]
    return out


def _components(net) -> dict:
    """Strongly connected components (Tarjan's algorithm, iterative): ensemble -> id, ids in
    net order of each component's first member."""
    index: dict = {}
    low: dict = {}
    on_stack: set = set()
    stack: list = []
    comp: dict = {}
    counter = 0
    for root in net.ensembles:
        if root in index:
            continue
        work = [(root, iter(sources(net, root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sources(net, nxt))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp[member] = index[node]
                    if member is node:
                        break
    position = {e: i for i, e in enumerate(net.ensembles)}
    first: dict[int, int] = {}
    for e, c in comp.items():
        first[c] = min(first.get(c, len(position)), position.get(e, len(position)))
    return {e: first[c] for e, c in comp.items()}


def _cycle(net) -> list | None:
    """A cycle of ensembles (as a path ending where it starts) over the connections that
    are not recurrent; None if there is none."""
    state: dict = {}      # ensemble -> 1 while on the DFS stack, 2 when done
    known = set(net.ensembles)

    def reads(e):
        return [s for s, rec in source_links(net, e) if not rec]

    for root in net.ensembles:
        if state.get(root) == 2:
            continue
        state[root] = 1
        stack, path = [(root, iter(reads(root)))], [root]
        while stack:
            ens, it = stack[-1]
            src = next(it, None)
            if src is None:
                state[ens] = 2
                stack.pop()
                path.pop()
            elif state.get(src) == 1:
                return path[path.index(src):] + [src]
            elif state.get(src) is None and src in known:
                state[src] = 1
                stack.append((src, iter(reads(src))))
                path.append(src)
    return None
