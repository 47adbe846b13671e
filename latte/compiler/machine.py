"""What the compiler needs to know about the machine: cache sizes, read from sysfs."""

from __future__ import annotations

import functools
from pathlib import Path

_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
_DEFAULTS = {1: 32 << 10, 2: 1 << 20, 3: 8 << 20}


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


@functools.lru_cache(maxsize=None)
def cache_sizes() -> dict[int, int]:
    """Bytes of the data (or unified) cache per level, as seen by one core."""
    sizes = dict(_DEFAULTS)
    for index in sorted(_SYS_CACHE.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            sizes[int((index / "level").read_text())] = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return sizes
