"""The two pieces an ONNX graph needs that the stdlib has no layer for: an element-wise
operation with a constant (``x + c``, ``x * c``, broadcast as ONNX does) and a reshape
(the same values in another sample shape). Both are neurons and mappings like the stdlib's.
"""

from __future__ import annotations

import numpy as np

from latte.lang import Ensemble, Neuron, Param, add_connections
from latte.stdlib.joins import concat_neuron


class ShiftNeuron(Neuron):
    """``x + shift`` (backward derived by the compiler)."""

    shift: Param

    def forward(self):
        self.value = self.inputs[0][0] + self.shift


class ScaleNeuron(Neuron):
    """``x * scale`` (backward derived by the compiler)."""

    scale: Param

    def forward(self):
        self.value = self.inputs[0][0] * self.scale


def ConstantLayer(name: str, net, input_ens, constant: np.ndarray, field: str) -> Ensemble:
    """``input + constant`` (``field="shift"``) or ``input * constant`` (``"scale"``), the
    constant a learnable parameter ``"{name}.{field}"`` broadcast over ``input_ens``'s shape
    (numpy's rule; its size-1 dimensions are shared, not stored)."""
    shape = input_ens.shape
    full = constant.reshape((1,) * (len(shape) - constant.ndim) + constant.shape)
    kept = tuple(d for d, n in enumerate(full.shape) if n != 1)
    values = np.ascontiguousarray(full.reshape([full.shape[d] for d in kept] or [1]), np.float32)
    index_map = (lambda *i: tuple(i[d] for d in kept)) if kept else (lambda *i: 0)
    neuron = ShiftNeuron if field == "shift" else ScaleNeuron
    ens = Ensemble(net, name, neuron, shape, **{field: (values, index_map)})
    add_connections(net, input_ens, ens, lambda *index: index)
    return ens


def ReshapeLayer(name: str, net, input_ens, shape: tuple[int, ...]) -> Ensemble:
    """A copy of ``input_ens`` in the sample shape ``shape`` (the same number of values, in
    row-major order). Adding or dropping size-1 dimensions maps one index to one index;
    any other reshape goes through the flat index."""
    src, shape = input_ens.shape, tuple(int(d) for d in shape)
    if [d for d in src if d != 1] == [d for d in shape if d != 1]:
        pos = [d for d, n in enumerate(shape) if n != 1]
        where = iter(pos)
        picks = [next(where) if n != 1 else None for n in src]

        def mapping(*i):
            return tuple(0 if p is None else i[p] for p in picks)
    else:
        out_strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
        src_strides = [int(np.prod(src[d + 1:], dtype=np.int64)) for d in range(len(src))]

        def mapping(*i):
            flat = sum(k * s for k, s in zip(i, out_strides))
            return tuple(flat // s % n for s, n in zip(src_strides, src))
    out = Ensemble(net, name, concat_neuron(1), shape)
    add_connections(net, input_ens, out, mapping)
    return out
