"""Training curves from a run's logs (``latte plot LOG.csv``; ``latte run`` draws
``curves.png`` beside ``log.csv``): the training loss per iteration with the test loss per
epoch, and the test accuracy per epoch. matplotlib is optional (``pip install latte[plot]``);
drawing uses its Agg canvas, never a window, and leaves pyplot's state alone."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from latte.compiler.cache import write_atomic
from latte.errors import LatteError
from latte.solvers import log as logs

CURVES = "curves.png"


def plot(log_path, output=None) -> Path:
    """Draw the curves of the log at ``log_path`` into the PNG ``output`` (default:
    ``curves.png`` beside the log); returns its path. Errors (a
    :class:`~latte.errors.LatteError`) name the file when the log is unreadable or
    matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 - an optional dependency
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    except ImportError:
        raise LatteError("latte plot needs matplotlib: pip install matplotlib (or "
                         "latte[plot])") from None
    curves = logs.read(log_path)
    output = Path(output) if output is not None else Path(log_path).with_name(CURVES)
    e = curves.epochs
    has_accuracy = bool(np.isfinite(e.test_accuracy).any())
    fig = Figure(figsize=(11 if has_accuracy else 6.5, 4.2), layout="constrained")
    axes = fig.subplots(1, 2 if has_accuracy else 1, squeeze=False)[0]
    loss = axes[0]
    if len(curves.iterations):
        loss.plot(curves.iterations, curves.train_loss, lw=0.8, alpha=0.8,
                  label="training loss (per iteration)")
    else:   # a log without iterations.csv: each epoch's last training loss
        loss.plot(e.iteration, e.train_loss, "o-", label="training loss (end of epoch)")
    if np.isfinite(e.test_loss).any():
        loss.plot(e.iteration, e.test_loss, "s-", label="test loss (per epoch)")
    loss.set(xlabel="iteration", ylabel="loss", title="loss")
    loss.grid(alpha=0.3)
    loss.legend()
    if has_accuracy:
        acc = axes[1]
        acc.plot(e.epoch + 1, 100 * e.test_accuracy, "o-", color="C2")
        acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
        acc.xaxis.set_major_locator(MaxNLocator(integer=True))
        acc.grid(alpha=0.3)
    fig.suptitle(str(Path(log_path)))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    try:
        write_atomic(output, png.getvalue())
    except OSError as exc:
        raise LatteError(f"cannot write {str(output)!r}: {exc}") from None
    return output


def draw_beside(log_path) -> Path | None:
    """``curves.png`` beside ``log_path``, when matplotlib is installed (None otherwise)."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return None
    return plot(log_path)
