"""Random nets: each case is a small DAG (seeded) of generated neurons, in-place activations
and stdlib layers over ``MemoryDataLayer`` inputs, ending in losses. In a net with time steps
(a quarter of the configurations) generated neurons may also read, through a recurrent
connection, their own values or a later ensemble's at the step before: recurrent cycles.

:func:`build_case` adds case ``seed`` to any net; built twice with the same seed it adds the
same ensembles, mappings and field arrays, so several nets (one per opt level) and several
cases in one net (one compile for many cases) all see the same program. Ensemble names start
with ``c<seed>_`` so a failing array names its case.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from latte import ActivationEnsemble, Ensemble, add_connections
from latte.fuzz.layers import LAYERS, pick
from latte.fuzz.neurons import ACTIVATIONS, activation_source, load_class, neuron_source
from latte.lang import DataEnsemble, sources
from latte.stdlib import (
    ConvolutionLayer,
    DropoutLayer,
    EmbeddingLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MeanPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    SigmoidLayer,
    SoftmaxLossLayer,
    TanhLayer,
)

MAX_INPUTS = 40        # longest input vector of a generated neuron
MAX_NEURONS = 60       # largest generated ensemble of a new shape
WIDE = 128             # rows this wide are tiled at opt level >= 2 (tiling.MIN_TILE / 2)
MAX_WIDE = 4096        # largest ensemble that takes a wide source's shape


@dataclass(frozen=True)
class Config:
    """What one net of cases shares: batch size, threads, the optimized level it is
    compared at (besides level 0), time steps."""

    batch: int
    threads: int
    level: int
    time_steps: int = 1


@dataclass
class Case:
    """The ensembles one case added to a net."""

    seed: int
    inputs: list = field(default_factory=list)     # MemoryDataLayers fed with real values
    labels: list = field(default_factory=list)     # (ensemble, number of classes)
    ensembles: list = field(default_factory=list)  # every ensemble, in creation order


def config(seed: int) -> Config:
    """The batch size, thread count and optimized level of case ``seed``."""
    rng = np.random.default_rng([seed, 1])
    cfg = Config(int(rng.integers(1, 6)), int(rng.integers(1, 3)), int(rng.integers(1, 4)))
    steps = np.random.default_rng([seed, 6])   # a stream of its own: the rest stays as it was
    if steps.random() < 0.25:
        return replace(cfg, time_steps=int(steps.integers(2, 5)))
    return cfg


def case_of(name: str) -> int | None:
    """The seed of the case an ensemble (or ``ens.field``) name belongs to."""
    head = name.split("_", 1)[0]
    return int(head[1:]) if head[:1] == "c" and head[1:].isdigit() else None


def normal(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """Float32 normal values. Continuous values make exact ties (which SGD would turn into
    near-ties that float32 and float64 decide differently in a max or an ``if``) unlikely."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


_CLASSES: dict[str, type] = {}


def _cls(plan) -> type:
    if plan.source not in _CLASSES:
        _CLASSES[plan.source] = load_class(plan)
    return _CLASSES[plan.source]


# ---------------------------------------------------------------------- mappings
def _entry_value(e: tuple, y: tuple):
    kind = e[0]
    if kind == "int":
        return e[1]
    if kind == "full":
        return range(e[1])
    if kind == "dim":
        return y[e[1]] + e[2]
    if kind == "win":
        _, t, k, s, d, p = e
        return range(s * y[t] - p, s * y[t] - p + d * (k - 1) + 1, d)
    if kind == "gather":
        return e[2][y[e[1]]]
    lo = e[2][y[e[1]]]   # gwin: a window at a non-affine start
    return range(lo - 1, lo + 1)


def _mapping(entries: tuple) -> Callable:
    return lambda *y: tuple(_entry_value(e, y) for e in entries)


