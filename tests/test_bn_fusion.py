"""Batch norm in the test forward: its statistics come from ``net.state`` and are constants
there, so at opt 3 conv + BN + ReLU, and a ResNet basic block's conv + BN + add + ReLU tail,
run as one fused group (``program.test_groups``); training keeps its own groups. Outputs
at opt 3 equal opt 0 and PyTorch's eval-mode twin (float64), at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WeightedSumLoss, assert_scaled_close

import latte.stdlib as stdlib
from latte import Net, Phase
from latte.compiler.explain import explain_program
from latte.compiler.ir import touched
from latte.compiler.passes.tiling import tile_loop
from latte.compiler.program import Segment
from latte.stdlib import MemoryDataLayer
from latte.zoo.nets import basic_block, bottleneck

SHAPE = (4, 10, 10)


def conv_bn_relu(lib, net, x):
    conv = lib.ConvolutionLayer("conv", net, x, 6, 3, pad=1, bias=False)
    return lib.ReLULayer("relu", net, lib.BatchNormLayer("bn", net, conv))


def block(lib, net, x):
    """conv-BN-ReLU-conv-BN, plus the identity shortcut, ReLU."""
    return basic_block(lib, "blk", net, x, SHAPE[0], 1)


def projected(lib, net, x):
    """A strided block: its shortcut is a 1x1 conv + BN, computed after the branch."""
    return basic_block(lib, "blk", net, x, 2 * SHAPE[0], 2)


BLOCK = "+".join(f"blk_{n}" for n in ("conv1", "conv1_bn", "conv1_relu", "conv2", "conv2_bn",
                                       "add", "relu"))
CASES = {  # builder, the test groups at opt 3
    "conv_bn_relu": (conv_bn_relu, ["conv+bn+relu"]),
    "block": (block, [BLOCK]),
    "projected": (projected, ["blk_conv1+blk_conv1_bn+blk_conv1_relu+blk_conv2+blk_conv2_bn",
                              "blk_proj+blk_proj_bn+blk_add+blk_relu"]),
}


def _net(build, opt_level: int, threads: int, batch: int = 2, shape: tuple = SHAPE):
    net = Net(batch, opt_level=opt_level, num_threads=threads, seed=0)
    x = MemoryDataLayer(net, "x", shape)
    out = build(stdlib, net, x)
    WeightedSumLoss(net, "loss", out)
    net.init()
    rng = np.random.default_rng(1)
    for p in net.params:   # scales away from one, shifts away from zero
        field = p.name.rsplit(".", 1)[1]
        base = 1.0 if field == "scale" else 0.0
        p.value[...] = base + (0.3 if field == "weights" else 0.5) * rng.standard_normal(p.value.shape)
    for key, v in net.state.items():
        v[...] = rng.uniform(0.5, 2.0, v.shape) if key.endswith("var") else rng.standard_normal(v.shape)
    net.value(x)[...] = rng.standard_normal(net.value(x).shape)
    return net, x, out


def _ran(net) -> list[str]:
    return [k.name for s in net.program.test if isinstance(s, Segment) for k in s.kernels]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_test_forward_fuses_and_agrees(case, threads):
    build, groups = CASES[case]
    fused, x, out = _net(build, 3, threads)
    plain, *_ = _net(build, 0, threads)
    assert [g.name for g in fused.program.test_groups] == groups
    assert all(f"{g}.test" in _ran(fused) for g in groups)
    bns = [e.name for g in fused.program.test_groups for p in g.plans
           if (e := p.ensemble).name.endswith("bn")]
    assert bns and not any(k.startswith(tuple(f"{b}." for b in bns)) for k in _ran(fused))
    for phase in (Phase.TEST, Phase.TRAIN, Phase.TEST):   # training updates the statistics
        for net in (fused, plain):
            net.forward(phase)
        assert_scaled_close(fused.value(out), plain.value(out.name), 1e-5, f"{phase} output")
        if phase is Phase.TRAIN:
            fused.backward()
            plain.backward()
            assert_scaled_close(fused.grad(x), plain.grad(x.name), 1e-4, "input gradient")
            for p, q in zip(fused.params, plain.params):
                assert_scaled_close(p.grad, q.grad, 1e-4, f"gradient of {p.name}")
            for key, v in fused.state.items():
                assert_scaled_close(v, plain.state[key], 1e-5, key)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["conv_bn_relu", "projected"])
def test_test_forward_equals_torch_eval(case, threads):
    torch = pytest.importorskip("torch")
    from latte.zoo import torch_twin

    build, _ = CASES[case]
    net, x, out = _net(build, 3, threads)
    twin = torch_twin.TwinNet(SHAPE, dtype=torch.float64)
    twin.output = build(torch_twin, twin, twin.input)
    twin.load_from(net)
    net.forward(Phase.TEST)
    with torch.no_grad():
        expected = twin.eval()(torch.tensor(net.value(x), dtype=torch.float64)).numpy()
    assert_scaled_close(net.value(out), expected, 1e-4, "test-mode output")


@pytest.mark.parametrize("case, bn", [("block", "blk_conv2_bn"), ("projected", "blk_proj_bn")])
def test_the_bn_before_the_residual_add_stays_in_registers(case, bn):
    """The test forward's add reads the batch norm's output right where it is computed: the
    group's kernel keeps it in a local, in no buffer (not even a line buffer), and ``latte
    explain`` says so."""
    net, *_ = _net(CASES[case][0], 3, 2)
    kernel, = [k for s in net.program.test if isinstance(s, Segment) for k in s.kernels
               if bn in k.name.removesuffix(".test").split("+")]
    names = {b.name for b in touched(kernel.body)}
    assert {"blk_add.value", f"{bn}.scale"} <= names, sorted(names)
    assert not any(n.startswith(f"{bn}.value") for n in names), sorted(names)
    assert f"kept in registers by the test forward (each element read back as soon as it is " \
           f"computed): {bn}\n" in explain_program(net.program)


def test_explain_says_fused_or_why_not():
    net, *_ = _net(conv_bn_relu, 3, 1)
    text = explain_program(net.program)
    assert "fused in the test forward only" in text
    assert "'bn' (with bn_mean, bn_inv_std): fused with 'conv' in group conv+bn+relu" in text


def test_a_conv_read_twice_is_not_fused_with_its_bn():
    """The conv's values are needed whole by another reader: the BN runs on its own, and
    explain names the other reader."""
    def build(lib, net, x):
        conv = lib.ConvolutionLayer("conv", net, x, SHAPE[0], 3, pad=1, bias=False)
        bn = lib.BatchNormLayer("bn", net, conv)
        return lib.AddLayer("add", net, bn, conv)

    net, x, out = _net(build, 3, 1)
    plain, *_ = _net(build, 0, 1)
    assert not any("conv" in [p.ensemble.name for p in g.plans] for g in net.program.test_groups)
    assert ("'bn' (with bn_mean, bn_inv_std): neither fused with 'conv' nor folded into its "
            "weights: 'conv' is also read by 'add'; it runs in group bn+add"
            ) in explain_program(net.program)
    for n in (net, plain):
        n.forward(Phase.TEST)
    assert_scaled_close(net.value(out), plain.value(out.name), 1e-5, "test-mode output")


def test_a_group_around_statements_without_tiles_fuses_in_order():
    """A ResNet-50 bottleneck at batch 1, 2 threads: its 3x3 conv's Winograd kernel has
    statements without a tile loop between its tiled ones. Its group with the BN, ReLU,
    the 1x1 conv and the BN + add + ReLU tail has no halo, so the members' statements run
    in their order, tiles and all; the test forward equals opt 0's."""
    def build(lib, net, x):
        return bottleneck(lib, "b", net, x, 8, 1)

    shape = (32, 16, 16)
    net, x, out = _net(build, 3, 2, batch=1, shape=shape)
    plain, *_ = _net(build, 0, 2, batch=1, shape=shape)
    group = next(g for g in net.program.test_groups if g.plans[0].ensemble.name == "b_conv2")
    assert group.name == "+".join(f"b_{n}" for n in ("conv2", "conv2_bn", "conv2_relu", "conv3",
                                                    "conv3_bn", "add", "relu"))
    assert not any(group.links)
    assert any(tile_loop(s) is None for s in group.plans[0].kernels["test"].body.stmts)
    assert f"{group.name}.test" in _ran(net)
    for phase in (Phase.TEST, Phase.TRAIN, Phase.TEST):
        for n in (net, plain):
            n.forward(phase)
        assert_scaled_close(net.value(out), plain.value(out.name), 1e-5, f"{phase} output")
