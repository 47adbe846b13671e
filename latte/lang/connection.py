"""Connections between ensembles, given by mapping functions (paper section 3.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from latte.errors import MappingError


@dataclass(frozen=True, eq=False)
class Connection:
    """``mapping(*sink_index)`` selects, per source dimension, an ``int`` or a ``range``."""

    source: object
    sink: object
    mapping: Callable
    padding: float | None = None
    recurrent: bool = False

    def describe(self) -> str:
        return f"connection {self.source.name!r} -> {self.sink.name!r}"


def add_connections(net, source, sink, mapping: Callable, *, padding: float | None = None,
                    recurrent: bool = False) -> Connection:
    """Connect ``source`` to ``sink``: sink neuron ``i`` reads the source neurons ``mapping(*i)``.

    Connections into an ensemble are numbered in the order they are added; neuron bodies
    read connection ``k`` as ``self.inputs[k]``.
    """
    if not callable(mapping):
        raise MappingError(f"connection {source.name!r} -> {sink.name!r}: mapping must be callable")
    if source.net is not net or sink.net is not net:
        raise MappingError(f"connection {source.name!r} -> {sink.name!r}: both ensembles must "
                           "belong to the net they are connected in")
    conn = Connection(source, sink, mapping, None if padding is None else float(padding), recurrent)
    net.add_connection(conn)
    return conn
