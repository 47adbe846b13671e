"""Data-parallel training over MPI (``mpiexec -n N latte run NET.py``).

mpi4py is imported only when the launcher's environment says there is more than one rank,
so a single process never pays for MPI initialization. Each rank trains on its shard of
every global batch; the loss sums its counts over ranks, so summing parameter gradients
over ranks gives exactly the gradient one process would compute on the global batch.

Nothing may hang: :func:`agree` stops every rank alike when they differ in what must be the
same (the net, batch size, data sizes, epochs, seed), and under ``latte run``
(:func:`watch_exits`) a rank that finishes tells the others, so one still waiting in a
collective that rank will never join stops with an error naming it (:func:`finish`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from functools import cache
from typing import Any

import numpy as np

from latte.errors import DistributedError
from latte.lang import Phase

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
# seconds a collective may still take after a rank it waits for said it has finished
_GRACE = float(os.environ.get("LATTE_MPI_EXIT_GRACE", 10))


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
    wait(c.Iallreduce(np.ascontiguousarray(values), out), "a reduction")
    return out


def broadcast(array: np.ndarray) -> None:
    """Overwrite ``array`` (contiguous) on every rank with rank 0's copy."""
    c = comm()
    if c is not None:
        wait(c.Ibcast(array, root=0), "a broadcast")


def allgather(obj: Any) -> list:
    """Every rank's ``obj`` (a small picklable object), in rank order, on every rank."""
    return [obj] if comm() is None else _arrived("an allgather", lambda c: c.allgather(obj))


def gather(obj: Any) -> list | None:
    """Every rank's ``obj`` in rank order on rank 0 (None on the others)."""
    return [obj] if comm() is None else _arrived("a gather", lambda c: c.gather(obj, root=0))


def bcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    return obj if comm() is None else _arrived("a broadcast", lambda c: c.bcast(obj, root=0))


def _arrived(what: str, collective: Callable) -> Any:
    """Run a blocking object ``collective`` once every rank has reached it (mpi4py has no
    non-blocking ones: a barrier polled by :func:`wait` stands guard)."""
    c = comm()
    wait(c.Ibarrier(), what)
    return collective(c)


def shared_seed(seed: int | None) -> int | None:
    """``seed``, or one drawn on rank 0 and shared, so every rank shuffles alike; ranks
    given different seeds are an error."""
    if comm() is None:
        return seed
    proposals = allgather((seed, int(np.random.SeedSequence().entropy % 2**63)))
    _compare("the seed", [given for given, _ in proposals])
    return seed if seed is not None else proposals[0][1]


def agree(facts: dict[str, Hashable]) -> None:
    """Check that every rank has the same ``facts`` (name -> value, in the order to check
    them); on the first difference every rank raises the same
    :class:`~latte.errors.DistributedError` naming the ranks and their values."""
    if comm() is None:
        return
    every = allgather(facts)
    names = list(dict.fromkeys(name for f in every for name in f))
    for name in names:
        _compare(name, [f.get(name, "nothing") for f in every])


def _compare(name: str, values: list) -> None:
    if all(v == values[0] for v in values):
        return
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(str(v), []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} "
             f"{'have' if len(rs) > 1 else 'has'} {v}" for v, rs in groups.items()]
    raise DistributedError(f"ranks disagree on {name}: {', '.join(parts)}; every rank must run "
                           "the same script on the same data", shared=True)


