"""latte's standard library: layers written as neuron types plus mapping functions."""

from latte.stdlib.activations import ReLULayer, ReLUNeuron, SigmoidLayer, SigmoidNeuron, TanhLayer, TanhNeuron
from latte.stdlib.data import ArrayDataLayer, HDF5DataLayer, MemoryDataLayer
from latte.stdlib.fully_connected import FullyConnectedLayer, WeightedNeuron
from latte.stdlib.init import xavier
from latte.stdlib.losses import AccuracyLayer, SoftmaxLossLayer

__all__ = ["AccuracyLayer", "ArrayDataLayer", "FullyConnectedLayer", "HDF5DataLayer",
           "MemoryDataLayer", "ReLULayer", "ReLUNeuron", "SigmoidLayer", "SigmoidNeuron",
           "SoftmaxLossLayer", "TanhLayer", "TanhNeuron", "WeightedNeuron", "xavier"]
