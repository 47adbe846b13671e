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

from synthetic import train

from latte.zoo import resnet50

train(__doc__, resnet50, size=32, lr=0.01)
