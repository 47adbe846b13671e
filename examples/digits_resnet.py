"""A small ResNet on scikit-learn's handwritten digits (1797 8x8 images, bundled with sklearn).

``latte.zoo.digits_resnet``: a 3x3 stem with batch norm, two basic blocks of 32 channels at
8x8, two of 64 at 4x4 (the first strided, with a 1x1 projection shortcut), global average
pooling and FC; convolutions without bias before every batch norm, residual adds. Pixels
are standardized with the training set's mean and deviation.

Run it with ``python examples/digits_resnet.py`` or ``latte run examples/digits_resnet.py``
(add ``--max-epoch N``, ``--seed S``, ``--threads N`` or ``--profile``).
"""

import numpy as np
from digits import digits_split

from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import AccuracyLayer, ArrayDataLayer, SoftmaxLossLayer
from latte.zoo import digits_resnet

MEAN, STD = 4.88, 6.02   # of the digits' pixels (0..16)


def prepare(images: np.ndarray) -> np.ndarray:
    return ((images - MEAN) / STD).astype(np.float32).reshape(-1, 1, 8, 8)


train, test = digits_split(prepare)

net = Net(32, seed=0)
data, label = ArrayDataLayer(net, train, test=test, shuffle=True)
logits = digits_resnet(net, data, 10)
loss = SoftmaxLossLayer("loss", net, logits, label)
acc = AccuracyLayer("accuracy", net, logits, label)

params = SolverParameters(lr_policy=LRPolicy.Step(0.05, 0.1, 600),
                          mom_policy=MomPolicy.Fixed(0.9), max_epoch=15, regu_coef=0.0005)
history = solve(SGD(params), net)
print(f"test accuracy: {history.test_accuracy[-1]:.4f} after {len(history.test_accuracy)} epochs")
