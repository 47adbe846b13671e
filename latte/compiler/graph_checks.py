"""Checks on the net's graph before anything is compiled: what the compiler cannot run
correctly is an error naming the ensembles, never a silently wrong program."""

from __future__ import annotations

from latte.errors import MappingError
from latte.lang import sources
from latte.lang.inplace import give_copies


def check_graph(net) -> None:
    """Raise :class:`MappingError` for recurrent connections and cycles; then give each
    activation that may not work in place a copy to work on (:mod:`latte.lang.inplace`)."""
    _check_recurrence(net)
    give_copies(net)


def _check_recurrence(net) -> None:
    recurrent = [c for c in net.connections if c.recurrent]
    if recurrent:
        raise MappingError(f"{recurrent[0].describe()} is recurrent: recurrent connections "
                           "(time steps) are not implemented yet")
    order = {e: i for i, e in enumerate(net.ensembles)}
    state: dict = {}      # ensemble -> 1 while on the DFS stack, 2 when done
    for root in net.ensembles:
        stack = [(root, iter(sources(net, root)))]
        state[root] = state.get(root) or 1
        if state[root] == 2:
            continue
        path = [root]
        while stack:
            ens, it = stack[-1]
            src = next(it, None)
            if src is None:
                state[ens] = 2
                stack.pop()
                path.pop()
            elif state.get(src) == 1:
                cycle = path[path.index(src):] + [src]
                raise MappingError("the connections form a cycle "
                                   f"{' <- '.join(repr(e.name) for e in cycle)}; a cycle must "
                                   "pass through a recurrent connection (time steps), which is "
                                   "not implemented yet")
            elif state.get(src) is None and src in order:
                state[src] = 1
                stack.append((src, iter(sources(net, src))))
                path.append(src)
