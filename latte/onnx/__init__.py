"""ONNX import: ``load_onnx(path, batch_size)`` builds a latte ``Net`` out of stdlib layers.

    net, inputs, outputs = load_onnx("resnet.onnx", batch_size=8)
    probs = net.predict(images)                  # (n, *outputs[-1].shape)

The graph's inputs become ``MemoryDataLayer`` ensembles (their first dimension is the
batch, the others must be fixed), each supported node the stdlib layer of the same kind
(so the compiler's GEMM matching, tiling and fusion apply as to a net written by hand), its
initializers the layer's parameters, and a batch norm's statistics ``net.state``. Nodes
that only compute on constants (shape arithmetic) are evaluated at import. The net is not
compiled yet: a loss layer may be added to train it. ``onnx`` is an optional dependency
(``pip install 'latte[onnx]'``).
"""

from __future__ import annotations

import os

import numpy as np

from latte.errors import DataError, LatteError, ModelImportError
from latte.net import Net
from latte.onnx.graph import Importer, Tensor
from latte.onnx.ops import OPS
from latte.stdlib import MemoryDataLayer

__all__ = ["OPS", "load_onnx"]


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ImportError("latte.onnx needs the onnx package: pip install 'latte[onnx]' "
                          "(or pip install onnx)") from None
    return onnx


def _read(onnx, path):
    if not os.path.exists(path):
        raise DataError(f"ONNX file {os.fspath(path)!r} does not exist")
    try:
        return onnx.load(os.fspath(path))
    except Exception as exc:  # noqa: BLE001 - protobuf's errors vary by version
        raise ModelImportError(f"{os.fspath(path)!r} is not a readable ONNX model: {exc}") from None


def _live_nodes(imp: Importer, graph) -> list:
    """The nodes the graph's outputs depend on, in graph order; fills ``imp.live`` and
    ``imp.readers``."""
    imp.live = {o.name for o in graph.output}
    imp.readers = {o.name: 1 for o in graph.output}
    nodes = []
    for node in reversed(graph.node):
        if any(o in imp.live for o in node.output):
            nodes.append(node)
            for name in node.input:
                imp.live.add(name)
                imp.readers[name] = imp.readers.get(name, 0) + 1
    return nodes[::-1]


def _input(imp: Importer, value_info) -> Tensor:
    onnx = imp.onnx
    tensor_type = value_info.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    where = f"ONNX graph input {value_info.name!r}"
    if tensor_type.elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                     onnx.TensorProto.FLOAT16):
        raise ModelImportError(f"{where}: only floating-point inputs are supported")
    if len(dims) < 2 or any(not d for d in dims[1:]):
        raise ModelImportError(f"{where}: needs a batch dimension and fixed sample dimensions, "
                               f"got {['?' if d is None else d for d in dims]}")
    ens = MemoryDataLayer(imp.net, imp.fresh(value_info.name), tuple(dims[1:]))
    return Tensor(ens, tuple(dims[1:]))


def _run(imp: Importer, node) -> list:
    ins = imp.inputs(node)
    if node.op_type == "Shape" and isinstance(ins[0], Tensor):
        shape = np.array([imp.net.batch_size, *ins[0].shape], np.int64)
        at = imp.attrs(node)
        return [shape[at.get("start", 0):at.get("end", len(shape))]]
    if not any(isinstance(v, Tensor) for v in ins):
        return imp.fold(node, ins)
    if node.domain not in ("", "ai.onnx") or node.op_type not in OPS:
        raise imp.error(node, f"unsupported operator (latte imports {', '.join(sorted(OPS))})")
    try:
        return OPS[node.op_type](imp, node, ins, imp.attrs(node))
    except ModelImportError:
        raise
    except KeyError as exc:
        raise imp.error(node, f"the required attribute {exc} is missing") from None
    except (LatteError, ValueError) as exc:
        raise imp.error(node, str(exc)) from exc


def load_onnx(path, batch_size: int, **net_kwargs) -> tuple[Net, list, list]:
    """The ONNX model at ``path`` as a ``Net(batch_size, **net_kwargs)``; returns ``(net,
    inputs, outputs)``, the ensembles of the graph's inputs and outputs in graph order.
    An operator or attribute latte cannot express is a :class:`ModelImportError` naming the
    node and its op type."""
    onnx = _onnx()
    model = _read(onnx, path)
    graph = model.graph
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    graph_inputs = [i for i in graph.input if i.name not in constants]
    first = graph_inputs[0].type.tensor_type.shape.dim if graph_inputs else []
    export_batch = first[0].dim_value if first and first[0].HasField("dim_value") else None
    imp = Importer(Net(batch_size, **net_kwargs), onnx, list(model.opset_import), export_batch)
    imp.values.update(constants)
    nodes = _live_nodes(imp, graph)
    inputs = []
    for value_info in graph_inputs:
        imp.values[value_info.name] = tensor = _input(imp, value_info)
        inputs.append(tensor.ens)
    for node in nodes:
        for name, value in zip(node.output, _run(imp, node)):
            if name:
                imp.values[name] = value
    outputs = []
    for out in graph.output:
        value = imp.values.get(out.name)
        if not isinstance(value, Tensor):
            raise ModelImportError(f"ONNX graph output {out.name!r} is a constant or not "
                                   "computed by any node")
        outputs.append(imp.ensemble(out.name, value))
    return imp.net, inputs, outputs