def _entries(rng: np.random.Generator, src: tuple, sink: tuple) -> tuple:
    if src == sink and rng.random() < 0.4:
        return tuple(("dim", j, 0) for j in range(len(src)))   # one-to-one
    out = []
    for n in src:
        t = int(rng.integers(len(sink)))
        m = sink[t]
        kind = str(rng.choice(["full", "int", "dim", "win", "gather", "gwin"]))
        if kind == "full":
            out.append(("full", n))
        elif kind == "int":
            out.append(("int", int(rng.integers(n))))
        elif kind == "dim":
            out.append(("dim", t, int(rng.choice([0, 0, -1, 1]))))
        elif kind == "win":
            out.append(("win", t, int(rng.integers(1, 4)), int(rng.integers(1, 3)),
                        int(rng.integers(1, 3)), int(rng.integers(0, 2))))
        else:
            table = (rng.permutation(max(n, m))[:m] % n if rng.random() < 0.5
                     else (np.arange(m) ** 2 + int(rng.integers(n))) % n)
            out.append((kind, t, tuple(int(v) for v in table)))
    return tuple(out)


def _length(entries: tuple) -> int:
    probe = _mapping(entries)(*([0] * 8))   # lengths do not depend on the sink index
    return int(np.prod([len(r) if isinstance(r, range) else 1 for r in probe]))


def _needs_padding(entries: tuple, src: tuple, sink: tuple) -> bool:
    mapping = _mapping(entries)
    for y in itertools.product(*(range(d) for d in sink)):
        for r, n in zip(mapping(*y), src):
            r = r if isinstance(r, range) else range(r, r + 1)
            if min(r) < 0 or max(r) >= n:
                return True
    return False


def _connect(rng, net, src, sink_shape) -> tuple[tuple, float | None]:
    entries = _entries(rng, src.shape, sink_shape)
    while _length(entries) > MAX_INPUTS:   # narrow a full range to one index
        j = next(j for j, e in enumerate(entries) if e[0] in ("full", "win"))
        entries = entries[:j] + (("int", int(rng.integers(src.shape[j]))),) + entries[j + 1:]
    padding = None
    if _needs_padding(entries, src.shape, sink_shape) or rng.random() < 0.1:
        padding = float(rng.choice([0.0, 0.5, -1.0]))
    return entries, padding


# ---------------------------------------------------------------------- layers
def _shape(rng: np.random.Generator) -> tuple[int, ...]:
    while True:
        shape = tuple(int(d) for d in rng.choice([1, 2, 3, 4, 5, 7], size=int(rng.integers(1, 4))))
        if np.prod(shape) <= MAX_NEURONS:
            return shape


def _input_shape(rng: np.random.Generator) -> tuple[int, ...]:
    """Any small shape, a small image, or a wide image (tiled at opt level >= 2)."""
    kind = rng.choice(3, p=[0.4, 0.4, 0.2])
    if kind == 0:
        return _shape(rng)
    if kind == 1:
        return int(rng.integers(1, 4)), int(rng.integers(3, 8)), int(rng.integers(3, 8))
    return int(rng.integers(1, 3)), int(rng.choice([4, 6, 8])), WIDE


def _field_array(rng, f, shape: tuple):
    lead = {"own": shape, "lead": shape[:1], "all": (1,)}[f.share]
    if f.kind == "Batch":
        return np.zeros(shape, np.float32)
    if f.kind == "Field":
        values = rng.choice([-1.5, -0.5, 0.5, 1.0, 1.5], size=(*lead, f.length)).astype(np.float32)
    else:
        values = normal(rng, (*lead, f.length), 1.0 / np.sqrt(f.length))
    if f.share == "own":
        return values
    return (values, (lambda *i: i[0]) if f.share == "lead" else (lambda *i: 0))


def _copyable(ens) -> bool:
    """Can a generated ensemble take ``ens``'s shape? Small ones, and wide ones (whose
    windows get tiled and fused at opt levels 2 and 3)."""
    return ens.size <= MAX_NEURONS or (ens.shape[-1] >= WIDE and ens.size <= MAX_WIDE)


