"""The reference interpreter: runs a net straight from its lang objects, per neuron, in
float64 numpy, with no compiler involved beyond parsing neuron bodies. It is the executable
definition of the language and the oracle the compiled code is tested against.

    ref = Reference(net)
    ref.forward({"x": x}); ref.backward()
    ref.values["fc"], ref.grads["x"], ref.param_grads["fc.weights"], ref.loss
    ref.sgd_step(0.1, momentum=0.9)
"""

from latte.reference.runner import Reference

__all__ = ["Reference"]
