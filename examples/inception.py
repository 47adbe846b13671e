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

from synthetic import train

from latte.zoo import inception

train(__doc__, inception, size=32, lr=0.01)
