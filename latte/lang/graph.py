"""The network graph: ensembles and connections, in the order the user built them."""

from __future__ import annotations

import enum

from latte.errors import LatteError, MappingError, ShapeError


class Phase(enum.Enum):
    TRAIN = "train"
    TEST = "test"


class Graph:
    """Holds ensembles (in creation order, which is a topological order) and connections."""

    def __init__(self, batch_size: int, time_steps: int = 1):
        if int(batch_size) <= 0:
            raise ShapeError(f"batch size must be positive, got {batch_size}")
        if int(time_steps) <= 0:
            raise ShapeError(f"time_steps must be positive, got {time_steps}")
        self.batch_size = int(batch_size)
        self.time_steps = int(time_steps)
        self.ensembles: list = []
        self.connections: list = []
        self.frozen = False   # set once the net is compiled: the graph can no longer grow

    def add_ensemble(self, ens) -> None:
        if self.frozen:
            raise LatteError(f"ensemble {ens.name!r}: the net is already compiled; build the "
                             "whole net before init() (or solve, forward)")
        if any(e.name == ens.name for e in self.ensembles):
            raise ValueError(f"an ensemble named {ens.name!r} already exists in this net")
        self.ensembles.append(ens)

    def add_connection(self, conn) -> None:
        if self.frozen:
            raise MappingError(f"{conn.describe()}: the net is already compiled; build the "
                               "whole net before init() (or solve, forward)")
        self.connections.append(conn)

    def connections_into(self, ens) -> list:
        return [c for c in self.connections if c.sink is ens]

    def ensemble(self, name_or_ens):
        if not isinstance(name_or_ens, str):
            return name_or_ens
        for e in self.ensembles:
            if e.name == name_or_ens:
                return e
        raise KeyError(f"no ensemble named {name_or_ens!r} in this net")
