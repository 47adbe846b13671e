"""Locality planner for cross-layer fusion: which consecutive layers run tile by tile together.

Pure algorithms over a chain of :class:`Layer` descriptions (no IR). Tiles are row planes:
full width, all channels, some rows (Occam III-A). Two planners:

* :func:`occam`: Occam's dynamic program (Occam III-D, equations 1-6), the partition of the
  chain into spans with the least off-chip feature-map traffic whose dependence closures
  (Occam III-C) fit the cache budget;
* :func:`brainslug`: BrainSlug's collapse (BrainSlug 4.1), steps of at most one window
  operation packed greedily into sequences that fit the budget.

Spans are inclusive pairs ``(i, j)`` of layer indices: layer ``i`` reads the span's input
map from memory, layer ``j`` writes its output map. An element-wise layer works in place on
the rows its producer just wrote, so its map takes no room of its own (Occam III-C: local
operations "occur as part of each layer's computation without affecting the dependence
closure"; BrainSlug passes values between the operations of a step directly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from latte.errors import ShapeError

KINDS = ("conv", "pool", "eltwise", "fc")


@dataclass(frozen=True)
class Layer:
    """One layer of a chain: a ``(channels, rows, cols)`` map in, another out. ``kernel_h``,
    ``stride_h`` and ``pad_h`` act along rows; an fc layer's kernel covers every input row."""

    name: str
    kind: str
    in_channels: int
    out_channels: int
    in_h: int
    in_w: int
    out_h: int
    out_w: int
    kernel_h: int = 1
    stride_h: int = 1
    pad_h: int = 0
    filter_bytes: int = 0
    elem_bytes: int = 4

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"layer {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if min(self.in_channels, self.out_channels, self.in_h, self.in_w, self.out_h, self.out_w,
               self.kernel_h, self.stride_h) < 1:
            raise ShapeError(f"layer {self.name!r}: sizes, kernel and stride must be positive")
        if self.kind == "eltwise" and (self.in_shape != self.out_shape or self.kernel_h != 1
                                       or self.stride_h != 1):
            raise ShapeError(f"eltwise layer {self.name!r} must keep its shape (kernel 1, stride 1)")
        if self.kind == "pool" and self.in_channels != self.out_channels:
            raise ShapeError(f"pool layer {self.name!r} must keep its channels")

    @property
    def in_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, self.in_h, self.in_w)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.out_channels, self.out_h, self.out_w)

    def rows_in(self, rows_out: int) -> int:
        """Input rows a tile of ``rows_out`` output rows reads: ``(rows_out - 1) * stride +
        kernel``, never more than the map (padding rows are not stored)."""
        return min(self.in_h, (rows_out - 1) * self.stride_h + self.kernel_h)

    def in_bytes(self, rows: int | None = None) -> int:
        """Bytes of ``rows`` row planes of the input map (all of it by default)."""
        return (self.in_h if rows is None else rows) * self.in_w * self.in_channels * self.elem_bytes

    def out_bytes(self, rows: int | None = None) -> int:
        """Bytes of ``rows`` row planes of the output map (all of it by default)."""
        return (self.out_h if rows is None else rows) * self.out_w * self.out_channels * self.elem_bytes


