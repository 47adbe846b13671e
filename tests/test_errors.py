"""User mistakes get a latte error of the right type whose message says where the mistake is."""

from __future__ import annotations

import inspect
import os

import h5py
import numpy as np
import pytest

from latte import Ensemble, Net, Neuron, Param, add_connections
from latte.errors import CompileError, DataError, MappingError, NeuronSyntaxError, ShapeError, TrainingError
from latte.solvers import SGD, LRPolicy, SolverParameters, solve
from latte.stdlib import (
    ArrayDataLayer,
    FullyConnectedLayer,
    HDF5DataLayer,
    MemoryDataLayer,
    SoftmaxLossLayer,
)


class PassNeuron(Neuron):
    def forward(self):
        self.value = self.inputs[0][0]


def test_mapping_out_of_range_without_padding():
    net = Net(2)
    src = MemoryDataLayer(net, "src", (5,))
    sink = Ensemble(net, "shifted", PassNeuron, (5,))
    add_connections(net, src, sink, lambda i: (i + 1,))  # neuron 4 reads src[5]
    with pytest.raises(MappingError) as err:
        net.init()
    msg = str(err.value)
    assert "'shifted'" in msg and "'src'" in msg
    assert "(4,)" in msg and "(5,)" in msg  # the neuron index and what it reads
    assert "padding" in msg


def test_mapping_returns_too_few_entries():
    net = Net(2)
    src = MemoryDataLayer(net, "image", (2, 3))
    sink = Ensemble(net, "flat", PassNeuron, (6,))
    add_connections(net, src, sink, lambda i: (i,))
    with pytest.raises(ShapeError) as err:
        net.init()
    msg = str(err.value)
    assert "'image'" in msg and "'flat'" in msg
    assert "returns 1 entries" in msg and "2 dimension" in msg


class WeightNeuron(Neuron):
    weights: Param

    def forward(self):
        self.value = self.weights[0]


def test_field_with_wrong_leading_shape():
    net = Net(2)
    with pytest.raises(ShapeError) as err:
        Ensemble(net, "layer", WeightNeuron, (4,), weights=np.zeros((3, 2), np.float32))
    msg = str(err.value)
    assert "'layer'" in msg and "'weights'" in msg and "(3, 2)" in msg and "(4,)" in msg


class WhileNeuron(Neuron):
    def forward(self):
        while self.value < 1.0:  # BAD
            self.value += 1.0


class PrintNeuron(Neuron):
    def forward(self):
        self.value = self.inputs[0][0]
        print(self.value)  # BAD


class NestedAttributeNeuron(Neuron):
    def forward(self):
        self.value = self.foo.bar  # BAD


class UnknownCallNeuron(Neuron):
    def forward(self):
        self.value = np.exp(self.inputs[0][0])  # BAD


def _marked_line(neuron_type: type) -> int:
    lines, first = inspect.getsourcelines(neuron_type.forward)
    (offset,) = [i for i, line in enumerate(lines) if line.rstrip().endswith("# BAD")]
    return first + offset


@pytest.mark.parametrize("neuron_type,what", [
    (WhileNeuron, "While statements"), (PrintNeuron, "print(self.value)"),
    (NestedAttributeNeuron, "attribute access"), (UnknownCallNeuron, "can be called")])
def test_unsupported_syntax_names_file_and_line(neuron_type, what):
    net = Net(2)
    src = MemoryDataLayer(net, "src", (3,))
    sink = Ensemble(net, "bad", neuron_type, (3,))
    add_connections(net, src, sink, lambda i: (i,))
    with pytest.raises(NeuronSyntaxError) as err:
        net.init()
    line = _marked_line(neuron_type)
    assert err.value.filename == __file__
    assert err.value.lineno == line
    assert f"{os.path.basename(__file__)}:{line}:" in str(err.value)
    assert what in str(err.value)


def test_missing_hdf5_file():
    net = Net(2)
    with pytest.raises(DataError) as err:
        HDF5DataLayer(net, "/nonexistent.h5")
    assert "/nonexistent.h5" in str(err.value)


