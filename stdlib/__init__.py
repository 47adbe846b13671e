"""latte's standard library: layers written as neuron types plus mapping functions."""

from latte.stdlib.activations import (
    ELULayer,
    ELUNeuron,
    LeakyReLULayer,
    LeakyReLUNeuron,
    PReLULayer,
    PReLUNeuron,
    ReLULayer,
    ReLUNeuron,
    SigmoidLayer,
    SigmoidNeuron,
    TanhLayer,
    TanhNeuron,
)
from latte.stdlib.batchnorm import BatchNormLayer
from latte.stdlib.convolution import ConvolutionLayer, UnbiasedNeuron
from latte.stdlib.data import ArrayDataLayer, HDF5DataLayer, MemoryDataLayer
from latte.stdlib.dropout import DropoutEnsemble, DropoutLayer, DropoutNeuron
from latte.stdlib.fully_connected import FullyConnectedLayer, WeightedNeuron
from latte.stdlib.init import xavier
from latte.stdlib.joins import AddLayer, AddNeuron, ConcatLayer, MulLayer, MulNeuron
from latte.stdlib.losses import (
    AccuracyLayer,
    EuclideanLossLayer,
    SigmoidCrossEntropyLossLayer,
    SoftmaxLossLayer,
)
from latte.stdlib.normalization import LogSumExpNeuron, LRNLayer, LRNNeuron, SoftmaxLayer, SoftmaxNeuron
from latte.stdlib.pooling import (
    GlobalAveragePoolingLayer,
    MaxNeuron,
    MaxPoolingLayer,
    MeanNeuron,
    MeanPoolingLayer,
)
from latte.stdlib.transforms import Mirror, Normalize, RandomCrop, Transform

__all__ = ["AccuracyLayer", "ArrayDataLayer", "ConvolutionLayer", "DropoutEnsemble", "DropoutLayer",
           "DropoutNeuron", "FullyConnectedLayer", "HDF5DataLayer", "MaxNeuron", "MaxPoolingLayer",
           "MeanNeuron", "MeanPoolingLayer", "MemoryDataLayer", "ReLULayer", "ReLUNeuron",
           "SigmoidLayer", "SigmoidNeuron", "SoftmaxLossLayer", "TanhLayer", "TanhNeuron",
           "WeightedNeuron", "xavier"]
__all__ += ["AddLayer", "AddNeuron", "ConcatLayer", "ELULayer", "ELUNeuron", "GlobalAveragePoolingLayer",
            "LeakyReLULayer", "LeakyReLUNeuron", "LogSumExpNeuron", "LRNLayer", "LRNNeuron", "MulLayer",
            "MulNeuron", "PReLULayer", "PReLUNeuron", "SoftmaxLayer", "SoftmaxNeuron"]
__all__ += ["BatchNormLayer"]
__all__ += ["EuclideanLossLayer", "Mirror", "Normalize", "RandomCrop", "SigmoidCrossEntropyLossLayer",
            "Transform"]
__all__ += ["UnbiasedNeuron"]
