"""GoogLeNet (Szegedy et al.) on synthetic images.

A stem with local response normalization, nine inception blocks (1x1, 3x3 and 5x5
convolutions and a pooling branch joined by a concat) between max poolings, global average
pooling, dropout and FC, without the auxiliary classifiers (``latte.zoo.inception``).
Each class of the synthetic data is a random template plus noise (examples/synthetic.py),
so a net can learn it; the default two epochs of eight batches show the speed, and
``--max-epoch N`` trains longer.

Run it with ``latte run examples/inception.py`` (``--max-epoch N``, ``--threads N``,
``--opt-level L``, ``--profile``), print the compiler's plan with ``latte explain
examples/inception.py``, or train at ImageNet's size with ``python examples/inception.py --size 224``
(``--batch B``, ``--batches N``). The default input is 32x32.
"""

from synthetic import CLASSES, options, report, synthetic_split

from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import AccuracyLayer, ArrayDataLayer, SoftmaxLossLayer
from latte.zoo import inception

opts = options(__doc__, size=32)
train, test = synthetic_split(opts)

net = Net(opts.batch, seed=0)
data, label = ArrayDataLayer(net, train, test=test, shuffle=True)
logits = inception(net, data, CLASSES)
loss = SoftmaxLossLayer("loss", net, logits, label)
acc = AccuracyLayer("accuracy", net, logits, label)

params = SolverParameters(lr_policy=LRPolicy.Fixed(0.01), mom_policy=MomPolicy.Fixed(0.9),
                          max_epoch=2, regu_coef=0.0005)
history = solve(SGD(params), net)
print(report(history))
