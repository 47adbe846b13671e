"""Inverted dropout: ``value = input * mask`` with a per batch item mask of 0 or 1/(1-ratio).

The neuron only multiplies by its mask (a ``Batch`` field); the ensemble redraws the mask
before every training forward pass, from a generator the net's seed fixes, and sets it to
ones for the test phase, so a trained net needs no rescaling at test time.
"""

from __future__ import annotations

import numpy as np

from latte.lang import Batch, Ensemble, Neuron, Phase, add_connections
from latte.runtime import distributed


class DropoutNeuron(Neuron):
    """Passes its input through, scaled by its mask (0 drops it)."""

    mask: Batch

    def forward(self):
        self.value = self.inputs[0][0] * self.mask

    def backward(self):
        self.grad_inputs[0][0] += self.grad * self.mask


class DropoutEnsemble(Ensemble):
    """DropoutNeurons connected one-to-one to ``input_ens``; draws the masks."""

    def __init__(self, net, name: str, input_ens, ratio: float):
        ratio = float(ratio)
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"dropout {name!r}: ratio must be in [0, 1), got {ratio}")
        super().__init__(net, name, DropoutNeuron, input_ens.shape,
                         mask=np.ones(input_ens.shape, np.float32))
        self.ratio = ratio
        # a child of the net's seeded generator, one stream per MPI rank (each rank has its
        # own batch items); drawing masks leaves the net's generator (shuffling) untouched
        self.rng = np.random.default_rng([int(net.rng.integers(2**63)), distributed.rank()])
        self._ones = False   # the mask holds the all-ones test mask

    def before_forward(self, phase: Phase, fields: dict[str, np.ndarray]) -> None:
        mask = fields["mask"]
        if phase is Phase.TRAIN and self.ratio > 0.0:   # in place: no per-step arrays
            self.rng.random(dtype=np.float32, out=mask)
            np.greater_equal(mask, np.float32(self.ratio), out=mask)
            mask *= np.float32(1.0 / (1.0 - self.ratio))
            self._ones = False
        elif not self._ones:
            mask[...] = 1.0
            self._ones = True


def DropoutLayer(name: str, net, input_ens, ratio: float = 0.5) -> DropoutEnsemble:
    """Zero each input with probability ``ratio`` in training and scale the rest by
    ``1 / (1 - ratio)``; the identity in the test phase."""
    drop = DropoutEnsemble(net, name, input_ens, ratio)
    add_connections(net, input_ens, drop, lambda *index: index)
    return drop