# ---------------------------------------------------------------- early exits
class _Exits:
    """Notes that ranks have finished: one receive from any rank stays posted (on a
    communicator of its own) until every other rank's note has come."""

    def __init__(self, world):
        from mpi4py import MPI  # noqa: PLC0415

        self.comm = world.Dup()
        self.others = self.comm.Get_size() - 1
        self.left: list[int] = []   # ranks whose notes have come, in arrival order
        self._buf = np.zeros(1, np.int64)
        self._status = MPI.Status()
        self._request = self._receive()

    def _receive(self):
        from mpi4py import MPI  # noqa: PLC0415

        return self.comm.Irecv(self._buf, source=MPI.ANY_SOURCE, tag=0)

    def arrived(self) -> bool:
        """Whether some rank has said it finished (takes in the notes that have come)."""
        while len(self.left) < self.others and self._request.Test(self._status):
            self.left.append(self._status.Get_source())
            if len(self.left) < self.others:
                self._request = self._receive()
        return bool(self.left)

    def finish(self) -> None:
        """Tell every other rank this one finished, then wait (politely: the others may
        still be working) until every rank has, taking in their notes."""
        me = self.comm.Get_rank()
        sends = [self.comm.Isend(np.array([me], np.int64), dest=r, tag=0)
                 for r in range(self.others + 1) if r != me]
        barrier = self.comm.Ibarrier()
        while not barrier.Test():
            time.sleep(0.002)
        while len(self.left) < self.others:
            self._request.Wait(self._status)
            self.left.append(self._status.Get_source())
            if len(self.left) < self.others:
                self._request = self._receive()
        for s in sends:
            s.Wait()

    def close(self) -> None:
        """Withdraw the receive still posted (a rank leaving without :meth:`finish`)."""
        if len(self.left) < self.others:
            self._request.Cancel()
            self._request.Wait()


_exits: _Exits | None = None


def watch_exits() -> None:
    """From now on (collective, under ``latte run``), a collective waiting for a rank that
    has called :func:`finish` ends with an error instead of waiting forever."""
    global _exits
    if comm() is not None and _exits is None:
        _exits = _Exits(comm())


def finish() -> None:
    """This rank ended its script successfully: tell the others and wait for them."""
    global _exits
    if _exits is not None:
        _exits.finish()
        _exits = None


def unwatch() -> None:
    """Stop watching for finished ranks without saying this one finished (every rank
    stops alike, as after :func:`agree` failed)."""
    global _exits
    if _exits is not None:
        _exits.close()
        _exits = None


def wait(request, what: str) -> None:
    """Complete a collective's ``request``. Under :func:`watch_exits`, a rank that finished
    before this collective cannot join it: once such a rank's note has come, the request
    gets ``LATTE_MPI_EXIT_GRACE`` seconds (default 10; a collective that rank did join
    completes in far less), then :class:`~latte.errors.DistributedError` names it."""
    if _exits is None:
        request.Wait()
        return
    deadline = None
    while not request.Test():
        if deadline is None:
            if _exits.arrived():
                deadline = time.monotonic() + _GRACE
        elif time.monotonic() > deadline and not request.Test():
            gone = ", ".join(map(str, _exits.left))
            raise DistributedError(f"rank{'s' if len(_exits.left) > 1 else ''} {gone} finished "
                                   f"the script (exit status 0) while rank {rank()} waits for "
                                   f"{'them' if len(_exits.left) > 1 else 'it'} in {what}: "
                                   "every rank must run the same training (did the script "
                                   "return or exit early on some ranks?)")


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
    update. With ``overlap=False`` every reduction starts and ends inside ``wait``
    (the baseline ``stats`` compare against).
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
        """Finish the reductions of ``grads`` (those not overlapped happen here)."""
        from mpi4py import MPI  # noqa: PLC0415

        t0 = time.perf_counter()
        for g in grads:
            entry = self._pending.pop(id(g), None)
            if entry is None:
                continue
            request = entry[1]   # (a request Testall completed is falsy: compare with None)
            if request is None:
                request = self.comm.Iallreduce(MPI.IN_PLACE, g.reshape(-1))
            wait(request, "a gradient reduction")
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


def net_facts(net) -> dict[str, Hashable]:
    """What ranks training ``net`` together must agree on, for :func:`agree`: batch size,
    time steps, every ensemble's name and shape in order, parameter shapes and each data
    source's sample counts (the global data set every rank shards)."""
    facts: dict[str, Hashable] = {"batch size": net.batch_size, "time steps": net.time_steps,
                                  "the number of ensembles": len(net.ensembles)}
    facts |= {f"ensemble {i}": f"{e.name} of shape {tuple(e.shape)}"
              for i, e in enumerate(net.ensembles)}
    facts |= {f"the shape of parameter {p.name}": tuple(p.value.shape) for p in net.params}
    for i, source in enumerate(net.data_sources()):
        facts |= {f"data source {i}'s {phase.name.lower()} samples": source.num_samples(phase)
                  for phase in Phase}
    return facts
