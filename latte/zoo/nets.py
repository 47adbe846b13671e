"""The zoo's architectures, each written once against the stdlib's layer functions.

Every function takes the net, its input ensemble and the number of classes and returns the
logits ensemble (the caller adds the loss). ``lib`` is where the layer functions come from:
``latte.stdlib`` builds a latte net; :mod:`latte.zoo.torch_twin` (same names, same
signatures) builds the same graph in PyTorch with the same parameter names, which is how the
tests and the benchmark get a twin. ``width`` scales every channel count and hidden width
(the tests build narrow nets of the same topology); ``dropout=0`` leaves dropout layers out.
"""

from __future__ import annotations

from types import ModuleType

import latte.stdlib as stdlib


def scaled(n: int, width: float, multiple: int = 1) -> int:
    """``n * width`` rounded to a positive multiple of ``multiple`` (grouped convolutions
    need channel counts divisible by their groups)."""
    return max(multiple, round(n * width / multiple) * multiple)


def _dropout(lib: ModuleType, name: str, net, x, ratio: float):
    return lib.DropoutLayer(name, net, x, ratio) if ratio > 0 else x


def _conv_relu(lib: ModuleType, name: str, net, x, n: int, kernel: int, stride: int = 1,
               pad: int = 0, groups: int = 1):
    conv = lib.ConvolutionLayer(name, net, x, n, kernel, stride, pad, groups=groups)
    return lib.ReLULayer(f"{name}_relu", net, conv)


def _classifier(lib: ModuleType, net, x, hidden: tuple[int, ...], n_classes: int,
                dropout: float, first: int):
    """FC + ReLU (+ dropout) per hidden width, named ``fc{first}``, ``fc{first+1}``..., then
    the logits ``fc{first+len(hidden)}``."""
    for i, units in enumerate(hidden, first):
        x = lib.ReLULayer(f"fc{i}_relu", net, lib.FullyConnectedLayer(f"fc{i}", net, x, units))
        x = _dropout(lib, f"fc{i}_drop", net, x, dropout)
    return lib.FullyConnectedLayer(f"fc{first + len(hidden)}", net, x, n_classes)


def alexnet(net, x, n_classes: int, *, width: float = 1.0, dropout: float = 0.5,
            lib: ModuleType = stdlib):
    """Krizhevsky et al.'s AlexNet as Caffe's bvlc_alexnet: five convolutions (the 2nd, 4th
    and 5th in two groups), local response normalization after the first two, three 3x3
    stride-2 max poolings, FC 4096-4096. Inputs of at least 67x67 (227 as published)."""
    c = lambda n: scaled(n, width, 2)  # noqa: E731
    x = _conv_relu(lib, "conv1", net, x, c(96), 11, 4)
    x = lib.LRNLayer("norm1", net, x, 5, 1e-4, 0.75)
    x = lib.MaxPoolingLayer("pool1", net, x, 3, 2)
    x = _conv_relu(lib, "conv2", net, x, c(256), 5, pad=2, groups=2)
    x = lib.LRNLayer("norm2", net, x, 5, 1e-4, 0.75)
    x = lib.MaxPoolingLayer("pool2", net, x, 3, 2)
    x = _conv_relu(lib, "conv3", net, x, c(384), 3, pad=1)
    x = _conv_relu(lib, "conv4", net, x, c(384), 3, pad=1, groups=2)
    x = _conv_relu(lib, "conv5", net, x, c(256), 3, pad=1, groups=2)
    x = lib.MaxPoolingLayer("pool5", net, x, 3, 2)
    return _classifier(lib, net, x, (c(4096), c(4096)), n_classes, dropout, 6)


VGG16 = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


def vgg16(net, x, n_classes: int, *, width: float = 1.0, dropout: float = 0.5,
          lib: ModuleType = stdlib):
    """Simonyan and Zisserman's VGG-16 (configuration D): 13 3x3 convolutions in five
    blocks, each block ending in a 2x2 max pooling, FC 4096-4096. Inputs of at least 32x32."""
    for b, block in enumerate(VGG16, 1):
        for i, channels in enumerate(block, 1):
            x = _conv_relu(lib, f"conv{b}_{i}", net, x, scaled(channels, width), 3, pad=1)
        x = lib.MaxPoolingLayer(f"pool{b}", net, x, 2)
    return _classifier(lib, net, x, (scaled(4096, width),) * 2, n_classes, dropout, 6)


