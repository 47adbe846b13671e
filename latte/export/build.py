"""Linking an exported model: the net's object code, the generated driver and the blob of
constants become ``liblatte_model.so`` with a C compiler (``$CC``, else ``gcc`` or ``cc``),
beside copies of the native libraries the object calls (OpenBLAS, libgomp), found at run
time through ``RPATH=$ORIGIN``: the folder can be moved and needs no Python."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from latte.compiler.blas import blas
from latte.compiler.cache import write_atomic
from latte.compiler.codegen import SGEMM, SGEMV
from latte.compiler.jit import openmp
from latte.errors import ExportError
from latte.export import csource
from latte.export.image import ModelImage

LIBRARY = "liblatte_model.so"
# only the API leaves the library: the segments and the driver's state stay local
_VERSION_SCRIPT = ("{ global: latte_model_predict; latte_model_input_size; "
                   "latte_model_output_size; local: *; };\n")


def build(image: ModelImage, directory: Path, origin: str) -> list[Path]:
    """Write the header, the library and the libraries it needs into ``directory``;
    returns the paths written."""
    cc = _compiler()
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / csource.HEADER]
    header = csource.header(image, origin)
    _write(written[0], header.encode())
    needs = _native_libraries(image.objects)
    for lib, name in needs:
        written.append(directory / name)
        if not written[-1].exists() or not os.path.samefile(lib, written[-1]):
            _write(written[-1], Path(lib).read_bytes(), mode=0o755)
    with tempfile.TemporaryDirectory(prefix="latte-export-") as tmp:
        work = Path(tmp)
        objects = [work / f"model{i}.o" for i in range(len(image.objects))]
        for path, obj in zip(objects, image.objects):
            path.write_bytes(obj)
        (work / "blob.bin").write_bytes(image.blob)
        (work / "exports.map").write_text(_VERSION_SCRIPT)
        (work / csource.HEADER).write_text(header)
        (work / "driver.c").write_text(csource.driver(image, str(work / "blob.bin"),
                                                      _calls(image.objects, SGEMM, SGEMV)))
        out = work / LIBRARY
        cmd = [cc, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-o", str(out),
               str(work / "driver.c"), *map(str, objects),
               *[str(directory / name) for _, name in needs],
               "-lm", "-lpthread", "-Wl,-rpath,$ORIGIN", "-Wl,-z,noexecstack",
               f"-Wl,--version-script={work / 'exports.map'}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ExportError(f"cannot export: linking {LIBRARY} with {cc} failed:\n"
                              f"{done.stderr.strip()}")
        _write(directory / LIBRARY, out.read_bytes(), mode=0o755)
    written.insert(1, directory / LIBRARY)
    return written


def _compiler() -> str:
    for name in filter(None, (os.environ.get("CC"), "gcc", "cc")):
        path = shutil.which(name)
        if path:
            return path
    raise ExportError("cannot export: no C compiler found (set $CC, or install gcc)")


def _native_libraries(objects: tuple[bytes, ...]) -> list[tuple[str, str]]:
    """The shared libraries the objects' undefined symbols come from (looked up in their
    string table), each as its file and its soname (the name the copy must have):
    OpenBLAS for sgemm and sgemv, libgomp for parallel loops. libm and libc are the system's."""
    found = []
    if _calls(objects, SGEMM, SGEMV):
        found.append((blas()._name, os.path.basename(blas()._name)))
    if _calls(objects, "GOMP_parallel"):
        gomp = openmp()
        if gomp is None:
            raise ExportError("cannot export: the code runs parallel loops but libgomp (it "
                              "comes with gcc) is not found")
        found.append((_loaded_path(gomp._name), os.path.basename(gomp._name)))
    return found


def _loaded_path(name: str) -> str:
    """The file the dynamic loader mapped for library ``name`` (a soname like
    ``libgomp.so.1`` names no file by itself)."""
    if os.path.isabs(name):
        return name
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path) == name or os.path.basename(path).startswith(name + "."):
                return path
    raise ExportError(f"cannot export: the file of {name} is not found")


def _calls(objects: tuple[bytes, ...], *symbols: str) -> bool:
    """Whether an object names one of ``symbols`` (their only global symbols are the segments
    they define and the functions they call)."""
    return any(b"\0" + s.encode() + b"\0" in obj for obj in objects for s in symbols)


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """``path`` written atomically (a reader never sees half a library), with ``mode``."""
    write_atomic(path, data)
    os.chmod(path, mode)
