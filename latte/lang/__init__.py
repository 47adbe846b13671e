"""The latte language: neurons, ensembles, connections. Knows nothing of compiler or runtime."""

from latte.lang.connection import Connection, add_connections
from latte.lang.ensemble import (
                                 ActivationEnsemble,
                                 BaseEnsemble,
                                 DataEnsemble,
                                 Ensemble,
                                 FieldData,
                                 NormalizationEnsemble,
                                 readers,
                                 sources,
)
from latte.lang.graph import Graph, Phase
from latte.lang.neuron import (
    Batch,
    Field,
    FieldKind,
    FieldSpec,
    Neuron,
    Param,
    defines_backward,
    field_specs,
)

__all__ = ["ActivationEnsemble", "BaseEnsemble", "Batch", "Connection", "DataEnsemble",
           "Ensemble", "Field", "FieldData", "FieldKind", "FieldSpec", "Graph",
           "NormalizationEnsemble", "Neuron", "Param", "Phase", "add_connections", "defines_backward",
           "field_specs", "readers", "sources"]
