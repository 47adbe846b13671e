"""Recurrent layers (paper figure 6): RNN, LSTM and GRU built from ensembles and recurrent
connections, and the embedding that feeds them token ids.

Each recurrent layer is an input projection (``G*n`` weighted neurons reading ``x``; it
reads no earlier step, so the compiler runs it once over all ``T x batch`` items: one
GEMM), a recurrent projection (``G*n`` weighted neurons reading ``h`` at ``t - 1``) and
element-wise ensembles for the state, all in PyTorch's parameter layouts and gate orders
(published as ``"{name}.weight_ih"``, ``"{name}.weight_hh"``, ``"{name}.bias_ih"``,
``"{name}.bias_hh"``), initialized uniform in ``[-1/sqrt(n), 1/sqrt(n)]`` as PyTorch's.
"""

from __future__ import annotations

import math

import numpy as np

from latte.errors import DataError, ShapeError
from latte.lang import DataEnsemble, Ensemble, Neuron, Param, add_connections
from latte.random import generator
from latte.stdlib.fully_connected import WeightedNeuron


class RNNCellNeuron(Neuron):
    """``h = tanh(ih + hh)``: inputs [0] the input projection, [1] the recurrent one."""

    def forward(self):
        self.value = math.tanh(self.inputs[0][0] + self.inputs[1][0])


class LSTMCellNeuron(Neuron):
    """``c = sigmoid(f) * c' + sigmoid(i) * tanh(g)``: inputs [0] and [1] the input and the
    recurrent projections' ``i, f, g`` pre-activations, [2] the cell ``c'`` at ``t - 1``."""

    def forward(self):
        i = 1.0 / (1.0 + math.exp(-(self.inputs[0][0] + self.inputs[1][0])))
        f = 1.0 / (1.0 + math.exp(-(self.inputs[0][1] + self.inputs[1][1])))
        g = math.tanh(self.inputs[0][2] + self.inputs[1][2])
        self.value = f * self.inputs[2][0] + i * g


class LSTMHiddenNeuron(Neuron):
    """``h = sigmoid(o) * tanh(c)``: inputs [0] and [1] the projections' ``o``, [2] ``c``."""

    def forward(self):
        o = 1.0 / (1.0 + math.exp(-(self.inputs[0][0] + self.inputs[1][0])))
        self.value = o * math.tanh(self.inputs[2][0])


class GRUCellNeuron(Neuron):
    """PyTorch's GRU: ``r, z = sigmoid(ih + hh)``, ``n = tanh(ih_n + r * hh_n)``,
    ``h = (1 - z) * n + z * h'``. Inputs [0] and [1] the input and the recurrent
    projections' ``r, z, n``, [2] ``h'`` at ``t - 1``."""

    def forward(self):
        r = 1.0 / (1.0 + math.exp(-(self.inputs[0][0] + self.inputs[1][0])))
        z = 1.0 / (1.0 + math.exp(-(self.inputs[0][1] + self.inputs[1][1])))
        n = math.tanh(self.inputs[0][2] + r * self.inputs[1][2])
        self.value = (1.0 - z) * n + z * self.inputs[2][0]


BLOCK = 16   # the lookup finds an id's block of rows first, then the row in it


