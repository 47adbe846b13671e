"""Data-parallel training over MPI (``mpiexec -n N latte run NET.py``).

mpi4py is imported only when the launcher's environment says there is more than one rank,
so a single process never pays for MPI initialization. Each rank trains on its shard of
every global batch; the loss sums its counts over ranks, so summing parameter gradients
over ranks gives exactly the gradient one process would compute on the global batch.
"""

from __future__ import annotations

import os
import time
from functools import cache

import numpy as np

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def world_size() -> int:
    """Number of ranks, read from the launcher's environment (1 without one)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return int(value)
    return 1


def active() -> bool:
    """True when this process is one of several MPI ranks."""
    return world_size() > 1


@cache
def comm():
    """``MPI.COMM_WORLD`` (initializes MPI on first use); None on a single process."""
    if not active():
        return None
    from mpi4py import MPI  # noqa: PLC0415 - only under mpiexec

    return MPI.COMM_WORLD


def rank() -> int:
    """This process's rank (0 on a single process)."""
    c = comm()
    return c.Get_rank() if c is not None else 0


def allreduce_sum(values: np.ndarray) -> np.ndarray:
    """Element-wise sum of ``values`` over ranks (``values`` itself on a single process)."""
    c = comm()
    if c is None:
        return values
    out = np.empty_like(values)
    c.Allreduce(np.ascontiguousarray(values), out)
    return out


def broadcast(array: np.ndarray) -> None:
    """Overwrite ``array`` (contiguous) on every rank with rank 0's copy."""
    c = comm()
    if c is not None:
        c.Bcast(array, root=0)


def shared_seed(seed: int | None) -> int | None:
    """``seed``, or one drawn on rank 0 and shared, so every rank shuffles alike."""
    c = comm()
    if c is None or seed is not None:
        return seed
    return c.bcast(int(np.random.SeedSequence().entropy % 2**63), root=0)


def abort(code: int = 1) -> None:
    """Take the whole job down (mpiexec kills every rank). The message this rank printed
    first reaches the user through mpiexec's forwarding, which the abort would cut short:
    give it a moment."""
    c = comm()
    if c is not None:
        time.sleep(0.5)
        c.Abort(code)


class Communicator:
    """Sums parameter gradients over ranks while backward runs.

    ``start`` posts an in-place ``Iallreduce`` per gradient as soon as its ensemble's
    backward has produced it; ``progress`` tests the pending requests (MPICH progresses
    only inside MPI calls); ``wait`` completes a parameter's reductions just before its
    update. With ``overlap=False`` every reduction is a blocking ``Allreduce`` inside
    ``wait`` (the baseline ``stats`` compare against).
    """

    def __init__(self, overlap: bool = True):
        self.comm = comm()
        self.overlap = overlap
        self._pending: dict[int, tuple] = {}   # id(gradient) -> (gradient, request or None)
        self.wait_seconds = 0.0       # time spent blocked waiting for reductions
        self.steps = 0

    def start(self, grads: list[np.ndarray]) -> None:
        """Begin summing ``grads`` (in place) over ranks."""
        from mpi4py import MPI  # noqa: PLC0415

        for g in grads:
            req = self.comm.Iallreduce(MPI.IN_PLACE, g.reshape(-1)) if self.overlap else None
            self._pending[id(g)] = (g, req)

    def progress(self) -> None:
        """Let the pending reductions advance."""
        reqs = [r for _, r in self._pending.values() if r is not None]
        if reqs:
            from mpi4py import MPI  # noqa: PLC0415

            MPI.Request.Testall(reqs)

    def wait(self, grads: list[np.ndarray]) -> None:
        """Finish the reductions of ``grads`` (blocking ones happen here)."""
        from mpi4py import MPI  # noqa: PLC0415

        t0 = time.perf_counter()
        for g in grads:
            entry = self._pending.pop(id(g), None)
            if entry is None:
                continue
            if entry[1] is None:
                self.comm.Allreduce(MPI.IN_PLACE, g.reshape(-1))
            else:
                entry[1].Wait()
        self.wait_seconds += time.perf_counter() - t0

    def wait_all(self) -> None:
        """Finish every reduction still in flight."""
        if self._pending:
            self.wait([g for g, _ in self._pending.values()])

    def end_step(self) -> None:
        """Close a training step: nothing may stay in flight."""
        self.wait_all()
        self.steps += 1

    @property
    def stats(self) -> dict[str, float]:
        """Reduction time left exposed per step (ms) and the number of steps measured."""
        return {"exposed_ms_per_step": 1e3 * self.wait_seconds / max(1, self.steps),
                "steps": self.steps}
