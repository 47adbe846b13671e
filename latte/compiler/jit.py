"""The native target: one object owns the target machine, the O3 pipeline and the JIT.

Compiled objects are cached on disk, keyed by a hash of the LLVM IR, the CPU name and
features and the llvmlite version, so a second run of the same net does not recompile.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import tempfile
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from latte.compiler.blas import blas

_CACHE_ENV = "LATTE_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or Path.home() / ".cache" / "latte")


@functools.lru_cache(maxsize=None)
def openmp() -> ctypes.CDLL | None:
    """libgomp (shipped with gcc), whose thread pool runs parallel loops; None if absent."""
    for name in (ctypes.util.find_library("gomp"), "libgomp.so.1"):
        if name:
            try:
                return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
    return None


class Target:
    """Host target machine, optimization pipeline and symbol table (created once)."""

    def __init__(self):
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        self.cpu = llvm.get_host_cpu_name()
        self.features = llvm.get_host_cpu_features().flatten()
        self.machine = self.new_machine()
        self._register_symbols()

    def new_machine(self) -> llvm.TargetMachine:
        """A fresh host target machine (an MCJIT engine takes ownership of the one it gets)."""
        target = llvm.Target.from_triple(llvm.get_process_triple())
        return target.create_target_machine(cpu=self.cpu, features=self.features, opt=3,
                                            reloc="pic", codemodel="jitdefault", jit=True)

    @staticmethod
    def _register_symbols():
        llvm.add_symbol("scipy_cblas_sgemm", ctypes.cast(blas().scipy_cblas_sgemm, ctypes.c_void_p).value)
        libm = ctypes.CDLL(ctypes.util.find_library("m"))
        for name in ("expf", "logf", "tanhf", "sqrtf", "floorf"):
            llvm.add_symbol(name, ctypes.cast(getattr(libm, name), ctypes.c_void_p).value)
        gomp = openmp()
        for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads") if gomp else ():
            llvm.add_symbol(name, ctypes.cast(getattr(gomp, name), ctypes.c_void_p).value)

    def cache_key(self, ir_text: str) -> str:
        h = hashlib.sha256()
        for part in (ir_text, self.cpu, self.features, llvmlite.__version__, "v1"):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def optimize(self, module: llvm.ModuleRef) -> None:
        pto = llvm.create_pipeline_tuning_options(speed_level=3)
        pto.loop_vectorization = True
        pto.slp_vectorization = True
        pto.loop_unrolling = True
        pb = llvm.create_pass_builder(self.machine, pto)
        pb.getModulePassManager().run(module, pb)

    def compile(self, ir_text: str) -> "CodeLibrary":
        """Parse, verify, optimize (unless cached) and JIT ``ir_text``."""
        key = self.cache_key(ir_text)
        path = cache_dir() / f"{key}.o"
        cached = path.read_bytes() if path.exists() else None
        module = llvm.parse_assembly(ir_text)
        module.verify()
        module.triple = self.machine.triple
        module.data_layout = str(self.machine.target_data)
        if cached is None:
            self.optimize(module)
        engine = llvm.create_mcjit_compiler(module, self.new_machine())

        def notify(_mod, data: bytes):
            _atomic_write(path, data)

        engine.set_object_cache(notify, lambda _mod: cached)
        engine.finalize_object()
        return CodeLibrary(engine, module, cached is not None, key)


class CodeLibrary:
    """A finalized JIT module: look up exported functions by name."""

    def __init__(self, engine, module, from_cache: bool, key: str):
        self.engine, self.module, self.from_cache, self.key = engine, module, from_cache, key

    def address(self, name: str) -> int:
        addr = self.engine.get_function_address(name)
        if not addr:
            raise KeyError(f"no compiled function {name!r}")
        return addr


def _atomic_write(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs compile time


@functools.lru_cache(maxsize=None)
def target() -> Target:
    return Target()