class EmbeddingNeuron(Neuron):
    """Output ``j`` of a table lookup: ``weight[id]`` for the id in ``inputs[0][0]``, where
    ``weight`` is this output's column of the table (``vocab`` entries).

    The neuron language has no index computed from a value, so the entry is found by
    comparisons: first the block of :data:`BLOCK` entries holding the id, then the entry in
    it (the entries past the last whole block one by one); compiled, the comparisons run
    once per item and every output then loads its entry. No address depends on the data;
    an id that is no row number selects nothing. Backward is derived.
    """

    weight: Param

    def forward(self):
        x = self.inputs[0][0]
        for a in range(len(self.weight) // BLOCK):
            if x >= a * BLOCK and x < a * BLOCK + BLOCK:
                for b in range(BLOCK):
                    if x == a * BLOCK + b:
                        self.value += self.weight[a * BLOCK + b]
        for v in range(len(self.weight) // BLOCK * BLOCK, len(self.weight)):
            if x == v:
                self.value += self.weight[v]


class EmbeddingEnsemble(Ensemble):
    """The lookup's ensemble: the table is stored a column per output (``(dim, vocab)``)
    and published as PyTorch's ``(vocab, dim)``. Before each forward pass it checks that
    the ids a data ensemble holds are row numbers of the table, and names the layer when
    one is not."""

    def __init__(self, net, name: str, input_ens, vocab_size: int, dim: int):
        self.ids, self.vocab_size = input_ens, vocab_size
        table = generator().standard_normal((vocab_size, dim)).astype(np.float32)
        super().__init__(net, name, EmbeddingNeuron, (dim,), weight=np.ascontiguousarray(table.T))
        self.public_axes["weight"] = (1, 0)

    def before_forward(self, phase, fields) -> None:
        if not isinstance(self.ids, DataEnsemble):
            return
        ids = self.net.value(self.ids)
        ids = ids[:, :self.net.valid] if self.net.time_steps > 1 else ids[:self.net.valid]
        bad = (ids < 0) | (ids >= self.vocab_size) | (ids != np.floor(ids))
        if bad.any():
            raise DataError(f"embedding {self.name!r}: id {float(ids[bad][0])!r} in "
                            f"{self.ids.name!r} is not an integer in [0, {self.vocab_size})")


def EmbeddingLayer(name: str, net, input_ens, vocab_size: int, dim: int) -> Ensemble:
    """``dim`` outputs ``weight[id]`` for the integer id (a float) in ``input_ens`` (shape
    ``(1,)``); parameter ``"{name}.weight"`` ``(vocab_size, dim)``, normal(0, 1) as
    PyTorch's ``nn.Embedding``. Ids outside ``[0, vocab_size)`` in a data ensemble are a
    :class:`~latte.errors.DataError` naming the layer; ids computed by another ensemble
    cannot be checked before the pass, and one outside the table gives zeros."""
    if input_ens.shape != (1,):
        raise ShapeError(f"embedding {name!r}: its input {input_ens.name!r} must hold one id "
                         f"per item (shape (1,)), not {input_ens.shape}")
    emb = EmbeddingEnsemble(net, name, input_ens, int(vocab_size), int(dim))
    add_connections(net, input_ens, emb, lambda j: (0,))
    return emb


def _uniform(shape, n: int) -> np.ndarray:
    bound = 1.0 / math.sqrt(n)
    return generator().uniform(-bound, bound, size=shape).astype(np.float32)


def _projection(net, name: str, layer: str, suffix: str, n_in: int, size: int, n: int) -> Ensemble:
    """``size`` weighted neurons over ``n_in`` inputs, their parameters published as
    ``"{layer}.weight_{suffix}"`` ``(size, n_in)`` and ``"{layer}.bias_{suffix}"``."""
    proj = Ensemble(net, name, WeightedNeuron, (size,),
                    weights=(_uniform((size, n_in), n), lambda o: o),
                    bias=(_uniform((size,), n), lambda o: o))
    proj.public_names.update(weights=f"{layer}.weight_{suffix}", bias=f"{layer}.bias_{suffix}")
    return proj


def _all(ens):
    """A mapping that reads every neuron of ``ens``."""
    return lambda o: tuple(range(d) for d in ens.shape)


def _recurrent(name: str, net, input_ens, n: int, gates: int, cells: list[tuple[str, type]]):
    """The projections ``"{name}.ih"`` (reads ``input_ens``) and ``"{name}.hh"`` (reads the
    last of ``cells`` at ``t - 1``) of ``gates * n`` neurons, then the element-wise ``cells``
    (``"{name}.<suffix>"``, ``n`` neurons each); returns the cell ensembles."""
    ih = _projection(net, f"{name}.ih", name, "ih", input_ens.size, gates * n, n)
    add_connections(net, input_ens, ih, _all(input_ens))
    hh = _projection(net, f"{name}.hh", name, "hh", n, gates * n, n)
    ens = [Ensemble(net, f"{name}.{suffix}" if suffix else name, neuron, (n,))
           for suffix, neuron in cells]
    add_connections(net, ens[-1], hh, _all(ens[-1]), recurrent=True)
    return ih, hh, ens


def _gates(n: int, first: int, count: int):
    """Neuron ``j`` reads gates ``first..first+count-1`` of unit ``j`` (gate ``k`` of unit
    ``j`` is neuron ``k * n + j`` of a projection)."""
    return lambda j: (range(first * n + j, (first + count) * n, n),)


def RNNLayer(name: str, net, input_ens, n_outputs: int) -> Ensemble:
    """Elman RNN with tanh, PyTorch's ``nn.RNN``: ``h = tanh(W_ih x + b_ih + W_hh h' + b_hh)``.
    Returns the ensemble ``name`` of hidden outputs ``h``."""
    n = int(n_outputs)
    ih, hh, (h,) = _recurrent(name, net, input_ens, n, 1, [("", RNNCellNeuron)])
    add_connections(net, ih, h, lambda j: (j,))
    add_connections(net, hh, h, lambda j: (j,))
    return h


def LSTMLayer(name: str, net, input_ens, n_outputs: int) -> Ensemble:
    """PyTorch's ``nn.LSTM`` (gates i, f, g, o): the cell ``"{name}.c"`` and the hidden
    outputs ``h``, the ensemble ``name`` returned."""
    n = int(n_outputs)
    ih, hh, (c, h) = _recurrent(name, net, input_ens, n, 4,
                                [("c", LSTMCellNeuron), ("", LSTMHiddenNeuron)])
    add_connections(net, ih, c, _gates(n, 0, 3))
    add_connections(net, hh, c, _gates(n, 0, 3))
    add_connections(net, c, c, lambda j: (j,), recurrent=True)
    add_connections(net, ih, h, lambda j: (3 * n + j,))
    add_connections(net, hh, h, lambda j: (3 * n + j,))
    add_connections(net, c, h, lambda j: (j,))
    return h


def GRULayer(name: str, net, input_ens, n_outputs: int) -> Ensemble:
    """PyTorch's ``nn.GRU`` (gates r, z, n); returns the ensemble ``name`` of outputs ``h``."""
    n = int(n_outputs)
    ih, hh, (h,) = _recurrent(name, net, input_ens, n, 3, [("", GRUCellNeuron)])
    add_connections(net, ih, h, _gates(n, 0, 3))
    add_connections(net, hh, h, _gates(n, 0, 3))
    add_connections(net, h, h, lambda j: (j,), recurrent=True)
    return h
