"""AlexNet (Krizhevsky et al., as Caffe's bvlc_alexnet) on synthetic images.

Five convolutions, the 2nd, 4th and 5th in two groups, local response normalization after the
first two, three max poolings and FC 4096-4096 with dropout (``latte.zoo.alexnet``).
Each class of the synthetic data is a random template plus noise (examples/synthetic.py),
so a net can learn it; the default two epochs of eight batches show the speed, and
``--max-epoch N`` trains longer.

Run it with ``latte run examples/alexnet.py`` (``--max-epoch N``, ``--threads N``,
``--opt-level L``, ``--profile``), print the compiler's plan with ``latte explain
examples/alexnet.py``, or train at ImageNet's size with ``python examples/alexnet.py --size 224``
(``--batch B``, ``--batches N``). The default input is 67x67.
"""

from synthetic import train

from latte.zoo import alexnet

train(__doc__, alexnet, size=67, lr=0.005)