def layer(name: str, kind: str, shape: tuple[int, int, int], *, out_channels: int | None = None,
          kernel: int = 1, stride: int = 1, pad: int = 0, elem_bytes: int = 4) -> Layer:
    """A layer reading a ``(channels, rows, cols)`` map, its output size and filter bytes
    derived (square kernels and strides; conv filters include the bias; fc reads everything)."""
    c, h, w = shape
    oc = c if out_channels is None else out_channels
    if kind == "fc":
        return Layer(name, kind, c, oc, h, w, 1, 1, h, 1, 0, (c * h * w + 1) * oc * elem_bytes,
                     elem_bytes)
    oh, ow = ((n + 2 * pad - kernel) // stride + 1 for n in (h, w))
    weights = (c * kernel * kernel + 1) * oc * elem_bytes if kind == "conv" else 0
    return Layer(name, kind, c, oc, h, w, oh, ow, kernel, stride, pad, weights, elem_bytes)


def vgg16(elem_bytes: int = 4) -> list[Layer]:
    """VGG-16's convolutional part on a 3x224x224 image: 13 3x3 convs (each followed by a
    ReLU) in five blocks, each block ending in a 2x2 stride-2 max pool."""
    chain: list[Layer] = []
    shape = (3, 224, 224)
    for block, (convs, channels) in enumerate([(2, 64), (2, 128), (3, 256), (3, 512), (3, 512)], 1):
        for k in range(1, convs + 1):
            chain.append(layer(f"conv{block}_{k}", "conv", shape, out_channels=channels, kernel=3,
                               pad=1, elem_bytes=elem_bytes))
            chain.append(layer(f"relu{block}_{k}", "eltwise", chain[-1].out_shape,
                               elem_bytes=elem_bytes))
            shape = chain[-1].out_shape
        chain.append(layer(f"pool{block}", "pool", shape, kernel=2, stride=2, elem_bytes=elem_bytes))
        shape = chain[-1].out_shape
    return chain


def _check(chain: Sequence[Layer]) -> None:
    if not chain:
        raise ShapeError("the chain has no layers")
    for a, b in zip(chain, chain[1:]):
        if a.out_shape != b.in_shape:
            raise ShapeError(f"layer {a.name!r} writes {a.out_shape} but {b.name!r} reads {b.in_shape}")


def _check_span(chain: Sequence[Layer], i: int, j: int, rows_out: int) -> None:
    if not 0 <= i <= j < len(chain):
        raise IndexError(f"span ({i}, {j}) is not within the chain's {len(chain)} layers")
    if not 1 <= rows_out <= chain[j].out_h:
        raise ValueError(f"{rows_out} output rows: layer {chain[j].name!r} has {chain[j].out_h}")


def closure_rows(chain: Sequence[Layer], i: int, j: int, rows_out: int = 1) -> list[int]:
    """Input rows of each layer ``i..j`` in the dependence closure (Occam III-C) of a tile of
    ``rows_out`` output rows of layer ``j``."""
    _check_span(chain, i, j, rows_out)
    rows, out = [], rows_out
    for lay in reversed(chain[i:j + 1]):
        out = lay.rows_in(out)
        rows.append(out)
    return rows[::-1]


def footprint(chain: Sequence[Layer], i: int, j: int, rows_out: int = 1) -> int:
    """Bytes a tile of ``rows_out`` output rows of span ``(i, j)`` holds on chip: the closure's
    row planes of every map the span stores (the input of each non-element-wise layer, and
    the output tile) plus the span's filters (Occam equation 1, left-hand side)."""
    span = chain[i:j + 1]
    maps = sum(lay.in_bytes(r) for lay, r in zip(span, closure_rows(chain, i, j, rows_out))
               if lay.kind != "eltwise")
    return maps + chain[j].out_bytes(rows_out) + sum(lay.filter_bytes for lay in span)


def tile_rows(chain: Sequence[Layer], i: int, j: int, budget: int) -> int:
    """The most output rows of span ``(i, j)`` whose footprint fits ``budget`` (1 if none does)."""
    lo, hi = 1, chain[j].out_h
    while lo < hi:  # the footprint grows with the rows: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if footprint(chain, i, j, mid) <= budget else (lo, mid - 1)
    return lo


def traffic(chain: Sequence[Layer], groups: Sequence[tuple[int, int]], *, batch: int = 1) -> int:
    """Off-chip bytes of running ``groups`` on ``batch`` images: each span reads its input map
    and writes its output map once per image (Occam equations 2 and 6); each layer's filters
    are read once per batch (chip-resident across the batch's images, Occam III-D)."""
    maps = sum(chain[i].in_bytes() + chain[j].out_bytes() for i, j in groups)
    return batch * maps + sum(lay.filter_bytes for lay in chain)


@dataclass(frozen=True)
class Plan:
    """A partition of a chain into fused groups, each with its tile and its working set."""

    method: str
    chain: tuple[Layer, ...]
    budget: int
    groups: tuple[tuple[int, int], ...]     # inclusive layer spans, in order
    tile_rows: tuple[int, ...]              # output rows of each group's last layer per tile
    footprint: tuple[int, ...]              # bytes one tile of each group holds on chip
    traffic_fused: int                      # off-chip bytes running the groups
    traffic_unfused: int                    # off-chip bytes running layer by layer

    def format(self) -> str:
        """A short table: one line per group, then the traffic with and without fusion."""
        gain = self.traffic_unfused / self.traffic_fused
        lines = [f"{self.method}: {len(self.groups)} group(s) for {len(self.chain)} layers, "
                 f"budget {self.budget / 1024:.1f} KiB",
                 f"  {'layers':<32} {'rows':>5} {'tile KiB':>10}"]
        for (i, j), rows, fp in zip(self.groups, self.tile_rows, self.footprint):
            names = self.chain[i].name if i == j else f"{self.chain[i].name} .. {self.chain[j].name}"
            over = "  over budget" if fp > self.budget else ""
            lines.append(f"  {names:<32} {rows:>5} {fp / 1024:>10.1f}{over}")
        lines.append(f"  off-chip traffic: {self.traffic_fused / 2**20:.2f} MiB fused, "
                     f"{self.traffic_unfused / 2**20:.2f} MiB unfused ({gain:.2f}x less)")
        return "\n".join(lines)


def _plan(method: str, chain: Sequence[Layer], groups: list[tuple[int, int]], budget: int,
          batch: int) -> Plan:
    rows = [tile_rows(chain, i, j, budget) for i, j in groups]
    return Plan(method, tuple(chain), budget, tuple(groups), tuple(rows),
                tuple(footprint(chain, i, j, r) for (i, j), r in zip(groups, rows)),
                traffic(chain, groups, batch=batch),
                traffic(chain, [(k, k) for k in range(len(chain))], batch=batch))


def occam(chain: Sequence[Layer], budget: int, *, batch: int = 1) -> Plan:
    """Occam's optimal partition (Occam III-D). A span is feasible when the footprint of one
    output row plane fits ``budget`` (equation 1). A span with at most one window layer
    always is, as a lower bound (Occam V-B: "a lower-bound estimate for such cases"): its
    footprint is that layer's own, since Occam's layers carry their local operations along.
    The cost is :func:`traffic`.

    The paper fills an interval table ``OP[i, j]`` (equations 2-5, O(n^3)). The cost is a sum
    over spans, so the optimum over prefixes is the same: ``best[j] = min_i best[i-1] +
    X(i, j)`` over feasible spans ``(i, j)``, with ``X(i, j) = b (|L_i| + |L_j+1|)``
    (equation 6; the filters cost the same in every partition). For each ``j`` the closure
    and footprint grow by one layer per step back, in O(1), and a span of two window layers
    that does not fit ends the scan (longer ones only grow): O(n^2) at worst."""
    _check(chain)
    n = len(chain)
    best = [0] + [math.inf] * n          # best[j + 1]: cheapest map traffic of layers 0..j
    start = [0] * n                      # first layer of the last span in that optimum
    for j in range(n):
        rows, fp, windows = 1, chain[j].out_bytes(1), 0
        for i in range(j, -1, -1):
            lay = chain[i]
            rows = lay.rows_in(rows)
            windows += lay.kind != "eltwise"
            fp += lay.filter_bytes + (lay.in_bytes(rows) if lay.kind != "eltwise" else 0)
            if fp > budget and windows > 1:
                break
            cost = best[i] + batch * (lay.in_bytes() + chain[j].out_bytes())
            # ties come from moving a cut across element-wise layers: keep the later cut, so
            # they stay with their producer
            if cost < best[j + 1]:
                best[j + 1], start[j] = cost, i
    groups, j = [], n - 1
    while j >= 0:
        groups.append((start[j], j))
        j = start[j] - 1
    return _plan("occam", chain, groups[::-1], budget, batch)


def _windows(chain: Sequence[Layer], i: int, j: int) -> int:
    return sum(lay.kind != "eltwise" for lay in chain[i:j + 1])


def brute_force(chain: Sequence[Layer], budget: int, *, batch: int = 1) -> tuple[int, list[tuple[int, int]]]:
    """The cheapest of all ``2^(n-1)`` partitions under :func:`occam`'s model (for tests)."""
    _check(chain)
    n = len(chain)
    fits = {(i, j): _windows(chain, i, j) <= 1 or footprint(chain, i, j) <= budget
            for i in range(n) for j in range(i, n)}
    best: tuple[int, list[tuple[int, int]]] | None = None
    for mask in range(1 << (n - 1)):
        cuts = [k + 1 for k in range(n - 1) if mask >> k & 1]
        groups = list(zip([0, *cuts], [c - 1 for c in cuts] + [n - 1]))
        if all(fits[g] for g in groups):
            cost = traffic(chain, groups, batch=batch)
            if best is None or cost < best[0]:
                best = (cost, groups)
    assert best is not None  # the partition into single layers is always feasible
    return best


def steps(chain: Sequence[Layer]) -> list[tuple[int, int]]:
    """BrainSlug's steps (BrainSlug 4.1): maximal spans with at most one window operation
    (conv, pool or fc); element-wise layers join the step they follow (or the first)."""
    _check(chain)
    out, first, window = [], 0, False
    for k, lay in enumerate(chain):
        if lay.kind != "eltwise":
            if window:
                out.append((first, k - 1))
                first = k
            window = True
    return [*out, (first, len(chain) - 1)]


def brainslug(chain: Sequence[Layer], budget: int, *, batch: int = 1) -> Plan:
    """BrainSlug's sequences (BrainSlug 4.1): consecutive :func:`steps` packed greedily, a
    step joining the current sequence while the sequence's working set (the
    :func:`footprint` of one output row plane) fits ``budget``, else starting the next one
    (a step too big on its own is a sequence of its own). Each sequence then takes the
    largest tile that fits ("we increase the size of it").

    Listing 1 as printed does not do this: its step loop tests ``not onlyElementwise() or
    not isElementwise()`` and, inside that branch, adds the operation and closes the step,
    so an element-wise operation reaching an element-wise-only step is dropped and a window
    operation always ends its step (the test wants ``and``, the close must come before an
    unconditional add); its sequence loop removes an overflowing step and starts an empty
    sequence, dropping that step; and neither loop appends its last step or sequence."""
    groups: list[tuple[int, int]] = []
    for first, last in steps(chain):
        if groups and footprint(chain, groups[-1][0], last) <= budget:
            groups[-1] = (groups[-1][0], last)
        else:
            groups.append((first, last))
    return _plan("brainslug", chain, groups, budget, batch)