def _neuron(rng, net, name: str, pool: list, derived: float, pending: list):
    """A generated neuron over sources from ``pool``; in a net with time steps, perhaps with
    a last input of its own shape whose (recurrent) source is chosen later (``pending``)."""
    first = pick(rng, pool)
    if _copyable(first) and rng.random() < 0.15:
        # LRN-like: one-to-one and a window across the first dimension of the same source
        shape, sources = first.shape, [first, first]
        ident = tuple(("dim", j, 0) for j in range(len(shape)))
        conns = [(ident, None), ((("win", 0, 3, 1, 1, 1), *ident[1:]), 0.0)]
    else:
        shape = first.shape if rng.random() < 0.5 and _copyable(first) else _shape(rng)
        sources = [first]
        for _ in range(int(rng.integers(0, 3))):
            sources.append(first if rng.random() < 0.35 else pick(rng, pool))
        conns = [_connect(rng, net, s, shape) for s in sources]
        if net.time_steps > 1 and rng.random() < 0.6:
            conns.append(_connect(rng, net, _Shaped(shape), shape))
    plan = neuron_source(f"N{name}", [_length(e) for e, _ in conns], rng,
                         backward=rng.random() >= derived)
    fields = {f.name: _field_array(rng, f, shape) for f in plan.fields}
    ens = Ensemble(net, name, _cls(plan), shape, **fields)
    for s, (entries, padding) in zip(sources, conns):
        add_connections(net, s, ens, _mapping(entries), padding=padding)
    if len(conns) > len(sources):
        pending.append((ens, conns[-1]))
    return ens


@dataclass(frozen=True)
class _Shaped:
    """The shape of a recurrent source not chosen yet."""

    shape: tuple


def _recur(rng, net, pending: list, ens: list, readers: dict) -> None:
    """Connect each pending recurrent input: from its own ensemble or from one created after
    it with the same shape (a cycle through the step before, or a delayed read)."""
    for sink, (entries, padding) in pending:
        later = [e for e in ens[ens.index(sink):] if e.shape == sink.shape
                 and not isinstance(e, DataEnsemble)]
        src = pick(rng, later)
        add_connections(net, src, sink, _mapping(entries), padding=padding, recurrent=True)
        readers[src.name] += 1


def _stdlib(rng, net, name: str, kind: str, src):
    if kind == "fc":
        return FullyConnectedLayer(name, net, src, int(rng.integers(1, 8)))
    if kind == "dropout":
        drop = DropoutLayer(name, net, src, float(rng.choice([0.25, 0.5])))
        # masks from the case's own stream: the same whatever else shares the net
        drop.rng = np.random.default_rng([int(rng.integers(2**32)), 2])
        return drop
    _, h, w = src.shape
    k = int(rng.integers(1, min(h, w, 3) + 1))
    stride, pad = int(rng.integers(1, 3)), int(rng.integers(0, min(k, 2)))
    if kind == "conv":
        return ConvolutionLayer(name, net, src, int(rng.integers(1, 5)), k, stride, pad)
    layer = MaxPoolingLayer if kind == "maxpool" else MeanPoolingLayer
    return layer(name, net, src, k, stride, pad)


def _add_layers(rng, net, prefix: str, ens: list, readers: dict, sealed: set) -> None:
    """Zero to two layers of :data:`latte.fuzz.layers.LAYERS` over the case's ensembles,
    drawn from ``rng`` (a stream of their own: the generated layers stay as they were)."""
    for i in range(int(rng.integers(0, 3))):
        pool = list(ens)   # an activation on a read source gets a copy (latte.lang.inplace)
        choices = [(layer, e) for layer in LAYERS for e in pool if layer.fits(e)]
        if not choices:
            return
        layer, src = pick(rng, choices)
        new = layer.build(rng, net, f"{prefix}x{i}{layer.name}", src, pool)
        for s in sources(net, new):   # a layer may add helpers (softmax's log-sum-exp)
            readers[s.name] = readers.get(s.name, 0) + 1
        if isinstance(new, ActivationEnsemble):
            sealed.add(new.source.name)
        readers[new.name] = 0
        ens.append(new)


def _add_gathered(rng, net, prefix: str, inputs: list, ens: list, readers: dict) -> None:
    """In a tenth of the cases with a wide image input: a 1x1 convolution to 8-9 channels,
    half of the time a 2x2 max pooling, a same-size 3x3 convolution into 8-9 channels (its
    input gradient a gather through Winograd's transforms at level 2+), and half of the
    time a ReLU and another 3x3 convolution (at level 3 a skewed fused group, whose gather
    reads the output gradient a tile ahead). Drawn from a stream of its own: the case's
    other ensembles stay as they were."""
    wide = [e for e in inputs if len(e.shape) == 3 and e.shape[1] >= 4 and e.shape[2] >= 64]
    if not wide or rng.random() >= 0.1:
        return
    src = pick(rng, wide)
    top = ConvolutionLayer(f"{prefix}g1x1", net, src, int(rng.integers(8, 10)), 1)
    if rng.random() < 0.5:
        top = MaxPoolingLayer(f"{prefix}gpool", net, top, 2)
    top = ConvolutionLayer(f"{prefix}g3x3", net, top, int(rng.integers(8, 10)), 3, pad=1,
                           bias=bool(rng.random() < 0.5))
    if rng.random() < 0.5:
        top = ConvolutionLayer(f"{prefix}gnext", net, ReLULayer(f"{prefix}grelu", net, top),
                               int(rng.integers(1, 3)), 3, pad=1)
    readers[src.name] += 1
    readers[top.name] = 0
    ens.append(top)


