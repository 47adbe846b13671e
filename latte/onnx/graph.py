"""Walking an ONNX graph: tensors, constants, names and errors shared by the op table.

Each ONNX tensor becomes either a constant (a numpy array: initializers, ``Constant``
nodes, and any node whose inputs are all constant, evaluated by ``onnx``'s reference
evaluator, which folds the ``Shape -> Gather -> Concat -> Reshape`` chains exporters
write) or a :class:`Tensor`: an ensemble plus the ONNX shape of one sample. The two shapes
may differ in layout only (a ``Flatten`` keeps the ensemble, a fully connected layer reads
any shape flat); :meth:`Importer.ensemble` copies into the ONNX shape where it matters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from latte.errors import ModelImportError
from latte.onnx.layers import ReshapeLayer


@dataclass(frozen=True)
class Tensor:
    """An ONNX tensor computed by the net: ``ens``'s values seen in ONNX's sample ``shape``."""

    ens: object
    shape: tuple[int, ...]


def _name(raw: str) -> str:
    """An ONNX name as an ensemble name: ``/layer1/conv/Conv`` -> ``layer1_conv_Conv``."""
    return re.sub(r"[^0-9A-Za-z_.]+", "_", raw).strip("_") or "node"


def describe(node) -> str:
    """How errors name a node: its name (or first output) and op type."""
    label = node.name or (node.output[0] if node.output else "")
    return f"ONNX node {label!r} ({node.op_type})"


class Importer:
    """The state of one import: the net, what every ONNX tensor name stands for, the batch
    size the graph was exported with (a ``Reshape`` may spell the batch as that number)."""

    def __init__(self, net, onnx_module, opsets, export_batch: int | None):
        self.net, self.onnx, self.opsets, self.export_batch = net, onnx_module, opsets, export_batch
        self.values: dict[str, Tensor | np.ndarray] = {}
        self.used: set[str] = set()
        self.copies: dict[tuple, object] = {}   # (ensemble name, shape) -> its reshaped copy
        self.unbiased: dict[str, object] = {}   # MatMul output -> its fully connected layer
        self.live: set[str] = set()             # tensor names the graph's outputs need
        self.readers: dict[str, int] = {}       # tensor name -> live nodes and outputs reading it
        self.opset = next((o.version for o in opsets if o.domain in ("", "ai.onnx")), 1)

    # ------------------------------------------------------------ per node
    def error(self, node, message: str) -> ModelImportError:
        return ModelImportError(f"{describe(node)}: {message}")

    def fresh(self, node, suffix: str = "") -> str:
        """An unused ensemble name for (a part of) ``node`` (a node or a tensor name)."""
        label = node if isinstance(node, str) else node.name or node.output[0]
        base = _name(label + suffix)
        name, k = base, 1
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name

    def inputs(self, node) -> list:
        """``node``'s inputs: a Tensor, a constant, or None for an omitted optional one."""
        out = []
        for name in node.input:
            if name and name not in self.values:
                raise self.error(node, f"input {name!r} is not produced by any earlier node")
            out.append(self.values[name] if name else None)
        return out

    def attrs(self, node) -> dict:
        return {a.name: self.onnx.helper.get_attribute_value(a) for a in node.attribute}

    def constant(self, node, value, what: str) -> np.ndarray:
        """``value`` as a constant, or an error: latte needs ``what`` known at import."""
        if not isinstance(value, np.ndarray):
            raise self.error(node, f"{what} must be a constant (an initializer), not computed")
        return value

    def tensor(self, node, value, rank: int | None = None) -> Tensor:
        """``value`` as a computed Tensor of ``rank`` sample dimensions (any when None)."""
        if not isinstance(value, Tensor):
            raise self.error(node, "the data input must be computed from the graph's inputs, "
                             "not a constant")
        if rank is not None and len(value.shape) != rank:
            raise self.error(node, f"needs a {rank + 1}-D input (batch first), got "
                             f"{len(value.shape) + 1}-D {('N', *value.shape)}")
        return value

    def ensemble(self, node, t: Tensor):
        """An ensemble whose shape is ``t``'s ONNX shape: ``t.ens`` or a reshaped copy."""
        if tuple(t.ens.shape) == t.shape:
            return t.ens
        key = (t.ens.name, t.shape)
        if key not in self.copies:
            self.copies[key] = ReshapeLayer(self.fresh(node, "_reshape"), self.net, t.ens, t.shape)
        return self.copies[key]

    def fold_bias(self, node, bias: np.ndarray) -> bool:
        """``MatMul`` then ``Add`` of a constant (how exporters may write a linear layer): the
        constant becomes the fully connected layer's bias when nothing else reads the
        product. False where it does not apply."""
        name = next((n for n in node.input if n in self.unbiased), None)
        if name is None or self.readers[name] != 1:
            return False
        array = self.unbiased.pop(name).fields["bias"].array
        array[...] = bias.reshape(array.shape)
        return True

    def fold(self, node, consts: list) -> list[np.ndarray]:
        """Evaluate a node whose inputs are all constants (at the model's opsets)."""
        from onnx.reference import ReferenceEvaluator
        helper, undefined = self.onnx.helper, self.onnx.TensorProto.UNDEFINED
        names = [n for n in dict.fromkeys(node.input) if n]
        graph = helper.make_graph(
            [node], "fold", [helper.make_tensor_value_info(n, undefined, None) for n in names],
            [helper.make_tensor_value_info(n, undefined, None) for n in node.output])
        try:
            outs = ReferenceEvaluator(helper.make_model(graph, opset_imports=self.opsets)).run(
                None, {n: v for n, v in zip(node.input, consts) if n})
        except Exception as exc:  # noqa: BLE001 - any failure of the evaluator is the model's
            raise self.error(node, f"cannot evaluate it on constants: {exc}") from None
        return [np.asarray(v) for v in outs]
