"""When an activation may work in place, and the copy it works on when it may not.

An :class:`ActivationEnsemble` means ``f(source)``. Working in place on the source's
buffers is only right when nothing else needs the source's values: the activation is the
source's only reader, and the source is not itself an in-place activation (whose backward
needs the values this one overwrites). Otherwise the activation gets a copy of its source
to work on: an ensemble of :class:`CopyNeuron` named ``"<activation>.in"``, inserted just
before it. The compiler and the reference interpreter both call :func:`give_copies`, so
they run the same graph.
"""

from __future__ import annotations

from latte.lang.connection import add_connections
from latte.lang.ensemble import ActivationEnsemble, Ensemble, readers
from latte.lang.neuron import Neuron


class CopyNeuron(Neuron):
    """``value = input``: the copy an activation works on when it may not work in place."""

    def forward(self):
        self.value = self.inputs[0][0]

    def backward(self):
        self.grad_inputs[0][0] += self.grad


def needs_copy(net, act: ActivationEnsemble) -> bool:
    """Whether ``act`` may not work in place on its source."""
    src = act.source
    return isinstance(src, ActivationEnsemble) or readers(net, src) != [act]


def give_copies(net) -> list[Ensemble]:
    """Give every activation that may not work in place a copy of its source to work on;
    returns the copies made (none on a second call)."""
    made = []
    for act in [e for e in net.ensembles if isinstance(e, ActivationEnsemble)]:
        if not needs_copy(net, act):
            continue
        src = act.source
        name = f"{act.name}.in"
        while any(e.name == name for e in net.ensembles):
            name += "_"
        copy = Ensemble(net, name, CopyNeuron, src.shape)
        net.ensembles.remove(copy)                       # run it just before the activation
        net.ensembles.insert(net.ensembles.index(act), copy)
        add_connections(net, src, copy, lambda *i: i)
        act.source = copy
        made.append(copy)
    return made
