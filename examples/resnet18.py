"""ResNet-18 (He et al.) on synthetic images.

A 7x7 stem, four stages of two basic blocks (convolutions without bias, batch norm,
residual adds, 1x1 projection shortcuts where the shape changes), global average pooling
and FC (``latte.zoo.resnet18``).
Each class of the synthetic data is a random template plus noise (examples/synthetic.py),
so a net can learn it; the default two epochs of eight batches show the speed, and
``--max-epoch N`` trains longer.

Run it with ``latte run examples/resnet18.py`` (``--max-epoch N``, ``--threads N``,
``--opt-level L``, ``--profile``), print the compiler's plan with ``latte explain
examples/resnet18.py``, or train at ImageNet's size with ``python examples/resnet18.py --size 224``
(``--batch B``, ``--batches N``). The default input is 32x32.
"""

from synthetic import train

from latte.zoo import resnet18

train(__doc__, resnet18, size=32, lr=0.01)
