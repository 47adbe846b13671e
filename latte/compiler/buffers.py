"""Buffer planning: every array the compiled program touches, keyed by ``(owner, field)``.

This is the AoS -> SoA step: a neuron's ``value`` becomes one slot of the ensemble's value
buffer ``(batch, *shape)``, a field becomes (a view of) the user's array, a ``Batch`` field
gets a leading batch dimension. An ActivationEnsemble owns no buffers: it works in place on
its source's. With time steps the batch dimension holds ``T x batch`` items, step-major, and
a time loop's kernels see step views (:class:`StepBuffers`). A zero-copy join's producers
keep their buffers as *windows* of the join's (:meth:`BufferPlan.window`): the runtime shows
them as strided views, the kernels access the join's buffer alone. A *transient* buffer holds
a pass's temporary (packed or transformed weights, Winograd's tiles), filled at every run
before it is read: one that a single kernel uses keeps nothing from one run of that kernel
to the next, so such buffers of different kernels share memory (:mod:`latte.runtime.memory`).
"""

from __future__ import annotations

from latte.compiler.ir import Buffer
from latte.lang import ActivationEnsemble, FieldKind


def storage_owner(ens):
    """The ensemble whose value/grad buffers ``ens`` uses (follows in-place activations)."""
    while isinstance(ens, ActivationEnsemble):
        ens = ens.source
    return ens


class BufferPlan:
    """Creates each buffer once and hands out the same object for the same key."""

    def __init__(self, batch_size: int, threads: int = 1, time_steps: int = 1):
        self.batch_size = batch_size * time_steps    # the items of every batched buffer
        self.time_steps = time_steps
        self.threads = threads
        self.buffers: dict[tuple, Buffer] = {}
        self.views: dict[Buffer, tuple[Buffer, int]] = {}   # step view -> (buffer, step shift)
        self.windows: dict[Buffer, tuple[Buffer, int]] = {}  # window -> (buffer, item offset)
        self.transient: set[Buffer] = set()

    def _get(self, key: tuple, name: str, shape: tuple[int, ...], dtype: str = "float32",
             batched: bool = False) -> Buffer:
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = Buffer(key, name, tuple(shape), dtype, batched)
        return buf

    def value(self, ens) -> Buffer:
        ens = storage_owner(ens)
        return self._get((ens, "value"), f"{ens.name}.value", (self.batch_size, *ens.shape),
                         batched=True)

    def grad(self, ens) -> Buffer:
        ens = storage_owner(ens)
        return self._get((ens, "grad"), f"{ens.name}.grad", (self.batch_size, *ens.shape),
                         batched=True)

    def field(self, ens, name: str) -> Buffer:
        f = ens.fields[name]
        if f.spec.kind is FieldKind.BATCH:
            return self._get((ens, name), f"{ens.name}.{name}",
                             (self.batch_size, *f.array.shape), batched=True)
        return self._get((ens, name), f"{ens.name}.{name}", f.array.shape)

    def field_grad(self, ens, name: str) -> Buffer:
        return self._get((ens, "grad_" + name), f"{ens.name}.grad_{name}",
                         ens.fields[name].array.shape)

    def table(self, conn, shape: tuple[int, ...]) -> Buffer:
        return self._get((conn, "table"), f"{conn.source.name}->{conn.sink.name}.table", shape,
                         "int32")

    def derived(self, key: tuple, name: str, shape: tuple[int, ...],
                transient: bool = False) -> Buffer:
        """A buffer the compiled code fills from others for all threads (transformed weights)."""
        return self._mark(self._get(("derived", *key), name, shape), transient)

    def scratch(self, key: tuple, name: str, shape: tuple[int, ...],
                transient: bool = False) -> Buffer:
        """A per-thread tile buffer: one ``shape`` slice per thread."""
        return self._mark(self._get(("scratch", *key), name, (self.threads, *shape)), transient)

    def _mark(self, buf: Buffer, transient: bool) -> Buffer:
        """``buf``, recorded as transient if it is: see the module's docstring."""
        if transient:
            self.transient.add(buf)
        return buf

    def input(self, conn, kind: str) -> Buffer:
        """What a connection's ``"input"`` (the source's values) or ``"grad_input"`` is."""
        return self.value(conn.source) if kind == "input" else self.grad(conn.source)

    def step_view(self, buf: Buffer, shift: int) -> Buffer:
        """One time step's rows of batched ``buf``: the current step's (``shift`` 0) or the
        previous one's (-1). The runtime points it at the rows of each step in turn; before
        step 0 the previous step is an array of its own (zeros; gradients there are dropped)."""
        rows = self.batch_size // self.time_steps
        view = self._get(("step", buf, shift), f"{buf.name}[t{shift:+d}]" if shift else
                         f"{buf.name}[t]", (rows, *buf.shape[1:]), buf.dtype, batched=True)
        self.views[view] = (buf, shift)
        return view

    def base(self, buf: Buffer) -> Buffer:
        """The buffer a step view shows (``buf`` itself if it is none)."""
        return self.views[buf][0] if buf in self.views else buf

    def window(self, buf: Buffer, within: Buffer, offset: int) -> None:
        """Make batched ``buf`` a window of batched ``within``: item ``n`` of ``buf`` is the
        run of elements of item ``n`` of ``within`` from ``offset`` on (a zero-copy join's
        producer, :mod:`latte.compiler.joins`). No kernel may access ``buf`` afterwards."""
        self.windows[buf] = (within, offset)

    def home(self, buf: Buffer) -> tuple[Buffer, int]:
        """The buffer kernels access for ``buf`` (itself unless it is a window, of a window...)
        and where ``buf``'s items start in that buffer's items."""
        offset = 0
        while buf in self.windows:
            buf, step = self.windows[buf]
            offset += step
        return buf, offset

    def value_home(self, ens) -> Buffer:
        """The buffer kernels write ``ens``'s values into: its own, or the zero-copy join's
        it is a window of."""
        return self.home(self.value(ens))[0]

    def private(self, buf: Buffer) -> Buffer:
        """Per-thread private copies of ``buf`` (gradients accumulated in parallel)."""
        return self._get((buf, "private"), f"{buf.name}.private", (self.threads, *buf.shape))


class StepBuffers:
    """The buffers as a time loop's kernels see them: every batched buffer as one step's
    ``batch`` items, and a recurrent connection's source as the previous step's."""

    def __init__(self, plan: BufferPlan):
        self.plan = plan
        self.batch_size = plan.batch_size // plan.time_steps
        self.threads = plan.threads

    def value(self, ens) -> Buffer:
        return self.plan.step_view(self.plan.value(ens), 0)

    def grad(self, ens) -> Buffer:
        return self.plan.step_view(self.plan.grad(ens), 0)

    def input(self, conn, kind: str) -> Buffer:
        return self.plan.step_view(self.plan.input(conn, kind), -1 if conn.recurrent else 0)

    def field(self, ens, name: str) -> Buffer:
        buf = self.plan.field(ens, name)
        return self.plan.step_view(buf, 0) if buf.batched else buf

    def field_grad(self, ens, name: str) -> Buffer:
        return self.plan.field_grad(ens, name)

    def table(self, conn, shape: tuple[int, ...]) -> Buffer:
        return self.plan.table(conn, shape)
