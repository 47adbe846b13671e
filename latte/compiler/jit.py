"""The native target: one object owns the target machine, the O3 pipeline and the JIT.

Compiled objects are cached on disk (:mod:`latte.compiler.cache`), keyed by a hash of the
LLVM IR, the CPU name and features and the llvmlite version, so a second run of the same net
does not recompile: on a hit the IR is not even parsed, the engine loads the object alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
from typing import Callable

import llvmlite
import llvmlite.binding as llvm

from latte.compiler import cache
from latte.compiler.blas import blas


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
        for name in ("logf", "sqrtf", "floorf"):
            llvm.add_symbol(name, ctypes.cast(getattr(libm, name), ctypes.c_void_p).value)
        gomp = openmp()
        for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads") if gomp else ():
            llvm.add_symbol(name, ctypes.cast(getattr(gomp, name), ctypes.c_void_p).value)

    def cache_key(self, fingerprint: str) -> str:
        """The cache key of the program ``fingerprint`` identifies, on this CPU and LLVM."""
        h = hashlib.sha256()
        for part in (fingerprint, self.cpu, self.features, llvmlite.__version__, "v2"):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def optimize(self, module: llvm.ModuleRef, speed: int = 3) -> None:
        """The new pass manager at ``speed`` (3: O3 with loop and SLP vectorization)."""
        pto = llvm.create_pipeline_tuning_options(speed_level=speed)
        pto.loop_vectorization = speed >= 3
        pto.slp_vectorization = speed >= 3
        pto.loop_unrolling = speed >= 3
        pb = llvm.create_pass_builder(self.machine, pto)
        pb.getModulePassManager().run(module, pb)

    def compile(self, ir_text: str) -> "CodeLibrary":
        """JIT ``ir_text``, through the cache keyed by its sha256."""
        return self.library(hashlib.sha256(ir_text.encode()).hexdigest(), lambda: ir_text)

    def library(self, fingerprint: str, build_ir: Callable[[], str], speed: int = 3) -> "CodeLibrary":
        """The code of the program whose IR ``build_ir()`` returns and that ``fingerprint``
        identifies (a hash of everything the IR is made from): the cached object if a valid
        one exists (then the IR is never built), else the IR parsed, verified, optimized and
        compiled, and the object of the optimized module cached. ``speed`` is LLVM's
        optimization level (part of the key)."""
        key = self.cache_key(f"{fingerprint}/O{speed}")
        obj = cache.load(key)
        if obj is not None:
            # the object carries every symbol: MCJIT needs a module, any will do
            return CodeLibrary(self._engine(self._module(""), obj), True, key, None, speed)
        ir_text = build_ir()
        engine, compiled = self._compile(ir_text, speed)
        if len(compiled) == 1:
            cache.store(key, compiled[0])
        return CodeLibrary(engine, False, key, hashlib.sha256(ir_text.encode()).hexdigest(),
                           speed)

    def object_code(self, library: "CodeLibrary", build_ir: Callable[[], str]) -> bytes:
        """The relocatable object ``library`` runs (``latte export`` links it into a shared
        library: its calls to sgemm, libm and libgomp are references by name): the cached
        one, else ``build_ir()`` compiled again as :meth:`library` compiled it."""
        obj = cache.load(library.key)
        if obj is None:
            (obj,) = self._compile(build_ir(), library.speed)[1]   # MCJIT: one per module
        return obj

    def _compile(self, ir_text: str, speed: int):
        """``ir_text`` parsed, verified, optimized at ``speed`` and JIT-compiled: the engine
        and the object(s) MCJIT made of it."""
        module = self._module(ir_text)
        module.verify()
        self.optimize(module, speed)
        compiled: list[bytes] = []
        return self._engine(module, None, compiled.append), compiled

    def _module(self, ir_text: str) -> llvm.ModuleRef:
        """``ir_text`` parsed, for this target (O3 needs the data layout)."""
        module = llvm.parse_assembly(ir_text)
        module.triple = self.machine.triple
        module.data_layout = str(self.machine.target_data)
        return module

    def _engine(self, module: llvm.ModuleRef, obj: bytes | None, notify=None):
        """A finalized MCJIT engine for ``module``, or for the object ``obj`` compiled from
        it; ``notify`` receives the object the engine compiles (when ``obj`` is None)."""
        engine = llvm.create_mcjit_compiler(module, self.new_machine())
        engine.set_object_cache(lambda _mod, data: notify(data) if notify else None,
                                lambda _mod: obj)
        engine.finalize_object()
        return engine


class CodeLibrary:
    """A finalized JIT module: look up exported functions by name. ``key`` is its cache key,
    ``ir_digest`` the sha256 of its LLVM IR text (None when the object came from the cache and
    the IR was never built); both are equal across processes for equal nets. ``speed``: the
    LLVM optimization level it was compiled at."""

    def __init__(self, engine, from_cache: bool, key: str, ir_digest: str | None, speed: int = 3):
        self.engine, self.from_cache, self.key, self.ir_digest = engine, from_cache, key, ir_digest
        self.speed = speed

    def address(self, name: str) -> int:
        addr = self.engine.get_function_address(name)
        if not addr:
            raise KeyError(f"no compiled function {name!r}")
        return addr


@functools.lru_cache(maxsize=None)
def target() -> Target:
    return Target()
