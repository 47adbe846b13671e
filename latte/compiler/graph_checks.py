"""Checks on the net's graph before anything is compiled: what the compiler cannot run
correctly is an error naming the ensembles, never a silently wrong program."""

from __future__ import annotations

from latte.lang.inplace import give_copies
from latte.lang.time import check_time, order_for_time


def check_graph(net) -> None:
    """Raise :class:`MappingError` for cycles without a recurrent connection and recurrence
    without time steps; give each activation that may not work in place a copy to work on
    (:mod:`latte.lang.inplace`); order the ensembles for the time loops
    (:mod:`latte.lang.time`)."""
    check_time(net)
    give_copies(net)
    order_for_time(net)