def _conv_bn(lib: ModuleType, name: str, net, x, n: int, kernel: int, stride: int = 1,
             relu: bool = True):
    """Convolution without bias (``same`` padding), batch norm, optionally ReLU."""
    conv = lib.ConvolutionLayer(name, net, x, n, kernel, stride, kernel // 2, bias=False)
    bn = lib.BatchNormLayer(f"{name}_bn", net, conv)
    return lib.ReLULayer(f"{name}_relu", net, bn) if relu else bn


def _residual(lib: ModuleType, name: str, net, x, branch, stride: int):
    """``relu(branch + shortcut)``; the shortcut is ``x`` itself, or a 1x1 convolution with
    batch norm where the branch changes the shape (He et al.'s projection, option B)."""
    if branch.shape != x.shape:
        x = _conv_bn(lib, f"{name}_proj", net, x, branch.shape[0], 1, stride, relu=False)
    return lib.ReLULayer(f"{name}_relu", net, lib.AddLayer(f"{name}_add", net, branch, x))


def basic_block(lib: ModuleType, name: str, net, x, n: int, stride: int):
    """ResNet-18/34's block: two 3x3 convolutions (the first strided) around a shortcut."""
    y = _conv_bn(lib, f"{name}_conv1", net, x, n, 3, stride)
    y = _conv_bn(lib, f"{name}_conv2", net, y, n, 3, relu=False)
    return _residual(lib, name, net, x, y, stride)


def bottleneck(lib: ModuleType, name: str, net, x, n: int, stride: int):
    """ResNet-50's block: 1x1 down to ``n`` channels, 3x3 (strided, as torchvision's v1.5),
    1x1 up to ``4n``, around a shortcut."""
    y = _conv_bn(lib, f"{name}_conv1", net, x, n, 1)
    y = _conv_bn(lib, f"{name}_conv2", net, y, n, 3, stride)
    y = _conv_bn(lib, f"{name}_conv3", net, y, 4 * n, 1, relu=False)
    return _residual(lib, name, net, x, y, stride)


def _resnet(lib: ModuleType, net, x, n_classes: int, block, depths: tuple[int, ...],
            width: float):
    x = _conv_bn(lib, "conv1", net, x, scaled(64, width), 7, 2)
    x = lib.MaxPoolingLayer("pool1", net, x, 3, 2, 1)
    for stage, depth in enumerate(depths):
        for i in range(depth):
            stride = 2 if stage > 0 and i == 0 else 1
            x = block(lib, f"layer{stage + 1}_{i}", net, x, scaled(64 << stage, width), stride)
    x = lib.GlobalAveragePoolingLayer("avgpool", net, x)
    return lib.FullyConnectedLayer("fc", net, x, n_classes)


def resnet18(net, x, n_classes: int, *, width: float = 1.0, lib: ModuleType = stdlib):
    """He et al.'s ResNet-18: a 7x7 stride-2 stem, 3x3 max pooling, four stages of two basic
    blocks (64-512 channels, stride 2 from the second stage), global average pooling, FC.
    Inputs of at least 32x32."""
    return _resnet(lib, net, x, n_classes, basic_block, (2, 2, 2, 2), width)


def resnet50(net, x, n_classes: int, *, width: float = 1.0, lib: ModuleType = stdlib):
    """He et al.'s ResNet-50: ResNet-18's stem and head around 3, 4, 6 and 3 bottleneck
    blocks (256-2048 output channels). Inputs of at least 32x32."""
    return _resnet(lib, net, x, n_classes, bottleneck, (3, 4, 6, 3), width)


# GoogLeNet's inception blocks: 1x1, (1x1 reduce, 3x3), (1x1 reduce, 5x5), pool projection
INCEPTION = {"3a": (64, 96, 128, 16, 32, 32), "3b": (128, 128, 192, 32, 96, 64),
             "4a": (192, 96, 208, 16, 48, 64), "4b": (160, 112, 224, 24, 64, 64),
             "4c": (128, 128, 256, 24, 64, 64), "4d": (112, 144, 288, 32, 64, 64),
             "4e": (256, 160, 320, 32, 128, 128), "5a": (256, 160, 320, 32, 128, 128),
             "5b": (384, 192, 384, 48, 128, 128)}


def inception_block(lib: ModuleType, name: str, net, x, widths: tuple[int, ...]):
    """Four branches joined along the channels: 1x1; 1x1 then 3x3; 1x1 then 5x5; 3x3 max
    pooling (stride 1) then 1x1."""
    n1, r3, n3, r5, n5, pp = widths
    b1 = _conv_relu(lib, f"{name}_1x1", net, x, n1, 1)
    b3 = _conv_relu(lib, f"{name}_3x3", net,
                    _conv_relu(lib, f"{name}_3x3_reduce", net, x, r3, 1), n3, 3, pad=1)
    b5 = _conv_relu(lib, f"{name}_5x5", net,
                    _conv_relu(lib, f"{name}_5x5_reduce", net, x, r5, 1), n5, 5, pad=2)
    pool = lib.MaxPoolingLayer(f"{name}_pool", net, x, 3, 1, 1)
    bp = _conv_relu(lib, f"{name}_pool_proj", net, pool, pp, 1)
    return lib.ConcatLayer(f"{name}_output", net, [b1, b3, b5, bp])


def inception(net, x, n_classes: int, *, width: float = 1.0, dropout: float = 0.4,
              lib: ModuleType = stdlib):
    """Szegedy et al.'s GoogLeNet (without the auxiliary classifiers): a stem with local
    response normalization, nine inception blocks (3a-5b) between stride-2 max poolings,
    global average pooling, dropout, FC. Inputs of at least 32x32."""
    c = lambda n: scaled(n, width)  # noqa: E731
    x = _conv_relu(lib, "conv1", net, x, c(64), 7, 2, 3)
    x = lib.MaxPoolingLayer("pool1", net, x, 3, 2, 1)
    x = lib.LRNLayer("norm1", net, x, 5, 1e-4, 0.75)
    x = _conv_relu(lib, "conv2_reduce", net, x, c(64), 1)
    x = _conv_relu(lib, "conv2", net, x, c(192), 3, pad=1)
    x = lib.LRNLayer("norm2", net, x, 5, 1e-4, 0.75)
    x = lib.MaxPoolingLayer("pool2", net, x, 3, 2, 1)
    for block, widths in INCEPTION.items():
        if block in ("4a", "5a"):
            x = lib.MaxPoolingLayer(f"pool{block[0]}", net, x, 3, 2, 1)
        x = inception_block(lib, f"inception_{block}", net, x, tuple(c(n) for n in widths))
    x = lib.GlobalAveragePoolingLayer("avgpool", net, x)
    x = _dropout(lib, "avgpool_drop", net, x, dropout)
    return lib.FullyConnectedLayer("fc", net, x, n_classes)


def digits_resnet(net, x, n_classes: int, *, width: float = 1.0, lib: ModuleType = stdlib):
    """A small ResNet for 8x8 images: a 3x3 stem with batch norm, two basic blocks of 32
    channels at 8x8, two of 64 at 4x4 (the first strided, with a projection shortcut),
    global average pooling, FC."""
    x = _conv_bn(lib, "conv1", net, x, scaled(32, width), 3)
    for stage, depth in enumerate((2, 2)):
        for i in range(depth):
            stride = 2 if stage > 0 and i == 0 else 1
            x = basic_block(lib, f"layer{stage + 1}_{i}", net, x, scaled(32 << stage, width),
                            stride)
    x = lib.GlobalAveragePoolingLayer("avgpool", net, x)
    return lib.FullyConnectedLayer("fc", net, x, n_classes)


NETS = {"alexnet": alexnet, "vgg16": vgg16, "resnet18": resnet18, "resnet50": resnet50,
        "inception": inception, "digits_resnet": digits_resnet}
