"""latte: a language, compiler and runtime for deep neural networks."""

from latte.lang import (
                        ActivationEnsemble,
                        Batch,
                        Ensemble,
                        Field,
                        Neuron,
                        NormalizationEnsemble,
                        Param,
                        Phase,
                        add_connections,
)
from latte.net import Net

__all__ = ["ActivationEnsemble", "Batch", "Ensemble", "Field", "Net", "Neuron",
           "NormalizationEnsemble", "Param", "Phase", "add_connections"]
__version__ = "0.1.0"
