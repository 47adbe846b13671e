"""The Latte paper's microbenchmark (section 6, figure 13): VGG's first three layers.

conv 3->64 3x3 pad 1, ReLU and 2x2 max pooling on 224x224 images, the group of layers the
compiler tiles and fuses. A small classifier head (FC 10 + softmax loss) gives training a
loss; the data are random images with random labels, so only the speed means anything.

Run it with ``python examples/vgg_micro.py`` or ``latte run examples/vgg_micro.py --profile``
(``--opt-level L`` compares the optimization levels, ``--threads N`` the thread counts).
"""

import numpy as np

from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import (
    ArrayDataLayer,
    ConvolutionLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    ReLULayer,
    SoftmaxLossLayer,
)

BATCH, ITERATIONS = 8, 4
rng = np.random.default_rng(0)
X = rng.standard_normal((BATCH * ITERATIONS, 3, 224, 224), dtype=np.float32)
y = rng.integers(0, 10, BATCH * ITERATIONS)

net = Net(BATCH, seed=0)
data, label = ArrayDataLayer(net, (X, y), shuffle=False)
conv1 = ConvolutionLayer("conv1_1", net, data, 64, 3, pad=1)         # 64x224x224
relu1 = ReLULayer("relu1_1", net, conv1)
pool1 = MaxPoolingLayer("pool1", net, relu1, 2)                     # 64x112x112
fc = FullyConnectedLayer("fc", net, pool1, 10)
loss = SoftmaxLossLayer("loss", net, fc, label)

params = SolverParameters(lr_policy=LRPolicy.Fixed(1e-6), mom_policy=MomPolicy.Fixed(0.9),
                          max_epoch=1)
history = solve(SGD(params), net)
seconds = sum(history.epoch_seconds) / len(history.train_loss)
losses = ", ".join(f"{v:.3f}" for v in history.train_loss)
print(f"{seconds * 1e3:.1f} ms per training iteration (batch {BATCH}, "
      f"{BATCH / seconds:.1f} images/s); losses {losses}")
