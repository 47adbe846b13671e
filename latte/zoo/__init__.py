"""The model zoo: AlexNet, VGG-16, ResNet-18/50, GoogLeNet and a small ResNet for digits,
each a function that adds the architecture to a net (:mod:`latte.zoo.nets`). The examples
train them; ``tests/test_zoo.py`` compares each with its PyTorch twin
(:mod:`latte.zoo.torch_twin`); ``benchmarks/zoo.py`` times them."""

from latte.zoo.nets import NETS, alexnet, digits_resnet, inception, resnet18, resnet50, vgg16

__all__ = ["NETS", "alexnet", "digits_resnet", "inception", "resnet18", "resnet50", "vgg16"]