def _add_small_windows(rng, net, prefix: str, case: Case, ens: list, readers: dict) -> None:
    """In a sixth of the cases: an input of 8-11 channels at 5-9 rows and columns (too few
    2x2 tiles for a Winograd product of its own), a same-size 3x3 convolution into 8-10
    channels and, half of the time, a ReLU and another one: at level 2+, where the batch's
    items have enough tiles together, their products (forward, input and weight gradients)
    are shared across items. Drawn from a stream of its own: the case's other ensembles stay
    as they were."""
    if rng.random() >= 1 / 6:
        return
    shape = (int(rng.integers(8, 12)), int(rng.integers(5, 10)), int(rng.integers(5, 10)))
    src = MemoryDataLayer(net, f"{prefix}small", shape)
    case.inputs.append(src)
    top = ConvolutionLayer(f"{prefix}s3x3", net, src, int(rng.integers(8, 11)), 3, pad=1,
                           bias=bool(rng.random() < 0.5))
    if rng.random() < 0.5:
        top = ConvolutionLayer(f"{prefix}snext", net, ReLULayer(f"{prefix}srelu", net, top),
                               int(rng.integers(8, 11)), 3, pad=1)
    readers[src.name], readers[top.name] = 1, 0
    ens.append(top)


def _add_row_tiles(rng, net, prefix: str, case: Case, ens: list, readers: dict) -> None:
    """In a sixth of the cases: an input of 2-3 channels, 6 or 10 rows and :data:`WIDE`
    columns, a 5x5 convolution (Winograd takes none) into 2-4 channels and, half of the
    time, a ReLU (a fused group at level 3): its tiles may be 2, 3 or 6 rows high (2, 5 or
    10), and where the batch's tiles do not share out evenly among the threads the heights
    that do are taken (:func:`~latte.compiler.passes.tiling.balanced`). Drawn from a
    stream of its own: the case's other ensembles stay as they were."""
    if rng.random() >= 1 / 6:
        return
    src = MemoryDataLayer(net, f"{prefix}rows", (int(rng.integers(2, 4)),
                                                 int(rng.choice([6, 10])), WIDE))
    case.inputs.append(src)
    top = ConvolutionLayer(f"{prefix}r5x5", net, src, int(rng.integers(2, 5)), 5, pad=2)
    if rng.random() < 0.5:
        top = ReLULayer(f"{prefix}rrelu", net, top)
    readers[src.name], readers[top.name] = 1, 0
    ens.append(top)


def _add_copied_rows(rng, net, prefix: str, case: Case, ens: list, readers: dict) -> None:
    """In a sixth of the cases: an input of 2-3 channels (Winograd takes none), 10x10 or
    9x11 (windows' rows off a vector's boundary) or 2x512 (tiles of a row, 2 KiB), and a 3x3
    convolution into 32 channels (rows of A for 4 row blocks and more):
    the micro-kernel copies its window matrix to realigned rows a block of ``k`` at a time
    (:func:`~latte.compiler.microkernel.realigned`). Drawn from a stream of its own: the
    case's other ensembles stay as they were."""
    if rng.random() >= 1 / 6:
        return
    rows, cols = [(10, 10), (9, 11), (2, 512)][int(rng.integers(3))]
    src = MemoryDataLayer(net, f"{prefix}copied", (int(rng.integers(2, 4)), rows, cols))
    case.inputs.append(src)
    top = ConvolutionLayer(f"{prefix}c3x3", net, src, 32, 3, pad=1)
    readers[src.name], readers[top.name] = 1, 0
    ens.append(top)


