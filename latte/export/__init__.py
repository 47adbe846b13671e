"""``latte export``: a trained net as a C library for inference, with no Python at run time.

:func:`export` writes ``latte_model.h`` and ``liblatte_model.so`` (with the native libraries
it calls beside it) for ``int latte_model_predict(const float *input, int n, float
*output)``, which runs the ``Phase.TEST`` forward as ``net.predict`` does. The library holds
the very object code the net runs in Python (so the results are the same, bitwise at equal
thread counts), built for this machine's CPU: export on the kind of machine it will run on.
"""

from __future__ import annotations

import os
from pathlib import Path

from latte.export.build import LIBRARY, build
from latte.export.csource import HEADER
from latte.export.image import ModelImage, model_image

__all__ = ["HEADER", "LIBRARY", "ModelImage", "export", "model_image"]


def export(net, directory, *, snapshot=None, origin: str = "a latte.Net") -> list[Path]:
    """Compile ``net`` (if it is not yet), load ``snapshot`` into it (a ``net.save`` file)
    when given, and write its inference library into ``directory``; returns the paths
    written, the header and the library first. ``origin`` (the net's script, say) is named
    in the header."""
    net.init()
    if snapshot is not None:
        net.load(snapshot)
    return build(model_image(net), Path(os.fspath(directory)), origin)
