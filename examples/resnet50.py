"""ResNet-50 (He et al.) on synthetic images.

ResNet-18's stem and head around 3, 4, 6 and 3 bottleneck blocks (1x1, 3x3, 1x1
convolutions with batch norm, residual adds with 1x1 projection shortcuts at each stage's
first block) (``latte.zoo.resnet50``).
Each class of the synthetic data is a random template plus noise (examples/synthetic.py),
so a net can learn it; the default two epochs of eight batches show the speed, and
``--max-epoch N`` trains longer.

Run it with ``latte run examples/resnet50.py`` (``--max-epoch N``, ``--threads N``,
``--opt-level L``, ``--profile``), print the compiler's plan with ``latte explain
examples/resnet50.py``, or train at ImageNet's size with ``python examples/resnet50.py --size 224``
(``--batch B``, ``--batches N``). The default input is 32x32.
"""

from synthetic import CLASSES, options, report, synthetic_split

from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import AccuracyLayer, ArrayDataLayer, SoftmaxLossLayer
from latte.zoo import resnet50

opts = options(__doc__, size=32)
train, test = synthetic_split(opts)

net = Net(opts.batch, seed=0)
data, label = ArrayDataLayer(net, train, test=test, shuffle=True)
logits = resnet50(net, data, CLASSES)
loss = SoftmaxLossLayer("loss", net, logits, label)
acc = AccuracyLayer("accuracy", net, logits, label)

params = SolverParameters(lr_policy=LRPolicy.Fixed(0.01), mom_policy=MomPolicy.Fixed(0.9),
                          max_epoch=2, regu_coef=0.0005)
history = solve(SGD(params), net)
print(report(history))
