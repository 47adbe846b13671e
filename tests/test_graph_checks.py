"""Graph checks: a layer's inputs belong to its net, and a compiled net no longer grows."""

from __future__ import annotations

import numpy as np
import pytest

from latte import Ensemble, Net, add_connections
from latte.errors import LatteError, MappingError
from latte.stdlib import (
    AccuracyLayer,
    FullyConnectedLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
    TanhLayer,
)
from latte.stdlib.activations import ReLUNeuron


def _two_nets():
    net, other = Net(2), Net(2)
    x = MemoryDataLayer(net, "x", (4,))
    label = MemoryDataLayer(net, "label", (1,))
    fc = FullyConnectedLayer("fc", net, x, 3)
    foreign = FullyConnectedLayer("foreign_fc", other, MemoryDataLayer(other, "y", (4,)), 3)
    foreign_label = MemoryDataLayer(other, "foreign_label", (1,))
    return net, fc, label, foreign, foreign_label


@pytest.mark.parametrize("layer", [SoftmaxLossLayer, AccuracyLayer])
def test_loss_and_accuracy_reject_another_nets_input(layer):
    net, fc, label, foreign, foreign_label = _two_nets()
    before = list(net.ensembles)
    with pytest.raises(MappingError, match=r"'scored'.*'foreign_fc' belongs to another Net"):
        layer("scored", net, foreign, label)
    with pytest.raises(MappingError, match=r"'scored'.*'foreign_label' belongs to another Net"):
        layer("scored", net, fc, foreign_label)
    assert net.ensembles == before   # nothing half-built was added


@pytest.mark.parametrize("layer", [ReLULayer, TanhLayer])
def test_activations_reject_another_nets_input(layer):
    net, fc, label, foreign, _ = _two_nets()
    with pytest.raises(MappingError, match=r"'act'.*'foreign_fc' belongs to another Net"):
        layer("act", net, foreign)
    assert "act" not in [e.name for e in net.ensembles]


def test_connections_between_nets_are_rejected():
    net, fc, label, foreign, _ = _two_nets()
    sink = Ensemble(net, "sink", ReLUNeuron, (3,))
    with pytest.raises(MappingError, match="'foreign_fc' -> 'sink'"):
        add_connections(net, foreign, sink, lambda i: (i,))


def test_an_input_must_be_an_ensemble():
    net, fc, label, *_ = _two_nets()
    with pytest.raises(TypeError, match=r"'loss'.*must be ensembles"):
        SoftmaxLossLayer("loss", net, (fc, label), label)


def test_nothing_is_added_after_init():
    net, fc, label, *_ = _two_nets()
    SoftmaxLossLayer("loss", net, fc, label)
    net.init()
    names = [e.name for e in net.ensembles]
    with pytest.raises(LatteError, match=r"'late'.*already compiled; build the whole net before init"):
        FullyConnectedLayer("late", net, fc, 2)
    with pytest.raises(MappingError, match=r"'fc' -> 'x'.*already compiled"):
        add_connections(net, fc, net.ensemble("x"), lambda i: (0,))
    assert [e.name for e in net.ensembles] == names
    # the compiled net still runs as built
    net.value("x")[...] = np.ones((2, 4), np.float32)
    net.value("label")[...] = 0
    net.forward()
    net.backward()
    assert np.isfinite(net.loss)
