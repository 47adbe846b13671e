"""The locality planner on layer chains: dependence closures, Occam's DP against brute force,
BrainSlug's steps and sequences, traffic estimates."""

from __future__ import annotations

import random

import pytest

from latte.compiler.planner import (
    KINDS,
    Layer,
    brainslug,
    brute_force,
    closure_rows,
    footprint,
    layer,
    occam,
    steps,
    tile_rows,
    traffic,
    vgg16,
)
from latte.errors import ShapeError


def random_chain(rng: random.Random, n: int) -> list[Layer]:
    """``n`` layers of random kinds, channels, kernels (1/3/5), strides (1/2) and pads."""
    shape = (rng.choice([1, 3, 8]), rng.randint(4, 40), rng.randint(4, 40))
    chain = []
    for k in range(n):
        kind = rng.choice(KINDS)
        kernel, stride = rng.choice([1, 3, 5]), rng.choice([1, 2])
        pad = rng.choice([0, kernel // 2])
        if kind == "eltwise" or kernel > min(shape[1:]) + 2 * pad:
            kernel, stride, pad = 1, 1, 0
        chain.append(layer(f"l{k}", kind, shape, out_channels=rng.choice([4, 16, 48]),
                           kernel=kernel, stride=stride, pad=pad)
                     if kind in ("conv", "fc") else
                     layer(f"l{k}", kind, shape, kernel=kernel, stride=stride, pad=pad))
        shape = chain[-1].out_shape
    return chain


def random_budget(rng: random.Random, chain: list[Layer]) -> int:
    """A budget somewhere between nothing fitting and everything fitting, sometimes exactly
    the footprint of some span (to exercise the boundary)."""
    i = rng.randrange(len(chain))
    j = rng.randrange(i, len(chain))
    if rng.random() < 0.3:
        return footprint(chain, i, j)
    return int(footprint(chain, 0, len(chain) - 1) * rng.uniform(0.01, 1.2)) + 1


def resnet_like(n: int = 152) -> list[Layer]:
    """A plain chain of ``n`` layers shaped like ResNet-152's trunk (no residual edges)."""
    chain = [layer("conv1", "conv", (3, 224, 224), out_channels=64, kernel=7, stride=2, pad=3)]
    chain.append(layer("pool1", "pool", chain[-1].out_shape, kernel=3, stride=2, pad=1))
    widths = [64] * 30 + [128] * 30 + [256] * 30 + [512] * 30
    k = 0
    while len(chain) < n:
        c, h, w = chain[-1].out_shape
        kind = ("conv", "eltwise", "conv", "eltwise", "conv", "eltwise")[k % 6]
        width = widths[min(k // 4, len(widths) - 1)]
        stride = 2 if k % 48 == 46 and h > 7 else 1
        if kind == "conv":
            kernel = 3 if k % 6 == 2 else 1
            chain.append(layer(f"l{k}", "conv", (c, h, w), out_channels=width * (4 if k % 6 == 4 else 1),
                               kernel=kernel, stride=stride, pad=kernel // 2))
        else:
            chain.append(layer(f"l{k}", "eltwise", (c, h, w)))
        k += 1
    return chain


# ---------------------------------------------------------------- dependence closure

def test_vgg16_closure_grows_through_convs_and_pools():
    chain = vgg16()
    assert len(chain) == 31 and sum(lay.kind == "conv" for lay in chain) == 13
    assert chain[-1].out_shape == (512, 7, 7)
    rows = closure_rows(chain, 0, len(chain) - 1)
    # backwards from one output row: each 3x3 stride-1 conv adds 2 rows, a ReLU adds none,
    # each 2x2 stride-2 pool doubles: (r - 1) * stride + kernel
    out = [*rows[1:], 1]
    for lay, r_in, r_out in zip(chain, rows, out):
        assert r_in == {"conv": r_out + 2, "eltwise": r_out, "pool": 2 * r_out}[lay.kind]
    # block 5 alone, from one output row of conv5_3: 1, 3, 5, 7
    first = [lay.name for lay in chain].index("conv5_1")
    assert closure_rows(chain, first, first + 4) == [7, 5, 5, 3, 3]
    convs = [r for lay, r in zip(chain, rows) if lay.kind == "conv"]
    assert convs == [212, 210, 104, 102, 50, 48, 46, 22, 20, 18, 8, 6, 4]


def test_closure_of_a_tile_follows_the_strides_and_stays_within_the_map():
    chain = vgg16()
    assert closure_rows(chain, 0, 4, rows_out=3) == [10, 8, 8, 6, 6]   # pool1 reads 2 * 3
    pool5 = len(chain) - 1
    assert closure_rows(chain, pool5 - 6, pool5, rows_out=7) == [14] * 7  # never past 14 rows
    with pytest.raises(ValueError):
        closure_rows(chain, 0, 0, rows_out=225)
    with pytest.raises(IndexError):
        closure_rows(chain, 3, 2)


# ---------------------------------------------------------------- Occam's DP

def test_occam_equals_brute_force_on_random_chains():
    rng = random.Random(1234)
    for case in range(200):
        chain = random_chain(rng, rng.randint(1, 14))
        budget = random_budget(rng, chain)
        batch = rng.choice([1, 8])
        plan = occam(chain, budget, batch=batch)
        cost, _ = brute_force(chain, budget, batch=batch)
        assert plan.traffic_fused == cost, (case, plan.groups)
        assert plan.traffic_fused == traffic(chain, plan.groups, batch=batch)
        assert [g[0] for g in plan.groups] == [0] + [g[1] + 1 for g in plan.groups[:-1]]
        assert plan.groups[-1][1] == len(chain) - 1
        for (i, j), rows, fp in zip(plan.groups, plan.tile_rows, plan.footprint):
            assert fp <= budget or sum(lay.kind != "eltwise" for lay in chain[i:j + 1]) <= 1
            assert fp == footprint(chain, i, j, rows)
            assert rows == chain[j].out_h or fp > budget or footprint(chain, i, j, rows + 1) > budget


def test_occam_extremes():
    chain = vgg16()
    whole = occam(chain, footprint(chain, 0, len(chain) - 1))
    assert whole.groups == ((0, len(chain) - 1),)
    assert whole.traffic_fused == chain[0].in_bytes() + chain[-1].out_bytes() + sum(
        lay.filter_bytes for lay in chain)
    # nothing fits: each window layer runs alone, with the ReLUs next to it in place
    alone = occam(chain, 1)
    assert alone.groups == tuple(steps(chain))
    assert alone.tile_rows == (1,) * len(alone.groups)
    assert alone.traffic_fused == traffic(chain, steps(chain)) < alone.traffic_unfused


def test_occam_on_152_layers():
    chain = resnet_like(152)
    assert len(chain) == 152
    for budget in (256 << 10, 1 << 20, 8 << 20, 1 << 40):
        plan = occam(chain, budget, batch=16)
        assert plan.traffic_fused <= plan.traffic_unfused


def test_tile_rows_is_the_largest_that_fits():
    chain = vgg16()
    budget = footprint(chain, 0, 4, 5)
    assert tile_rows(chain, 0, 4, budget) == 5
    assert tile_rows(chain, 0, 4, budget - 1) == 4
    assert tile_rows(chain, 0, 4, 1) == 1


# ---------------------------------------------------------------- BrainSlug

def test_steps_hold_one_window_op_and_eltwise_ops_attach():
    shape = (4, 16, 16)
    kinds = ["eltwise", "conv", "eltwise", "eltwise", "pool", "eltwise", "conv", "conv", "eltwise"]
    chain = []
    for k, kind in enumerate(kinds):
        chain.append(layer(f"l{k}", kind, chain[-1].out_shape if chain else shape,
                           kernel=1 if kind == "eltwise" else 3, pad=0 if kind == "eltwise" else 1))
    assert steps(chain) == [(0, 3), (4, 5), (6, 6), (7, 8)]
    only = [layer("a", "eltwise", shape), layer("b", "eltwise", shape)]
    assert steps(only) == [(0, 1)]
    rng = random.Random(7)
    for _ in range(100):
        chain = random_chain(rng, rng.randint(1, 20))
        got = steps(chain)
        assert [g[0] for g in got] == [0] + [g[1] + 1 for g in got[:-1]]
        assert got[-1][1] == len(chain) - 1
        for i, j in got:
            windows = [k for k in range(i, j + 1) if chain[k].kind != "eltwise"]
            assert len(windows) <= 1
            assert not windows or all(chain[k].kind == "eltwise" for k in range(windows[0] + 1, j + 1))
            assert i == 0 or windows == [i]     # only the first step may start element-wise


def test_brainslug_sequences_respect_the_budget():
    rng = random.Random(99)
    for _ in range(200):
        chain = random_chain(rng, rng.randint(1, 20))
        budget = random_budget(rng, chain)
        plan = brainslug(chain, budget)
        step_end = dict(steps(chain))
        assert all(i in step_end for i, _ in plan.groups)        # sequences are runs of steps
        for (i, j), fp in zip(plan.groups, plan.footprint):
            assert fp <= budget or step_end[i] == j               # or a step too big on its own
        for (i, _), (k, _) in zip(plan.groups, plan.groups[1:]):
            assert footprint(chain, i, step_end[k]) > budget      # greedy: the next step did not fit
        assert plan.traffic_fused >= occam(chain, budget).traffic_fused


def test_brainslug_chain_that_fits_is_one_sequence():
    chain = vgg16()[:5]
    plan = brainslug(chain, footprint(chain, 0, 4))
    assert plan.groups == ((0, 4),)
    assert plan.tile_rows == (1,)
    roomy = brainslug(chain, 1 << 40)
    assert roomy.tile_rows == (112,) and roomy.footprint[0] == footprint(chain, 0, 4, 112)


# ---------------------------------------------------------------- traffic and the plan

def test_fused_traffic_is_at_most_unfused():
    rng = random.Random(5)
    for _ in range(100):
        chain = random_chain(rng, rng.randint(1, 30))
        budget = random_budget(rng, chain)
        for plan in (occam(chain, budget), brainslug(chain, budget)):
            assert plan.traffic_fused <= plan.traffic_unfused
    plan = occam(vgg16(), 2 << 20)
    assert plan.traffic_fused < plan.traffic_unfused


def test_plan_format():
    text = occam(vgg16(), 1 << 20).format()
    assert text.startswith("occam:") and "conv1_1" in text and "MiB unfused" in text
    assert len(text.splitlines()) == len(occam(vgg16(), 1 << 20).groups) + 3


def test_bad_chains_are_rejected():
    a = layer("a", "conv", (3, 8, 8), out_channels=4, kernel=3)
    with pytest.raises(ShapeError):
        occam([a, layer("b", "conv", (3, 8, 8), kernel=3)], 1 << 20)
    with pytest.raises(ValueError):
        layer("c", "softmax", (3, 8, 8))
    with pytest.raises(ShapeError):
        Layer("d", "eltwise", 3, 3, 8, 8, 4, 4)
