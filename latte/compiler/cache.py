"""The on-disk cache of object code (and of stored programs): one file per key, checked
before LLVM (or the unpickler) ever sees its bytes.

An entry is a header and the object code::

    MAGIC (8 bytes) | key (32 ASCII hex digits) | sha256 of the object (32 bytes) |
    object length (8 bytes, little endian) | object

Entries are written atomically (a temporary file in the cache directory, fsync'd, then
``os.replace``), so a reader sees a whole entry or none, and two processes filling the same
cache at once each install a complete entry; the temporary files of writes a killed process
left are removed by a later process. An entry that fails its check (truncated,
altered, empty, made for another key, not an entry at all) is reported once with a warning
naming its path, deleted, and treated as a miss: it is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import time
import warnings
from pathlib import Path

MAGIC = b"LATTEOB2"
_HEADER = struct.Struct("<8s32s32sQ")
_reported: set[Path] = set()   # damaged entries already warned about by this process
_swept: set[tuple] = set()     # (folder, suffix) this process has removed stale temporaries of
STALE_SECONDS = 600.0          # a write takes milliseconds: a temporary this old is orphaned


def cache_dir() -> Path:
    """``$LATTE_CACHE_DIR``, else ``~/.cache/latte``."""
    return Path(os.environ.get("LATTE_CACHE_DIR") or Path.home() / ".cache" / "latte")


def entry_path(key: str, suffix: str = ".o") -> Path:
    """Where the entry for ``key`` lies: ``.o`` for object code, ``.program`` for a stored
    program (:mod:`latte.compiler.stored`)."""
    return cache_dir() / f"{key}{suffix}"


def pack(key: str, obj: bytes) -> bytes:
    """The entry for object code ``obj`` made for ``key``."""
    return _HEADER.pack(MAGIC, key.encode(), hashlib.sha256(obj).digest(), len(obj)) + obj


def unpack(key: str, data: bytes) -> bytes:
    """The object code of entry ``data`` made for ``key``; ValueError saying what is wrong."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{len(data)} bytes, shorter than a header")
    magic, made_for, digest, size = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a latte cache entry")
    if made_for != key.encode():
        raise ValueError(f"made for key {made_for.decode(errors='replace')!r}")
    obj = data[_HEADER.size:]
    if len(obj) != size:
        raise ValueError(f"object of {len(obj)} bytes where the header says {size}")
    if hashlib.sha256(obj).digest() != digest:
        raise ValueError("checksum mismatch")
    return obj


def load(key: str, suffix: str = ".o") -> bytes | None:
    """The cached bytes for ``key``, or None (absent, unreadable or damaged: a damaged
    entry is reported and deleted)."""
    path = entry_path(key, suffix)
    try:
        with open(path, "rb") as f:
            data = f.read()
            ino = os.fstat(f.fileno()).st_ino
    except OSError:
        return None
    try:
        return unpack(key, data)
    except ValueError as why:
        if path not in _reported:
            _reported.add(path)
            warnings.warn(f"latte: damaged cache entry {path} ({why}); deleted, recompiling",
                          RuntimeWarning, stacklevel=3)
        _discard(path, ino)
        return None


def store(key: str, obj: bytes, suffix: str = ".o") -> None:
    """Install the entry for ``obj`` under ``key`` atomically (a read-only or full cache only
    costs compile time). The first store of a process removes the temporary files that
    writes interrupted long ago (a killed process) left in the cache."""
    folder = cache_dir()
    if (folder, suffix) not in _swept:
        _swept.add((folder, suffix))
        remove_temps(folder, f"*{suffix}", older_than=STALE_SECONDS)
    try:
        write_atomic(entry_path(key, suffix), pack(key, obj))
    except OSError:
        pass


def remove_temps(folder: Path, target: str, older_than: float = 0.0) -> None:
    """Delete the temporary files :func:`write_atomic` left in ``folder`` for targets whose
    name matches the glob ``target``, when they are older than ``older_than`` seconds (an
    interrupted write's; a younger one may be another process's write in progress)."""
    now = time.time()
    for tmp in Path(folder).glob(f".{target}.*.tmp"):
        try:
            if now - tmp.stat().st_mtime >= older_than:
                tmp.unlink()
        except OSError:
            pass


def write_atomic(path: Path, data: bytes, replace: bool = True) -> None:
    """Write ``data`` to ``path`` through a fsync'd temporary file in the same directory and
    ``os.replace``: readers see the old file or the new one, whole. With ``replace`` False
    an existing file stays (``FileExistsError``): the first writer wins. The temporary file
    is removed if anything fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (not every file system lets a directory be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _discard(path: Path, ino: int) -> None:
    """Delete the damaged entry at ``path``, unless another process has meanwhile replaced it
    with a new file (whose inode differs)."""
    try:
        if os.stat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass
