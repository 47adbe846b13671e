"""Layers that join several ensembles: element-wise sum and product, and concatenation.

A concat of ``n`` inputs is one ensemble with one connection per input: connection ``k``
reads input ``k`` one-to-one, shifted by its offset along the axis, and zero padding outside
its slice, so each output neuron is the sum of ``n`` reads of which one is real. Compiled as
written, that costs ``n`` guarded loads per output in forward and ``n`` guarded adds in
backward, plus the copy itself. From opt level 1 the compiler (``latte.compiler.joins``)
recognizes such a join on the program (the mapping analysis and this neuron's IR) and, where
it is safe, makes it cost nothing: along the first axis, each input whose only reader is the
concat (directly or through an in-place activation) computes straight into its slice of the
concat's buffers, and the concat runs no code. ``latte explain`` says which joins are
zero-copy and why the others are not.
"""

from __future__ import annotations

import functools
import linecache

from latte.errors import ShapeError
from latte.lang import Ensemble, Neuron, add_connections


class AddNeuron(Neuron):
    def forward(self):
        self.value = self.inputs[0][0] + self.inputs[1][0]

    def backward(self):
        self.grad_inputs[0][0] += self.grad
        self.grad_inputs[1][0] += self.grad


class MulNeuron(Neuron):
    def forward(self):
        self.value = self.inputs[0][0] * self.inputs[1][0]

    def backward(self):
        self.grad_inputs[0][0] += self.grad * self.inputs[1][0]
        self.grad_inputs[1][0] += self.grad * self.inputs[0][0]


@functools.lru_cache(maxsize=None)
def concat_neuron(n: int) -> type:
    """The neuron summing its ``n`` one-element inputs (all but one read padding).

    Neuron bodies are read from source, so the class is written as text and its lines are
    registered with ``linecache`` under a pseudo file name, where ``inspect`` finds them."""
    forward = " + ".join(f"self.inputs[{k}][0]" for k in range(n))
    backward = "".join(f"        self.grad_inputs[{k}][0] += self.grad\n" for k in range(n))
    name = f"ConcatNeuron{n}"
    source = (f"class {name}(Neuron):\n"
              f"    def forward(self):\n"
              f"        self.value = {forward}\n\n"
              f"    def backward(self):\n{backward}")
    filename = f"<latte.stdlib.joins.{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": __name__, "Neuron": Neuron}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own text
    return namespace[name]


def _same_shape(name: str, a, b) -> None:
    if a.shape != b.shape:
        raise ShapeError(f"layer {name!r}: {a.name!r} has shape {a.shape} and {b.name!r} has "
                         f"shape {b.shape}; element-wise layers need equal shapes")


def _elementwise(name: str, net, a, b, neuron: type) -> Ensemble:
    _same_shape(name, a, b)
    ens = Ensemble(net, name, neuron, a.shape)
    add_connections(net, a, ens, lambda *index: index)
    add_connections(net, b, ens, lambda *index: index)
    return ens


def AddLayer(name: str, net, a, b) -> Ensemble:
    """``a + b`` element-wise (equal shapes), e.g. a residual connection."""
    return _elementwise(name, net, a, b, AddNeuron)


def MulLayer(name: str, net, a, b) -> Ensemble:
    """``a * b`` element-wise (equal shapes), e.g. a gate."""
    return _elementwise(name, net, a, b, MulNeuron)


def ConcatLayer(name: str, net, inputs, axis: int = 0) -> Ensemble:
    """The ensembles ``inputs`` joined along sample axis ``axis`` (negative counts from the
    end); all other dimensions must agree."""
    inputs = list(inputs)
    if not inputs:
        raise ShapeError(f"layer {name!r}: concat needs at least one input")
    rank = len(inputs[0].shape)
    if not -rank <= axis < rank:
        raise ShapeError(f"layer {name!r}: axis {axis} is out of range for inputs of rank {rank}")
    axis %= rank
    first = inputs[0]
    for ens in inputs[1:]:
        if len(ens.shape) != rank or any(d != e for j, (d, e) in enumerate(zip(first.shape, ens.shape))
                                         if j != axis):
            raise ShapeError(f"layer {name!r}: {first.name!r} has shape {first.shape} and "
                             f"{ens.name!r} has shape {ens.shape}; they may differ only along "
                             f"axis {axis}")
    shape = list(first.shape)
    shape[axis] = sum(e.shape[axis] for e in inputs)
    concat = Ensemble(net, name, concat_neuron(len(inputs)), tuple(shape))
    offset = 0
    for ens in inputs:
        add_connections(net, ens, concat, _shifted(axis, offset),
                        padding=0.0 if len(inputs) > 1 else None)
        offset += ens.shape[axis]
    return concat


def _shifted(axis: int, offset: int):
    """The one-to-one mapping moved back by ``offset`` along ``axis``."""
    return lambda *index: tuple(i - offset if j == axis else i for j, i in enumerate(index))
