"""Neurons and the annotations that declare their fields (paper section 3.1)."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass


class FieldKind(enum.Enum):
    PARAM = "param"   # learnable; the compiler provides grad_<name>
    FIELD = "field"   # per-neuron data that is not learned
    BATCH = "batch"   # per batch item state (pooling argmax, dropout mask)


@dataclass(frozen=True)
class FieldSpec:
    """What a neuron field annotation declares."""

    kind: FieldKind
    lr_mult: float = 1.0
    decay_mult: float = 1.0


class Param:
    """Annotation of a learnable neuron field: ``weights: Param`` or ``bias: Param(lr_mult=2.0)``."""

    def __init__(self, lr_mult: float = 1.0, decay_mult: float = 1.0):
        self.spec = FieldSpec(FieldKind.PARAM, float(lr_mult), float(decay_mult))


class Field:
    """Annotation of per-neuron data that is not learned."""

    spec = FieldSpec(FieldKind.FIELD)


class Batch:
    """Annotation of per batch item state of a neuron."""

    spec = FieldSpec(FieldKind.BATCH)


_BUILTIN_FIELDS = ("value", "grad", "inputs", "grad_inputs")


def field_specs(neuron_type: type) -> dict[str, FieldSpec]:
    """The declared fields of a neuron type, base classes first."""
    specs: dict[str, FieldSpec] = {}
    for cls in reversed(neuron_type.__mro__):
        for name, ann in vars(cls).get("__annotations__", {}).items():
            if isinstance(ann, str):  # postponed annotations: evaluate in the class's module
                module = sys.modules.get(cls.__module__)
                try:
                    ann = eval(ann, dict(vars(module)) if module else {}, dict(vars(cls)))  # noqa: S307
                except Exception:  # noqa: BLE001 - not one of ours, ignore like any annotation
                    continue
            if ann is Param:
                specs[name] = FieldSpec(FieldKind.PARAM)
            elif isinstance(ann, Param) or ann in (Field, Batch):
                specs[name] = ann.spec
            if name in _BUILTIN_FIELDS or name.startswith("grad_"):
                raise TypeError(f"{neuron_type.__name__}: field name {name!r} is reserved")
    return specs


def defines_backward(neuron_type: type) -> bool:
    """Whether a class between ``neuron_type`` and ``Neuron`` defines ``backward`` (else the
    compiler derives it from ``forward``)."""
    return any("backward" in vars(c) for c in neuron_type.__mro__ if c not in (Neuron, object))


class Neuron:
    """Base of every neuron type.

    Each neuron has ``value``, ``grad`` (d loss / d value), ``inputs[k]`` (the source values
    connection ``k`` selects) and ``grad_inputs[k]``. Subclasses declare fields with
    ``Param``/``Field``/``Batch`` annotations and define ``forward`` and ``backward`` in
    latte's neuron language; the bodies are compiled, never called.
    """

    def forward(self) -> None:
        """Compute ``self.value`` (zero on entry) from inputs and fields."""

    def backward(self) -> None:
        """Accumulate ``grad_inputs`` and parameter gradients from ``self.grad``."""
