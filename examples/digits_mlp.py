"""An MLP on scikit-learn's handwritten digits (1797 8x8 images, bundled with sklearn).

Run it with ``python examples/digits_mlp.py`` or ``latte run examples/digits_mlp.py``
(add ``--max-epoch N``, ``--seed S``, ``--threads N`` or ``--profile``).
"""

import numpy as np
from digits import digits_split

from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import AccuracyLayer, ArrayDataLayer, FullyConnectedLayer, ReLULayer, SoftmaxLossLayer


def prepare(images: np.ndarray) -> np.ndarray:
    return (images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)   # pixels in [0, 1]


train, test = digits_split(prepare)

net = Net(32, seed=0)
data, label = ArrayDataLayer(net, train, test=test, shuffle=True)
ip1 = FullyConnectedLayer("ip1", net, data, 64)
r1 = ReLULayer("relu1", net, ip1)
ip2 = FullyConnectedLayer("ip2", net, r1, 10)
loss = SoftmaxLossLayer("loss", net, ip2, label)
acc = AccuracyLayer("accuracy", net, ip2, label)

params = SolverParameters(lr_policy=LRPolicy.Inv(0.05, 0.0001, 0.75),
                          mom_policy=MomPolicy.Fixed(0.9), max_epoch=20, regu_coef=0.0005)
history = solve(SGD(params), net)
print(f"test accuracy: {history.test_accuracy[-1]:.4f} after {len(history.test_accuracy)} epochs")
