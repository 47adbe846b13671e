"""VGG-16 (Simonyan and Zisserman, configuration D) on synthetic images.

Thirteen 3x3 convolutions in five blocks, each ending in a 2x2 max pooling, and FC 4096-4096
with dropout (``latte.zoo.vgg16``).
Each class of the synthetic data is a random template plus noise (examples/synthetic.py),
so a net can learn it; the default two epochs of eight batches show the speed, and
``--max-epoch N`` trains longer.

Run it with ``latte run examples/vgg16.py`` (``--max-epoch N``, ``--threads N``,
``--opt-level L``, ``--profile``), print the compiler's plan with ``latte explain
examples/vgg16.py``, or train at ImageNet's size with ``python examples/vgg16.py --size 224``
(``--batch B``, ``--batches N``). The default input is 32x32.
"""

from synthetic import train

from latte.zoo import vgg16

train(__doc__, vgg16, size=32, lr=0.005)
