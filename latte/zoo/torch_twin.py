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
    it runs the steps in the order they were added and returns ``self.output``'s value."""

    def __init__(self, input_shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype
        self.input = Node("data", tuple(input_shape))
        self.output: Node | None = None
        self.layers = nn.ModuleDict()
        self.steps: list[tuple[Node, Callable, list[Node]]] = []
        self.params: dict[str, torch.Tensor] = {}   # latte name -> torch parameter
        self.state: dict[str, torch.Tensor] = {}    # latte name -> torch buffer

    def add(self, name: str, shape, fn: Callable, inputs: list[Node],
            module: nn.Module | None = None, params: dict[str, str] | None = None,
            state: dict[str, str] | None = None) -> Node:
        """A step ``fn(*inputs)`` producing ``name``; ``module`` (if any) is registered, and
        its tensors ``params`` / ``state`` (latte field -> torch attribute) named for latte."""
        if module is not None:
            self.layers[name] = module.to(self.dtype)
            for field, attr in (params or {}).items():
                self.params[f"{name}.{field}"] = getattr(module, attr)
            for field, attr in (state or {}).items():
                self.state[f"{name}.{field}"] = getattr(module, attr)
        node = Node(name, tuple(int(d) for d in shape))
        self.steps.append((node, fn, list(inputs)))
        return node

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = {self.input.name: x}
        for node, fn, inputs in self.steps:
            values[node.name] = fn(*(values[i.name] for i in inputs))
        return values[self.output.name]

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
        return {name: t.grad.detach().numpy().astype(np.float64)
                for name, t in self.params.items()}


def _spatial(name: str, net: TwinNet, x: Node, module: nn.Module, channels: int,
             kernel, stride, pad, dilation=1, **tensors) -> Node:
    """A step of a window over ``x``'s ``(H, W)``: the output shape by the floor rule."""
    pair = lambda v: (v, v) if np.ndim(v) == 0 else tuple(v)  # noqa: E731
    (kh, kw), (sy, sx), (py, px), (dy, dx) = map(pair, (kernel, stride, pad, dilation))
    h = (x.shape[1] + 2 * py - dy * (kh - 1) - 1) // sy + 1
    w = (x.shape[2] + 2 * px - dx * (kw - 1) - 1) // sx + 1
    return net.add(name, (channels, h, w), module, [x], module, **tensors)


def ConvolutionLayer(name, net: TwinNet, x: Node, n_filters, kernel, stride=1, pad=0, *,
                     dilation=1, groups=1, bias=True) -> Node:
    conv = nn.Conv2d(x.shape[0], n_filters, kernel, stride, pad, dilation, groups, bias)
    params = {"weights": "weight"} | ({"bias": "bias"} if bias else {})
    return _spatial(name, net, x, conv, n_filters, kernel, stride, pad, dilation, params=params)


def FullyConnectedLayer(name, net: TwinNet, x: Node, n_outputs) -> Node:
    fc = nn.Linear(x.size, n_outputs)
    return net.add(name, (n_outputs,), lambda v: fc(v.flatten(1)), [x], fc,
                   params={"weights": "weight", "bias": "bias"})


def MaxPoolingLayer(name, net: TwinNet, x: Node, kernel, stride=None, pad=0) -> Node:
    stride = kernel if stride is None else stride
    return _spatial(name, net, x, nn.MaxPool2d(kernel, stride, pad), x.shape[0], kernel,
                    stride, pad)


def MeanPoolingLayer(name, net: TwinNet, x: Node, kernel, stride=None, pad=0) -> Node:
    stride = kernel if stride is None else stride
    return _spatial(name, net, x, nn.AvgPool2d(kernel, stride, pad), x.shape[0], kernel,
                    stride, pad)


def GlobalAveragePoolingLayer(name, net: TwinNet, x: Node) -> Node:
    return net.add(name, x.shape[:1], lambda v: v.mean(dim=(2, 3)), [x])


def BatchNormLayer(name, net: TwinNet, x: Node, *, eps=1e-5, momentum=0.1) -> Node:
    bn = (nn.BatchNorm2d if len(x.shape) == 3 else nn.BatchNorm1d)(x.shape[0], eps, momentum)
    return net.add(name, x.shape, bn, [x], bn, params={"scale": "weight", "shift": "bias"},
                   state={"running_mean": "running_mean", "running_var": "running_var"})


def LRNLayer(name, net: TwinNet, x: Node, size=5, alpha=1e-4, beta=0.75, k=1.0) -> Node:
    lrn = nn.LocalResponseNorm(size, alpha, beta, k)
    return net.add(name, x.shape, lrn, [x], lrn)


def ReLULayer(name, net: TwinNet, x: Node) -> Node:
    return net.add(name, x.shape, F.relu, [x])


def DropoutLayer(name, net: TwinNet, x: Node, ratio=0.5) -> Node:
    drop = nn.Dropout(ratio)
    return net.add(name, x.shape, drop, [x], drop)


def AddLayer(name, net: TwinNet, a: Node, b: Node) -> Node:
    return net.add(name, a.shape, torch.add, [a, b])


def ConcatLayer(name, net: TwinNet, inputs: list[Node], axis=0) -> Node:
    shape = list(inputs[0].shape)
    shape[axis] = sum(i.shape[axis] for i in inputs)
    return net.add(name, shape, lambda *vs: torch.cat(vs, dim=axis + 1), inputs)
