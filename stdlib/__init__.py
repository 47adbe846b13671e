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
from latte.stdlib.recurrent import (
    EmbeddingLayer,
    EmbeddingNeuron,
    GRUCellNeuron,
    GRULayer,
    LSTMCellNeuron,
    LSTMHiddenNeuron,
    LSTMLayer,
    RNNCellNeuron,
    RNNLayer,
)
from latte.stdlib.transforms import Mirror, Normalize, RandomCrop, Transform

__all__ = ["AccuracyLayer", "AddLayer", "AddNeuron", "ArrayDataLayer", "BatchNormLayer", "ConcatLayer",
           "ConvolutionLayer", "DropoutEnsemble", "DropoutLayer", "DropoutNeuron", "ELULayer", "ELUNeuron",
           "EmbeddingLayer", "EmbeddingNeuron", "EuclideanLossLayer", "FullyConnectedLayer",
           "GlobalAveragePoolingLayer", "GRUCellNeuron", "GRULayer", "HDF5DataLayer", "LeakyReLULayer",
           "LeakyReLUNeuron", "LogSumExpNeuron", "LRNLayer", "LRNNeuron", "LSTMCellNeuron",
           "LSTMHiddenNeuron", "LSTMLayer", "MaxNeuron", "MaxPoolingLayer", "MeanNeuron", "MeanPoolingLayer",
           "MemoryDataLayer", "Mirror", "MulLayer", "MulNeuron", "Normalize", "PReLULayer", "PReLUNeuron",
           "RandomCrop", "ReLULayer", "ReLUNeuron", "RNNCellNeuron", "RNNLayer",
           "SigmoidCrossEntropyLossLayer", "SigmoidLayer", "SigmoidNeuron", "SoftmaxLayer",
           "SoftmaxLossLayer", "SoftmaxNeuron", "TanhLayer", "TanhNeuron", "Transform", "UnbiasedNeuron",
           "WeightedNeuron", "xavier"]
