"""The op table: each supported ONNX operator as stdlib layers.

``OPS[op_type](imp, node, ins, at)`` builds the layers for ``node`` (``ins``: its inputs as
Tensors, constants or None; ``at``: its attributes) and returns its outputs. Parameters
are written into the layers' initial arrays, so the net may still grow (a loss layer)
before it is compiled. Attribute values latte cannot express are errors naming the node.
"""

from __future__ import annotations

import math

import numpy as np

import latte.stdlib as L
from latte.onnx.graph import Importer, Tensor
from latte.onnx.layers import ConstantLayer

OPS: dict = {}


def op(*names: str):
    def register(fn):
        for name in names:
            OPS[name] = fn
        return fn
    return register


def load(imp: Importer, node, ens, field: str, values: np.ndarray) -> None:
    """Write ``values`` (any shape of the right size) into ``ens``'s initial ``field``."""
    array = ens.fields[field].array
    if np.size(values) != array.size:
        raise imp.error(node, f"{field} has {np.size(values)} values, the layer needs "
                        f"{array.size} {tuple(ens.fields[field].given_shape)}")
    array[...] = np.asarray(values, np.float32).reshape(array.shape)


# ---------------------------------------------------------------- windows
def window(imp: Importer, node, at: dict, x: Tensor, kernel) -> tuple:
    """``(kernel, strides, pads, dilations)`` of a 2-D Conv or pooling node: symmetric pads
    only (latte pads both sides alike); ``auto_pad`` resolved; ``ceil_mode`` accepted where it
    gives the floor rule's size."""
    kernel = tuple(int(k) for k in kernel)
    if len(kernel) != 2:
        raise imp.error(node, f"only 2-D windows are supported, got kernel {kernel}")
    strides = tuple(at.get("strides", (1, 1)))
    dilations = tuple(at.get("dilations", (1, 1)))
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilations)]
    auto = at.get("auto_pad", b"NOTSET").decode()
    if auto == "NOTSET":
        pads = tuple(at.get("pads", (0, 0, 0, 0)))
    elif auto == "VALID":
        pads = (0, 0, 0, 0)
    else:   # SAME_UPPER / SAME_LOWER: output ceil(in / stride)
        total = [max((-(-n // s) - 1) * s + k - n, 0) for n, s, k in zip(x.shape[1:], strides, span)]
        pads = (total[0] // 2, total[1] // 2, total[0] - total[0] // 2, total[1] - total[1] // 2)
    if pads[:2] != pads[2:]:
        raise imp.error(node, f"asymmetric pads {list(pads)} (begin {list(pads[:2])}, end "
                        f"{list(pads[2:])}) are not supported; latte pads both sides alike")
    if at.get("ceil_mode", 0):
        for n, k, s, p in zip(x.shape[1:], span, strides, pads[:2]):
            if (n + 2 * p - k) % s:
                raise imp.error(node, "ceil_mode=1 gives a larger output than the floor rule "
                                "here, which latte does not support")
    return kernel, strides, pads[:2], dilations


@op("Conv")
def conv(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0], 3)
    w = imp.constant(node, ins[1], "the weights")
    b = None if len(ins) < 3 or ins[2] is None else imp.constant(node, ins[2], "the bias")
    if w.ndim != 4:
        raise imp.error(node, f"only 2-D convolutions are supported, weights are {w.shape}")
    kernel, strides, pads, dilations = window(imp, node, at, x, at.get("kernel_shape", w.shape[2:]))
    groups = int(at.get("group", 1))
    if w.shape[1] * groups != x.shape[0] or kernel != w.shape[2:]:
        raise imp.error(node, f"weights {w.shape} do not fit {groups} group(s) over "
                        f"{x.shape[0]} channels with kernel {kernel}")
    ens = L.ConvolutionLayer(imp.fresh(node), imp.net, imp.ensemble(node, x), w.shape[0], kernel,
                             strides, pads, dilation=dilations, groups=groups, bias=b is not None)
    load(imp, node, ens, "weights", w)
    if b is not None:
        load(imp, node, ens, "bias", b)
    return [Tensor(ens, ens.shape)]


@op("MaxPool", "AveragePool")
def pool(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0], 3)
    if "kernel_shape" not in at:
        raise imp.error(node, "kernel_shape is required")
    kernel, strides, pads, dilations = window(imp, node, at, x, at["kernel_shape"])
    if dilations != (1, 1):
        raise imp.error(node, f"dilated pooling ({list(dilations)}) is not supported")
    if len(node.output) > 1 and node.output[1] in imp.live:
        raise imp.error(node, "the Indices output is not supported")
    args = (imp.fresh(node), imp.net, imp.ensemble(node, x), kernel, strides, pads)
    if node.op_type == "MaxPool":
        ens = L.MaxPoolingLayer(*args)
    else:   # ONNX's default divides by the values inside the input only
        ens = L.MeanPoolingLayer(*args, count_include_pad=bool(at.get("count_include_pad", 0)))
    return [Tensor(ens, ens.shape)]


@op("GlobalAveragePool", "GlobalMaxPool")
def global_pool(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0], 3)
    ens, name = imp.ensemble(node, x), imp.fresh(node)
    if node.op_type == "GlobalMaxPool":
        ens = L.MaxPoolingLayer(name, imp.net, ens, x.shape[1:])
    else:
        ens = L.GlobalAveragePoolingLayer(name, imp.net, ens)
    return [Tensor(ens, (x.shape[0], 1, 1))]


@op("ReduceMean")
def reduce_mean(imp: Importer, node, ins: list, at: dict) -> list:
    """A mean over the two spatial axes of a ``(N, C, H, W)`` input: global average pooling."""
    x = imp.tensor(node, ins[0], 3)
    axes = at.get("axes")
    if len(ins) > 1 and ins[1] is not None:
        axes = imp.constant(node, ins[1], "axes").tolist()
    if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
        raise imp.error(node, f"only a mean over the spatial axes (2, 3) is supported, got {axes}")
    ens = L.GlobalAveragePoolingLayer(imp.fresh(node), imp.net, imp.ensemble(node, x))
    return [Tensor(ens, (x.shape[0], 1, 1) if at.get("keepdims", 1) else (x.shape[0],))]


# ---------------------------------------------------------------- dense
def dense(imp: Importer, node, x: Tensor, weights: np.ndarray, bias) -> Tensor:
    """A fully connected layer over ``x`` (read flat) with ``weights (M, K)``."""
    if weights.ndim != 2 or weights.shape[1] != x.ens.size:
        raise imp.error(node, f"weights {weights.shape} do not fit an input of "
                        f"{x.ens.size} values per sample")
    ens = L.FullyConnectedLayer(imp.fresh(node), imp.net, x.ens, weights.shape[0])
    load(imp, node, ens, "weights", weights)
    load(imp, node, ens, "bias", np.zeros(weights.shape[0]) if bias is None else bias)
    return Tensor(ens, ens.shape)


@op("Gemm")
def gemm(imp: Importer, node, ins: list, at: dict) -> list:
    if at.get("transA", 0):
        raise imp.error(node, "transA=1 would transpose the batch dimension")
    x = imp.tensor(node, ins[0], 1)
    b = imp.constant(node, ins[1], "B (the weights)")
    w = (b if at.get("transB", 0) else b.T) * float(at.get("alpha", 1.0))
    bias = None
    if len(ins) > 2 and ins[2] is not None:
        c = imp.constant(node, ins[2], "C (the bias)")
        if c.ndim == 2 and c.shape[0] != 1:
            raise imp.error(node, f"C {c.shape} differs per batch item; only a bias row is supported")
        bias = np.broadcast_to(c.reshape(-1), (w.shape[0],)) * float(at.get("beta", 1.0))
    return [dense(imp, node, x, w, bias)]


@op("MatMul")
def matmul(imp: Importer, node, ins: list, at: dict) -> list:
    if not isinstance(ins[0], Tensor) or not isinstance(ins[1], np.ndarray):
        raise imp.error(node, "only (computed 2-D input) @ (constant matrix) is supported")
    out = dense(imp, node, imp.tensor(node, ins[0], 1), ins[1].T, None)
    imp.unbiased[node.output[0]] = out.ens   # a following Add of a constant becomes its bias
    return [out]


# ---------------------------------------------------------------- element-wise
@op("Add", "Sub", "Mul", "Div")
def arithmetic(imp: Importer, node, ins: list, at: dict) -> list:
    a, b = ins
    kind = node.op_type
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if kind not in ("Add", "Mul") or a.shape != b.shape:
            raise imp.error(node, f"{kind} of two computed tensors needs Add or Mul of equal "
                            f"shapes, got {('N', *a.shape)} and {('N', *b.shape)}")
        layer = L.AddLayer if kind == "Add" else L.MulLayer
        same = a.ens.shape == b.ens.shape
        ea, eb = (a.ens, b.ens) if same else (imp.ensemble(node, a), imp.ensemble(node, b))
        ens = layer(imp.fresh(node), imp.net, ea, eb)
        return [Tensor(ens, a.shape)]
    if not isinstance(a, Tensor):
        if kind in ("Sub", "Div"):
            raise imp.error(node, f"constant {kind} computed tensor is not supported")
        a, b = b, a
    c = imp.constant(node, b, "the second operand").astype(np.float64)
    rank = len(a.shape) + 1
    if c.ndim > rank:
        raise imp.error(node, f"constant {c.shape} has more dimensions than the input")
    full = c.reshape((1,) * (rank - c.ndim) + c.shape)
    if full.shape[0] != 1 or any(n not in (1, d) for n, d in zip(full.shape[1:], a.shape)):
        raise imp.error(node, f"constant {c.shape} does not broadcast over the sample shape "
                        f"{a.shape} (it may not vary along the batch or grow the input)")
    c = full[0]
    if kind == "Add" and c.size == a.ens.shape[0] and imp.fold_bias(node, c):
        return [a]
    field = "shift" if kind in ("Add", "Sub") else "scale"
    c = {"Sub": -c, "Div": 1.0 / c}.get(kind, c)
    ens = a.ens if c.size == 1 else imp.ensemble(node, a)
    out = ConstantLayer(imp.fresh(node), imp.net, ens, c if c.size > 1 else c.reshape(()), field)
    return [Tensor(out, a.shape)]


@op("Relu", "LeakyRelu", "Sigmoid", "Tanh", "Elu")
def activation(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    name, net = imp.fresh(node), imp.net
    ens = {"Relu": lambda: L.ReLULayer(name, net, x.ens),
           "LeakyRelu": lambda: L.LeakyReLULayer(name, net, x.ens, float(at.get("alpha", 0.01))),
           "Sigmoid": lambda: L.SigmoidLayer(name, net, x.ens),
           "Tanh": lambda: L.TanhLayer(name, net, x.ens),
           "Elu": lambda: L.ELULayer(name, net, x.ens, float(at.get("alpha", 1.0)))}[node.op_type]()
    return [Tensor(ens, x.shape)]


@op("PRelu")
def prelu(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    slope = imp.constant(node, ins[1], "the slope")
    per_channel = slope.reshape((1,) * (len(x.shape) + 1 - slope.ndim) + slope.shape)
    if per_channel.size not in (1, x.shape[0]) or per_channel.shape[2:] != (1,) * (len(x.shape) - 1):
        raise imp.error(node, f"slope {slope.shape} is not one value per channel")
    ens = L.PReLULayer(imp.fresh(node), imp.net, imp.ensemble(node, x))
    load(imp, node, ens, "slope", np.broadcast_to(per_channel.reshape(-1), (x.shape[0],)))
    return [Tensor(ens, x.shape)]


@op("Dropout")
def dropout(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    ratio = at.get("ratio", 0.5)
    if len(ins) > 1 and ins[1] is not None:
        ratio = float(imp.constant(node, ins[1], "ratio"))
    if len(ins) > 2 and ins[2] is not None and bool(imp.constant(node, ins[2], "training_mode")):
        raise imp.error(node, "training_mode=true is not supported (latte drops in training only)")
    if len(node.output) > 1 and node.output[1] in imp.live:
        raise imp.error(node, "the mask output is not supported")
    ens = L.DropoutLayer(imp.fresh(node), imp.net, x.ens, ratio)
    return [Tensor(ens, x.shape)]


@op("Identity")
def identity(imp: Importer, node, ins: list, at: dict) -> list:
    return [ins[0]]


# ---------------------------------------------------------------- normalization
@op("BatchNormalization")
def batch_norm(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    scale, shift, mean, var = (imp.constant(node, v, what) for v, what in
                               zip(ins[1:5], ("scale", "B", "input_mean", "input_var")))
    if at.get("training_mode", 0) or not at.get("spatial", 1) or any(o in imp.live for o in node.output[1:]):
        raise imp.error(node, "only inference-mode batch normalization (one output, spatial) "
                        "is supported")
    name = imp.fresh(node)
    ens = L.BatchNormLayer(name, imp.net, imp.ensemble(node, x), eps=float(at.get("epsilon", 1e-5)),
                           momentum=1.0 - float(at.get("momentum", 0.9)))
    load(imp, node, ens, "scale", scale)
    load(imp, node, ens, "shift", shift)
    state = imp.net.state
    for key, value in ((f"{name}.running_mean", mean), (f"{name}.running_var", var)):
        if value.size != state[key].size:
            raise imp.error(node, f"{key.rsplit('.', 1)[1]} has {value.size} values for "
                            f"{state[key].size} channels")
        state[key][...] = value.reshape(state[key].shape)
    return [Tensor(ens, x.shape)]


@op("LRN")
def lrn(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    size = int(at["size"])
    if size % 2 == 0:   # ONNX puts the extra channel after c, PyTorch's (latte's) before
        raise imp.error(node, f"an even size ({size}) is not supported")
    ens = L.LRNLayer(imp.fresh(node), imp.net, imp.ensemble(node, x), size,
                     float(at.get("alpha", 1e-4)), float(at.get("beta", 0.75)),
                     float(at.get("bias", 1.0)))
    return [Tensor(ens, x.shape)]


@op("Softmax")
def softmax(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    rank = len(x.shape) + 1
    axis = int(at.get("axis", -1 if imp.opset >= 13 else 1)) % rank
    if axis == 0:
        raise imp.error(node, "a softmax across the batch is not supported")
    # over one axis (opset >= 13) or all from ``axis`` on (older): the whole sample either way
    others = x.shape[:axis - 1] + (x.shape[axis:] if imp.opset >= 13 else ())
    if math.prod(others) != 1:
        raise imp.error(node, f"softmax along axis {axis} of {('N', *x.shape)} is not over the "
                        "whole sample; only that is supported")
    ens = L.SoftmaxLayer(imp.fresh(node), imp.net, x.ens)
    return [Tensor(ens, x.shape)]


# ---------------------------------------------------------------- shapes
@op("Concat")
def concat(imp: Importer, node, ins: list, at: dict) -> list:
    xs = [imp.tensor(node, v) for v in ins]
    axis = int(at["axis"]) % (len(xs[0].shape) + 1)
    if axis == 0:
        raise imp.error(node, "a concat along the batch is not supported")
    ens = L.ConcatLayer(imp.fresh(node), imp.net, [imp.ensemble(node, x) for x in xs], axis - 1)
    return [Tensor(ens, ens.shape)]


def sample_shape(imp: Importer, node, x: Tensor, target) -> tuple[int, ...]:
    """The per-sample shape of an ONNX ``(N, *shape)`` target shape, whose first entry must
    be the batch (0, -1, the batch size or the export batch size)."""
    full = (imp.net.batch_size, *x.shape)
    dims = [full[k] if d == 0 and k < len(full) else int(d) for k, d in enumerate(target)]
    first, rest = dims[0], dims[1:]
    size = math.prod(x.shape)
    if rest.count(-1) == 1:
        known = math.prod(d for d in rest if d != -1)
        rest[rest.index(-1)] = size // known if known and size % known == 0 else -1
    ok_first = first in (imp.net.batch_size, imp.export_batch) or first == -1
    if not ok_first or -1 in rest or math.prod(rest) != size:
        raise imp.error(node, f"shape {list(target)} of {('N', *x.shape)} does not keep the "
                        "batch as the first dimension")
    return tuple(rest)


@op("Flatten")
def flatten(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    axis = int(at.get("axis", 1))
    axis += len(x.shape) + 1 if axis < 0 else 0
    if axis == 0 or math.prod(x.shape[:axis - 1]) != 1:
        raise imp.error(node, f"axis {axis} would merge the batch with other dimensions")
    return [Tensor(x.ens, (math.prod(x.shape),))]


@op("Reshape")
def reshape(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    target = imp.constant(node, ins[1], "the shape") if len(ins) > 1 else np.array(at["shape"])
    if at.get("allowzero", 0) and 0 in target:
        raise imp.error(node, "allowzero=1 with a zero in the shape is not supported")
    return [Tensor(x.ens, sample_shape(imp, node, x, target.tolist()))]


@op("Squeeze", "Unsqueeze")
def squeeze(imp: Importer, node, ins: list, at: dict) -> list:
    x = imp.tensor(node, ins[0])
    axes = at.get("axes")
    if len(ins) > 1 and ins[1] is not None:
        axes = imp.constant(node, ins[1], "axes").tolist()
    shape = list(x.shape)
    if node.op_type == "Squeeze":
        rank = len(shape) + 1
        drop = ({a % rank for a in axes} if axes is not None
                else {k + 1 for k, d in enumerate(shape) if d == 1})
        if 0 in drop or any(shape[a - 1] != 1 for a in drop):
            raise imp.error(node, f"cannot squeeze axes {axes} of {('N', *x.shape)}")
        shape = [d for k, d in enumerate(shape, 1) if k not in drop]
    else:
        rank = len(shape) + 1 + len(axes)
        for a in sorted(a % rank for a in axes):
            if a == 0:
                raise imp.error(node, "an axis before the batch is not supported")
            shape.insert(a - 1, 1)
    return [Tensor(x.ens, tuple(shape))]
