"""Buffer planning: every array the compiled program touches, keyed by ``(owner, field)``.

This is the AoS -> SoA step: a neuron's ``value`` becomes one slot of the ensemble's value
buffer ``(batch, *shape)``, a field becomes (a view of) the user's array, a ``Batch`` field
gets a leading batch dimension. An ActivationEnsemble owns no buffers: it works in place on
its source's.
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

    def __init__(self, batch_size: int, threads: int = 1):
        self.batch_size = batch_size
        self.threads = threads
        self.buffers: dict[tuple, Buffer] = {}

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

    def scratch(self, key: tuple, name: str, shape: tuple[int, ...]) -> Buffer:
        """A per-thread tile buffer: one ``shape`` slice per thread."""
        return self._get(("scratch", *key), name, (self.threads, *shape))

    def private(self, buf: Buffer) -> Buffer:
        """Per-thread private copies of ``buf`` (gradients accumulated in parallel)."""
        return self._get((buf, "private"), f"{buf.name}.private", (self.threads, *buf.shape))
