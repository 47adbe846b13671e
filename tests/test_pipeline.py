"""The pipeline is a declared list of named steps; graphs it cannot compile are errors."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from latte import Net, add_connections
from latte.compiler import STEPS, pipeline
from latte.errors import MappingError
from latte.stdlib import FullyConnectedLayer, MemoryDataLayer, ReLULayer


def _mlp(opt_level: int = 3) -> Net:
    net = Net(2, opt_level=opt_level, seed=0)
    x = MemoryDataLayer(net, "x", (6,))
    fc = FullyConnectedLayer("fc", net, x, 4)
    ReLULayer("relu", net, fc)
    return net


def test_steps_are_named_with_their_lowest_opt_level():
    names = [s.name for s in STEPS]
    assert len(set(names)) == len(names)
    assert names[0] == "analyze"
    assert names[-4:] == ["schedule", "coalesce_loops", "stream_stores", "cut_segments"]
    assert {s.name: s.min_opt for s in STEPS}["tile_loops"] == 2


def test_the_garbage_collector_is_paused_while_a_net_compiles(monkeypatch):
    """Off inside ``compile_net`` (its steps run without it), back as it was after: on
    again, or still off where the caller had turned it off; on again after a failure."""
    monkeypatch.setenv("LATTE_STORED_PROGRAMS", "0")   # the steps run, not a stored program
    seen = []
    step = STEPS[0]
    monkeypatch.setattr(pipeline, "STEPS", (
        pipeline.Step(step.name, step.min_opt, lambda c: seen.append(gc.isenabled()) or step.fn(c),
                      per_kernel=False), *STEPS[1:]))
    assert gc.isenabled()
    _mlp().init()
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        _mlp().init()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), pipeline.collector_paused():
        raise RuntimeError("a failed compile")
    assert gc.isenabled()


def test_dump_one_step_by_name(capfd, monkeypatch):
    monkeypatch.setenv("LATTE_DUMP", "ir:tile_loops")
    _mlp().init()
    err = capfd.readouterr().err
    assert "==== fc.forward after tile_loops" in err
    assert "after match_gemm" not in err and "after synthesize" not in err


def test_dump_every_step(capfd, monkeypatch):
    monkeypatch.setenv("LATTE_DUMP", "ir")
    _mlp(1).init()
    err = capfd.readouterr().err
    for step in ("synthesize", "distribute_loops", "match_gemm", "schedule"):
        assert f"fc.forward after {step}" in err
    assert "after tile_loops" not in err   # opt level 2 and up


def test_recurrent_connection_needs_time_steps():
    net = _mlp()
    fc = net.ensemble("fc")
    add_connections(net, fc, fc, lambda o: (o,), recurrent=True)
    with pytest.raises(MappingError, match=r"'fc' -> 'fc'.*recurrent.*time_steps=1"):
        net.init()


def test_a_cycle_is_an_error_naming_its_ensembles():
    net = Net(2, seed=0)
    x = MemoryDataLayer(net, "x", (4,))
    fc1 = FullyConnectedLayer("fc1", net, x, 4)
    fc2 = FullyConnectedLayer("fc2", net, fc1, 4)
    add_connections(net, fc2, fc1, lambda o: (range(4),))   # fc1 reads fc2 reads fc1
    with pytest.raises(MappingError, match=r"cycle .*'fc1'.*'fc2'.*no recurrent"):
        net.init()


def test_a_dag_is_no_cycle():
    net = Net(2, seed=0)
    x = MemoryDataLayer(net, "x", (4,))
    fc1 = FullyConnectedLayer("fc1", net, x, 4)
    fc2 = FullyConnectedLayer("fc2", net, x, 4)
    fc3 = FullyConnectedLayer("fc3", net, fc1, 4)
    add_connections(net, fc2, fc3, lambda o: (range(4),))
    net.init()
    net.value(x)[...] = np.ones((2, 4), np.float32)
    net.forward()
