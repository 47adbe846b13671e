"""A zoo net's twin in PyTorch (needs ``torch``): the layer functions of ``latte.stdlib``
under the same names and signatures, building a :class:`TwinNet` instead of a latte net.

    twin = TwinNet((3, 32, 32), dtype=torch.float64)
    twin.output = resnet18(twin, twin.input, 10, lib=torch_twin)
    twin.load_from(net)              # latte's parameters and state, by name
    logits = twin(x)

Each twin layer registers its torch tensors under latte's parameter and state names (the
only place the two naming schemes meet): ``"conv1.weights"`` is the convolution's
``weight``, ``"bn.scale"`` / ``"bn.shift"`` a batch norm's ``weight`` / ``bias``,
``"bn.running_mean"`` its buffer. Shapes are latte's (channel-first, without the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Node:
    """Stands for an ensemble: its ``name``, ``shape`` and ``size``, as a zoo net reads them."""

    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class TwinNet(nn.Module):
    """A graph of torch modules built by zoo functions in place of a latte ``Net``; calling
    it runs the steps in the order they were added and returns ``self.output``'s value.
    Steps refer to modules by name, so ``copy.deepcopy``, ``.float()`` and ``.to(...)``
    give a working twin."""

    def __init__(self, input_shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.input = Node("data", tuple(input_shape))
        self.output: Node | None = None
        self.layers = nn.ModuleDict()
        self.steps: list[tuple[Node, Callable | None, list[Node]]] = []
        self.build_dtype = dtype
        self.param_names: dict[str, tuple[str, str]] = {}   # latte name -> (layer, attribute)
        self.state_names: dict[str, tuple[str, str]] = {}

    def add(self, name: str, shape, inputs: list[Node], fn: Callable | None = None,
            module: nn.Module | None = None, params: dict[str, str] | None = None,
            state: dict[str, str] | None = None) -> Node:
        """A step computing ``name`` from ``inputs``: ``fn(*inputs)``, or ``module``
        (registered under ``name``) whose ``params`` and ``state`` (latte field -> torch
        attribute path) are named for latte."""
        if name == self.input.name or any(node.name == name for node, _, _ in self.steps):
            raise ValueError(f"a step named {name!r} already exists in this twin")
        if module is not None:
            self.layers[name] = module.to(self.build_dtype)
            self.param_names |= {f"{name}.{f}": (name, a) for f, a in (params or {}).items()}
            self.state_names |= {f"{name}.{f}": (name, a) for f, a in (state or {}).items()}
        node = Node(name, tuple(int(d) for d in shape))
        self.steps.append((node, fn, list(inputs)))
        return node

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = {self.input.name: x}
        for node, fn, inputs in self.steps:
            values[node.name] = (fn or self.layers[node.name])(*(values[i.name] for i in inputs))
        return values[self.output.name]

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' type (after ``.float()``, float32)."""
        return next(self.parameters()).dtype

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Each parameter by latte name."""
        return {k: self.layers[m].get_parameter(a) for k, (m, a) in self.param_names.items()}

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Each state buffer (batch norm's running statistics) by latte name."""
        return {k: self.layers[m].get_buffer(a) for k, (m, a) in self.state_names.items()}

    @torch.no_grad()
    def load_from(self, net) -> None:
        """Copy every parameter and state array of the latte ``net`` into the twin by name;
        each of the twin's must be there, with the same number of elements."""
        latte = {p.name: p.value for p in net.params} | dict(getattr(net, "state", {}))
        for name, tensor in self.params.items() | self.state.items():
            if name not in latte:
                raise KeyError(f"the latte net has no {name!r}")
            tensor.copy_(torch.from_numpy(np.asarray(latte[name], np.float64).reshape(
                tensor.shape)))

    def grads(self) -> dict[str, np.ndarray]:
        """Each parameter's gradient, by latte name, as a float64 array."""
        return {name: t.grad.detach().double().numpy() for name, t in self.params.items()}


def _spatial(name: str, net: TwinNet, x: Node, module: nn.Module, channels: int,
             kernel, stride, pad, dilation=1, **tensors) -> Node:
    """A step of a window over ``x``'s ``(H, W)``: the output shape by the floor rule."""
    pair = lambda v: (v, v) if np.ndim(v) == 0 else tuple(v)  # noqa: E731
    (kh, kw), (sy, sx), (py, px), (dy, dx) = map(pair, (kernel, stride, pad, dilation))
    h = (x.shape[1] + 2 * py - dy * (kh - 1) - 1) // sy + 1
    w = (x.shape[2] + 2 * px - dx * (kw - 1) - 1) // sx + 1
    return net.add(name, (channels, h, w), [x], module=module, **tensors)


def ConvolutionLayer(name, net: TwinNet, x: Node, n_filters, kernel, stride=1, pad=0, *,
                     dilation=1, groups=1, bias=True) -> Node:
    conv = nn.Conv2d(x.shape[0], n_filters, kernel, stride, pad, dilation, groups, bias)
    params = {"weights": "weight"} | ({"bias": "bias"} if bias else {})
    return _spatial(name, net, x, conv, n_filters, kernel, stride, pad, dilation, params=params)


def FullyConnectedLayer(name, net: TwinNet, x: Node, n_outputs) -> Node:
    fc = nn.Sequential(nn.Flatten(), nn.Linear(x.size, n_outputs))
    return net.add(name, (n_outputs,), [x], module=fc,
                   params={"weights": "1.weight", "bias": "1.bias"})


def MaxPoolingLayer(name, net: TwinNet, x: Node, kernel, stride=None, pad=0) -> Node:
    stride = kernel if stride is None else stride
    return _spatial(name, net, x, nn.MaxPool2d(kernel, stride, pad), x.shape[0], kernel,
                    stride, pad)


def MeanPoolingLayer(name, net: TwinNet, x: Node, kernel, stride=None, pad=0) -> Node:
    stride = kernel if stride is None else stride
    return _spatial(name, net, x, nn.AvgPool2d(kernel, stride, pad), x.shape[0], kernel,
                    stride, pad)


def GlobalAveragePoolingLayer(name, net: TwinNet, x: Node) -> Node:
    return net.add(name, x.shape[:1], [x], lambda v: v.mean(dim=(2, 3)))


def BatchNormLayer(name, net: TwinNet, x: Node, *, eps=1e-5, momentum=0.1) -> Node:
    bn = (nn.BatchNorm2d if len(x.shape) == 3 else nn.BatchNorm1d)(x.shape[0], eps, momentum)
    return net.add(name, x.shape, [x], module=bn, params={"scale": "weight", "shift": "bias"},
                   state={"running_mean": "running_mean", "running_var": "running_var"})


def LRNLayer(name, net: TwinNet, x: Node, size=5, alpha=1e-4, beta=0.75, k=1.0) -> Node:
    return net.add(name, x.shape, [x], module=nn.LocalResponseNorm(size, alpha, beta, k))


def ReLULayer(name, net: TwinNet, x: Node) -> Node:
    return net.add(name, x.shape, [x], F.relu)


def DropoutLayer(name, net: TwinNet, x: Node, ratio=0.5) -> Node:
    return net.add(name, x.shape, [x], module=nn.Dropout(ratio))


def AddLayer(name, net: TwinNet, a: Node, b: Node) -> Node:
    return net.add(name, a.shape, [a, b], torch.add)


def ConcatLayer(name, net: TwinNet, inputs: list[Node], axis=0) -> Node:
    shape = list(inputs[0].shape)
    shape[axis] = sum(i.shape[axis] for i in inputs)
    return net.add(name, shape, inputs, lambda *vs: torch.cat(vs, dim=axis + 1))
