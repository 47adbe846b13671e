"""LeNet on scikit-learn's handwritten digits, upsampled to MNIST's 28x28.

The 8x8 digits (1797 images, bundled with scikit-learn) are scaled up 3x by repeating
pixels (24x24) and padded by 2 on each side, like MNIST's centred 28x28 digits; pixels are
scaled to [-1, 1]. The net is
Caffe's LeNet: conv 20 5x5, max-pool 2, conv 50 5x5, max-pool 2, FC 500, ReLU, FC 10.

Run it with ``python examples/lenet.py`` or ``latte run examples/lenet.py``
(add ``--max-epoch N``, ``--seed S``, ``--threads N`` or ``--profile``).
"""

import numpy as np
from digits import digits_split

from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import (
    AccuracyLayer,
    ArrayDataLayer,
    ConvolutionLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    ReLULayer,
    SoftmaxLossLayer,
)


def prepare(images: np.ndarray) -> np.ndarray:
    images = (images / 8.0 - 1.0).astype(np.float32)                  # pixels in [-1, 1]
    images = images.repeat(3, axis=1).repeat(3, axis=2)               # 24x24, nearest
    X = np.pad(images, ((0, 0), (2, 2), (2, 2)), constant_values=-1.0)  # 28x28, background border
    return X.reshape(-1, 1, 28, 28)


train, test = digits_split(prepare)

net = Net(64, seed=0)
data, label = ArrayDataLayer(net, train, test=test, shuffle=True)
conv1 = ConvolutionLayer("conv1", net, data, 20, 5)                   # 20x24x24
pool1 = MaxPoolingLayer("pool1", net, conv1, 2)                       # 20x12x12
conv2 = ConvolutionLayer("conv2", net, pool1, 50, 5)                  # 50x8x8
pool2 = MaxPoolingLayer("pool2", net, conv2, 2)                       # 50x4x4
ip1 = FullyConnectedLayer("ip1", net, pool2, 500)
relu1 = ReLULayer("relu1", net, ip1)
ip2 = FullyConnectedLayer("ip2", net, relu1, 10)
loss = SoftmaxLossLayer("loss", net, ip2, label)
acc = AccuracyLayer("accuracy", net, ip2, label)

params = SolverParameters(lr_policy=LRPolicy.Inv(0.02, 0.001, 0.75),
                          mom_policy=MomPolicy.Fixed(0.9), max_epoch=20, regu_coef=0.0005)
history = solve(SGD(params), net)
print(f"test accuracy: {history.test_accuracy[-1]:.4f} after {len(history.test_accuracy)} epochs")