def _add_embedding(rng, net, prefix: str, case: Case, ens: list, readers: dict) -> None:
    """In a fifth of the cases: a table lookup (vocabularies across the lookup's blocks of
    16 rows) over an input of ids, fed as class indices are. Drawn from a stream of its own:
    the case's other ensembles stay as they were."""
    if rng.random() >= 0.2:
        return
    vocab = int(rng.integers(2, 40))
    ids = MemoryDataLayer(net, f"{prefix}ids", (1,))
    case.labels.append((ids, vocab))
    new = EmbeddingLayer(f"{prefix}emb", net, ids, vocab, int(rng.integers(1, 20)))
    readers[ids.name], readers[new.name] = 1, 0
    ens.append(new)


def build_case(net, seed: int, loss: Callable | None = None, derived: float = 0.0) -> Case:
    """Add case ``seed`` to ``net``: inputs, 2-4 layers, and a loss on every ensemble no
    layer reads. ``loss(net, name, ens)`` adds a loss over ``ens`` (default: softmax
    cross-entropy against a label input); losses alternate with it when given. A fraction
    ``derived`` of the generated neurons have no ``backward`` (the compiler derives it)."""
    rng = np.random.default_rng(seed)
    case = Case(seed)
    p = f"c{seed}_"
    for i in range(int(rng.integers(1, 3))):
        case.inputs.append(MemoryDataLayer(net, f"{p}in{i}", _input_shape(rng)))
    ens = list(case.inputs)
    readers = {e.name: 0 for e in ens}
    sealed: set[str] = set()   # sources of in-place activations: nothing else may read them
    pending: list = []         # recurrent inputs whose source is chosen at the end

    for i in range(int(rng.integers(2, 5))):
        pool = [e for e in ens if e.name not in sealed]
        cubes = [e for e in pool if len(e.shape) == 3 and min(e.shape[1:]) >= 2]
        free = [e for e in pool if readers[e.name] == 0 and not isinstance(e, DataEnsemble)
                and not isinstance(e, ActivationEnsemble)]
        kinds = ["neuron"] * 5 + ["fc", "dropout"] + (["conv", "maxpool", "meanpool"] if cubes else [])
        kinds += ["act", "stdact"] if free else []
        kind = str(rng.choice(kinds))
        name = f"{p}{i}{kind}"
        if kind == "neuron":
            new = _neuron(rng, net, name, pool, derived, pending)
            srcs = [c.source for c in net.connections_into(new)]
        elif kind in ("act", "stdact"):
            src = pick(rng, free)
            if kind == "act":
                act = str(rng.choice(sorted(ACTIVATIONS)))
                plan = activation_source(f"A{name}", act)
                fields = {f.name: _field_array(rng, f, src.shape) for f in plan.fields}
                new = ActivationEnsemble(net, name, _cls(plan), src, **fields)
            else:
                new = [ReLULayer, TanhLayer, SigmoidLayer][int(rng.integers(3))](name, net, src)
            srcs = [src]
            sealed.add(src.name)
        else:
            src = pick(rng, cubes if kind in ("conv", "maxpool", "meanpool") else pool)
            new = _stdlib(rng, net, name, kind, src)
            srcs = [src]
        for s in srcs:
            readers[s.name] += 1
        readers[new.name] = 0
        ens.append(new)
    _recur(rng, net, pending, ens, readers)
    _add_layers(np.random.default_rng([seed, 5]), net, p, ens, readers, sealed)
    _add_gathered(np.random.default_rng([seed, 13]), net, p, case.inputs, ens, readers)
    _add_embedding(np.random.default_rng([seed, 17]), net, p, case, ens, readers)
    _add_small_windows(np.random.default_rng([seed, 19]), net, p, case, ens, readers)
    _add_row_tiles(np.random.default_rng([seed, 23]), net, p, case, ens, readers)
    _add_copied_rows(np.random.default_rng([seed, 29]), net, p, case, ens, readers)
    sinks = [e for e in ens if readers[e.name] == 0 and e.name not in sealed
             and not isinstance(e, DataEnsemble)]
    for j, e in enumerate(sinks):
        if loss is not None and rng.random() < 0.5:
            loss(net, f"{p}loss{j}", e)
        else:
            label = MemoryDataLayer(net, f"{p}label{j}", (1,))
            case.labels.append((label, e.size))
            SoftmaxLossLayer(f"{p}loss{j}", net, e, label)
    case.ensembles = [e for e in net.ensembles if case_of(e.name) == seed]
    return case