def test_nan_loss_during_training_names_the_iteration():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 3)).astype(np.float32)
    y = rng.integers(0, 2, 12)
    x[9] = 3e38  # finite, in the third batch of four: its logits overflow to inf
    net = Net(4, seed=0)
    data, label = ArrayDataLayer(net, (x, y), shuffle=False)
    fc = FullyConnectedLayer("fc", net, data, 2)
    SoftmaxLossLayer("loss", net, fc, label)
    net.init()
    net.params[0].value[...] = 1.0
    params = SolverParameters(lr_policy=LRPolicy.Fixed(0.01), max_epoch=2)
    with pytest.raises(TrainingError) as err:
        solve(SGD(params), net)
    assert "iteration 2" in str(err.value) and "nan" in str(err.value).lower()


def test_diverging_training_raises():
    rng = np.random.default_rng(0)
    x = (100 * rng.standard_normal((16, 4))).astype(np.float32)
    y = rng.integers(0, 3, 16)
    net = Net(8, seed=0)
    data, label = ArrayDataLayer(net, (x, y))
    fc = FullyConnectedLayer("fc", net, data, 3)
    SoftmaxLossLayer("loss", net, fc, label)
    params = SolverParameters(lr_policy=LRPolicy.Fixed(1e38), max_epoch=3)
    # the first update overflows: the parameter check names it before a loss shows it
    with pytest.raises(TrainingError, match="parameter 'fc.weights' became non-finite .* iteration 0 "):
        solve(SGD(params), net)


def test_array_data_with_mismatched_lengths():
    net = Net(2)
    with pytest.raises(ShapeError) as err:
        ArrayDataLayer(net, (np.zeros((10, 3), np.float32), np.zeros(9)))
    assert "10" in str(err.value) and "9" in str(err.value)


def test_label_out_of_range():
    net = Net(2)
    x = MemoryDataLayer(net, "x", (3,))
    label = MemoryDataLayer(net, "label", (1,))
    SoftmaxLossLayer("loss", net, x, label)
    net.value(label)[:, 0] = [1, 3]
    with pytest.raises(ShapeError) as err:
        net.forward()
    assert "'loss'" in str(err.value) and "batch item 1" in str(err.value)


def test_hdf5_file_without_labels(tmp_path):
    path = tmp_path / "nolabel.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.zeros((4, 3), np.float32)
    with pytest.raises(DataError) as err:
        HDF5DataLayer(Net(2), path)
    assert str(path) in str(err.value) and "/label" in str(err.value)


def test_test_set_with_other_sample_shape():
    x, y = np.zeros((4, 3), np.float32), np.zeros(4)
    with pytest.raises(ShapeError, match=r"\(2,\).*\(3,\)"):
        ArrayDataLayer(Net(2), (x, y), test=(np.zeros((4, 2), np.float32), y))


def test_missing_checkpoint(tmp_path):
    net = Net(2)
    x = MemoryDataLayer(net, "x", (3,))
    FullyConnectedLayer("fc", net, x, 2)
    path = tmp_path / "missing.npz"
    with pytest.raises(DataError, match="missing.npz"):
        net.load(path)


def test_out_of_range_index_in_neuron_body():
    class Shifted(Neuron):
        w: Param

        def forward(self):
            for i in range(len(self.inputs[0])):
                self.value += self.w[i + 1] * self.inputs[0][i]

    net = Net(2)
    x = MemoryDataLayer(net, "x", (4,))
    ens = Ensemble(net, "shifted", Shifted, (3,), w=np.ones((3, 4), np.float32))
    add_connections(net, x, ens, lambda o: (range(4),))
    line = Shifted.forward.__code__.co_firstlineno + 2
    with pytest.raises(CompileError, match=rf"test_errors.py:{line}: ensemble 'shifted': index "
                                           r"i \+ 1 of self.w ranges over 1..4, outside its length 4"):
        net.init()
