"""One exception hierarchy for latte.

Every class also inherits the matching builtin, so ``except ValueError`` keeps working.
Errors raised from a neuron body carry its file and line; errors about a connection name
both ensembles.
"""

from __future__ import annotations


class LatteError(Exception):
    """Base class of every error latte raises on purpose."""


class NeuronSyntaxError(LatteError, SyntaxError):
    """A neuron's forward/backward uses a construct outside latte's neuron language."""

    def __init__(self, message: str, filename: str | None = None, lineno: int | None = None):
        where = f"{filename}:{lineno}: " if filename else ""
        super().__init__(f"{where}{message}")
        self.filename, self.lineno = filename, lineno


class MappingError(LatteError, ValueError):
    """A connection's mapping function is malformed or leaves the source ensemble."""


class ShapeError(LatteError, ValueError):
    """Shapes of connected ensembles, fields or data do not agree."""


class NeuronRuntimeError(LatteError, RuntimeError):
    """A neuron body run by the reference interpreter (``latte.reference``) indexes outside a
    vector or field, uses a non-integer index or reads a local it has not assigned."""


class CompileError(LatteError, RuntimeError):
    """The compiler cannot lower a network (an internal limit, not a user mistake)."""


class DataError(LatteError, OSError):
    """A data file is missing or malformed."""


class TrainingError(LatteError, FloatingPointError):
    """Training diverged (a NaN or infinite loss)."""


class ModelImportError(LatteError, ValueError):
    """An imported model (ONNX) is malformed or uses an operator, attribute or shape latte
    cannot express; the message names the node and its op type."""


class ExportError(LatteError, RuntimeError):
    """A net cannot be exported as a C library (``latte export``): its output needs an
    ensemble computed by Python code, or no C compiler is at hand."""


class DistributedError(LatteError, RuntimeError):
    """MPI ranks differ in what must be the same on every rank (the net, batch size, data
    sizes, epochs, seed), or a rank finished while another waits for it. ``shared``: every
    rank raised the same error."""

    def __init__(self, message: str, shared: bool = False):
        super().__init__(message)
        self.shared = shared
