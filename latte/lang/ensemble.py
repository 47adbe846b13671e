"""Ensembles: collections of neurons of one type (paper section 3.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from latte.aligned import aligned_zeros
from latte.errors import MappingError, ShapeError
from latte.lang.graph import Phase
from latte.lang.neuron import FieldKind, FieldSpec, Neuron, field_specs


@dataclass(frozen=True, eq=False)
class FieldData:
    """A neuron field's storage: ``array[index_map(*neuron)]`` is one neuron's vector."""

    name: str
    spec: FieldSpec
    array: np.ndarray
    index_map: Callable[..., Any] | None  # None: leading dims are the ensemble's shape
    lead_ndim: int                         # array dims that select a neuron's vector
    given_shape: tuple[int, ...] = ()      # the array's shape as given (a Param's .value shape)

    @property
    def vector_shape(self) -> tuple[int, ...]:
        return self.array.shape[self.lead_ndim:]


def published(array: np.ndarray, axes: tuple[int, ...] | None) -> np.ndarray:
    """``array`` as stored, viewed with its axes in the published order ``axes``."""
    return array if axes is None else array.transpose(axes)


def unpublished(array: np.ndarray, axes: tuple[int, ...] | None) -> np.ndarray:
    """A published array viewed in the order it is stored in (contiguous if it is)."""
    return array if axes is None else array.transpose(np.argsort(axes))


def _shape(shape) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    if not shape or any(d <= 0 for d in shape):
        raise ShapeError(f"ensemble shape must be a non-empty tuple of positive ints, got {shape}")
    return shape


def _check_inputs(net, name: str, inputs) -> None:
    """Every input of the ensemble ``name`` being built must be an ensemble of ``net``."""
    for ens in inputs:
        if not isinstance(ens, BaseEnsemble):
            raise TypeError(f"ensemble {name!r}: its inputs must be ensembles, got {ens!r}")
        if ens.net is not net:
            raise MappingError(f"ensemble {name!r}: its input {ens.name!r} belongs to another "
                               "Net; build every layer on ensembles of its own net")


class BaseEnsemble:
    """What every kind of ensemble has: a name, a shape and a place in a net."""

    def __init__(self, net, name: str, shape):
        if not isinstance(name, str) or not name:
            raise ValueError("an ensemble needs a non-empty string name")
        self.name = name
        self.shape = _shape(shape)
        self.net = net
        net.add_ensemble(self)

    @property
    def size(self) -> int:
        """Number of neurons."""
        return int(np.prod(self.shape))

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, shape={self.shape})"


class Ensemble(BaseEnsemble):
    """``Ensemble(net, name, neuron_type, shape, **fields)``.

    Each declared field is given as an array whose leading dimensions are ``shape`` or as
    ``(array, index_map)`` where ``index_map(*neuron_index)`` picks the leading index.
    """

    def __init__(self, net, name: str, neuron_type: type, shape, **fields):
        if not (isinstance(neuron_type, type) and issubclass(neuron_type, Neuron)):
            raise TypeError(f"ensemble {name!r}: neuron_type must be a Neuron subclass")
        super().__init__(net, name, shape)
        self.neuron_type = neuron_type
        self.fields: dict[str, FieldData] = {}
        # a layer made of several ensembles may publish a field under the layer's name
        # (an LSTM's "lstm.weight_ih", as PyTorch names it): field -> public name
        self.public_names: dict[str, str] = {}
        # and in another order of its axes than it is stored in (an embedding's table, stored
        # a column per neuron, published as PyTorch's (vocab, dim)): field -> axes
        self.public_axes: dict[str, tuple[int, ...]] = {}
        specs = field_specs(neuron_type)
        missing = set(specs) - set(fields)
        extra = set(fields) - set(specs)
        if missing or extra:
            raise TypeError(f"ensemble {name!r} ({neuron_type.__name__}): "
                            + (f"missing fields {sorted(missing)} " if missing else "")
                            + (f"unknown fields {sorted(extra)}" if extra else ""))
        for fname, spec in specs.items():
            self.fields[fname] = self._field(fname, spec, fields[fname])

    def field_name(self, fname: str) -> str:
        """The name a field goes by in ``net.params`` and snapshots: ``"<ensemble>.<field>"``
        unless the layer published it under another."""
        return self.public_names.get(fname, f"{self.name}.{fname}")

    def public(self, fname: str, array: np.ndarray) -> np.ndarray:
        """A view of ``array`` (field ``fname`` as stored, its ``given_shape``) in the order
        the field is published in (a parameter's ``.value`` and ``.grad``)."""
        return published(array, self.public_axes.get(fname))

    def stored(self, fname: str, array: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`public`: a published array viewed as the field is stored."""
        return unpublished(array, self.public_axes.get(fname))

    def _field(self, fname: str, spec: FieldSpec, given) -> FieldData:
        index_map = None
        if isinstance(given, tuple) and len(given) == 2 and callable(given[1]):
            given, index_map = given
        values = np.asarray(given, dtype=np.float32)
        array = aligned_zeros(values.shape, np.float32)   # the ensemble's own copy, which the
        array[...] = values                                # compiled program keeps as it is
        if index_map is None:
            if array.shape[: len(self.shape)] != self.shape:
                raise ShapeError(f"ensemble {self.name!r}: field {fname!r} has shape {array.shape}, "
                                 f"whose leading dims should be the ensemble shape {self.shape}")
            lead = len(self.shape)
        else:
            sample = index_map(*([0] * len(self.shape)))
            lead = len(sample) if isinstance(sample, tuple) else 1
            if array.ndim < lead:
                raise ShapeError(f"ensemble {self.name!r}: field {fname!r} index_map returns {lead} "
                                 f"indices but the array has only {array.ndim} dims")
        given = array.shape
        if array.ndim == lead:  # a scalar per neuron is a vector of one
            array = array.reshape(array.shape + (1,))
        return FieldData(fname, spec, array, index_map, lead, given)

    @property
    def params(self) -> list[FieldData]:
        return [f for f in self.fields.values() if f.spec.kind is FieldKind.PARAM]

    def before_forward(self, phase: Phase, fields: dict[str, np.ndarray]) -> None:
        """Called by ``Net.forward`` before each forward pass when a subclass overrides it
        (dropout draws its masks here), with writable views of the live field buffers, as
        ``Net.field`` gives them. Once per pass, not per neuron."""


class ActivationEnsemble(Ensemble):
    """An activation applied in place over ``source`` (paper section 3.2).

    It shares ``source``'s value and gradient buffers: ``forward`` rewrites ``self.value``
    and ``backward`` rewrites ``self.grad`` into the gradient of the source's value.
    """

    def __init__(self, net, name: str, neuron_type: type, source: BaseEnsemble, **fields):
        _check_inputs(net, name, [source])
        self.source = source
        super().__init__(net, name, neuron_type, source.shape, **fields)


class NormalizationEnsemble(BaseEnsemble):
    """Array operations over whole ensembles (softmax loss, batch statistics).

    Subclasses implement :meth:`forward` and :meth:`backward` on numpy arrays shaped
    ``(batch, *shape)``. A loss sets ``self.loss`` in ``forward``. ``phase`` is the phase
    of the pass being run (set before each forward). ``state`` holds named arrays that
    persist across batches (a batch norm's running statistics): ``net.state`` collects them
    and ``net.save`` / ``net.load`` keep them.
    """

    is_loss = False
    # (correct predictions, items) of the last batch over all ranks, for ensembles that
    # score predictions against labels; the test pass reports accuracy from it
    counts: np.ndarray | None = None

    def __init__(self, net, name: str, inputs: list[BaseEnsemble], shape):
        _check_inputs(net, name, inputs)
        self.inputs = list(inputs)
        super().__init__(net, name, shape)
        self.loss = 0.0
        self.phase = Phase.TRAIN
        self.state: dict[str, np.ndarray] = {}

    def reads_inputs(self, phase: Phase) -> bool:
        """Whether :meth:`forward` reads ``inputs`` in ``phase``. One that does not in
        ``Phase.TEST`` runs first in the test program, and the kernels that only it reads
        do not run there."""
        return True

    def forward(self, inputs: list[np.ndarray], value: np.ndarray, valid: int) -> None:
        """Fill ``value`` from ``inputs``; only the first ``valid`` batch items are real."""
        raise NotImplementedError

    def backward(self, inputs: list[np.ndarray], grad_inputs: list[np.ndarray],
                 value: np.ndarray, grad: np.ndarray, valid: int) -> None:
        """Accumulate into ``grad_inputs``."""


class DataEnsemble(BaseEnsemble):
    """An ensemble whose values a data source writes before each forward pass."""

    def __init__(self, net, name: str, shape, source):
        self.source = source
        super().__init__(net, name, shape)


def source_links(net, ens: BaseEnsemble) -> list[tuple[BaseEnsemble, bool]]:
    """``(source, recurrent)`` for every value ``ens`` reads, in a fixed order: its
    connections' sources, a normalization ensemble's inputs, an activation's source."""
    if isinstance(ens, NormalizationEnsemble):
        return [(i, False) for i in ens.inputs]
    if isinstance(ens, ActivationEnsemble):
        return [(ens.source, False)]
    return [(c.source, c.recurrent) for c in net.connections_into(ens)]


def sources(net, ens: BaseEnsemble) -> list[BaseEnsemble]:
    """The ensembles whose values ``ens`` reads (at this step or, recurrently, the one
    before), in :func:`source_links`' order."""
    return [s for s, _ in source_links(net, ens)]


def readers(net, ens: BaseEnsemble) -> list[BaseEnsemble]:
    """The ensembles of ``net`` that read ``ens``'s values, in net order."""
    return [e for e in net.ensembles if any(s is ens for s in sources(net, e))]
