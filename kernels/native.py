"""Native CPU kernels: ``csrc/cpu_vec.cpp`` (CPU_VEC caches), ``csrc/cpu_amx.cpp`` (CPU_AMX
caches' load and gather), with the row helpers both share (``csrc/rows.h``), and ``csrc/cdc.cpp``
(the scheduler's content-defined text cuts, ``connector/cdc.py``), ``csrc/stacked.cpp`` (loads of
every layer at once, ``paged_stacked.load_stacked``), ``csrc/keys.cpp`` (a prompt's chunk keys,
``connector/chunk_keys.py``, with xxHash's vendored ``csrc/third_party/xxhash.h``) and
``csrc/layout.cpp`` (a prompt's chunk layout, ``connector/chunking.py``): one library built on
first use with the system C++ compiler.

Why not ``torch.utils.cpp_extension``: the op takes raw pointers and needs no torch headers, so a
plain shared library builds in about two seconds (a torch extension takes most of a minute on a
2-core machine) and carries no coupling to torch's C++ ABI. Where this Python's headers are
installed the library is also a CPython extension module (``csrc/pymodule.cpp``, with
``csrc/pyprompt.cpp``'s functions that take Python objects; imported from the
same file): its entry points are ``METH_FASTCALL`` functions, about 25 us a call on the cold caches
an op runs on once a request, where a ``ctypes`` call takes about 60. Without the headers it is
loaded through ``ctypes``. Either way ``library()`` has one attribute per entry point taking the same
arguments (a pointer: an address, None, or a buffer such as ``array('q')`` or bytes), and the GIL
is released for the call. OpenMP comes from the ``libgomp.so.1`` torch has already loaded, so
the op shares torch's thread pool instead of starting a second one that would spin against it.

The library is cached under ``~/.cache/orbitkv/native/<key>/`` (``<tmp>/orbitkv-native-<uid>/<key>/``
when the home is not writable), where the key hashes the source, the compiler, the flags, the
CPU's feature flags (``-march=native``) and the Python it is a module of, so a source change,
another machine or another Python rebuilds. A library is loaded only from a folder no other user
could have written to: the cache folder and the key's folder are made 0700, and they and the library must be ours (owned
by this uid, a real folder or file, not group- or world-writable). The temp-dir path is predictable,
so another user may have made it first: a folder that fails these checks is never used, and the
library is built afresh in a new private folder (``mkdtemp``) for this process instead. Builds write a private file and rename it into place: processes racing on a first
use (vLLM's scheduler and worker) never load a half-written library. Without a compiler, or if the
build fails, ``library()`` is None (logged once) and callers take the torch path, which stores the
same bytes. ``python -m orbitkv.kernels.native`` builds it ahead of time (``make`` does).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in ("cpu_vec.cpp", "cpu_amx.cpp", "cdc.cpp", "stacked.cpp", "keys.cpp", "layout.cpp")
)
# Included by the sources: part of the build key.
HEADERS = tuple(
    Path(__file__).with_name("csrc") / name for name in ("rows.h", "third_party/xxhash.h")
)
# The extension module's functions (built in where this Python's headers are installed).
MODULE_SOURCES = tuple(Path(__file__).with_name("csrc") / name
                       for name in ("pymodule.cpp", "pyprompt.cpp"))
MODULE_NAME = "_orbitkv_native"
# What the library's ``orbitkv_native_version`` returns (2: the ``*_many`` entry points; 3: the
# CPU_AMX load and gather; 4: the content-defined cuts; 5: the stacked loads; 6: the cuts as
# positions; 7: the chunk keys; 8: the chunk layout, and the extension module's chunk keys name
# each chunk's exact entry). The extension module's functions are the same entry points, and
# ``chunk_keys`` and ``chunk_prompt``, which take Python objects (``csrc/pyprompt.cpp``).
VERSION = 8
# -ffp-contract=off: the rotation's products and sums must each round (no FMA), as torch's do.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
         "-fvisibility=hidden")
LIB_NAME = "liborbitkv_cpu.so"
BUILD_TIMEOUT_S = 300.0

_lock = threading.Lock()
_state: dict[str, object] = {}



def _compiler() -> str | None:
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return Path.home() / ".cache" / "orbitkv" / "native"


def python_include() -> str | None:
    """This Python's header folder, where ``Python.h`` is installed (the library is then an
    extension module too), else None."""
    include = sysconfig.get_paths().get("include")
    return include if include and os.path.isfile(os.path.join(include, "Python.h")) else None


def _sources() -> tuple[Path, ...]:
    return (*SOURCES, *MODULE_SOURCES) if python_include() else SOURCES


def _flags() -> tuple[str, ...]:
    include = python_include()
    return (*FLAGS, f"-I{include}") if include else FLAGS


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    h = hashlib.sha256()
    sources = [src.read_bytes() for src in (*_sources(), *HEADERS)]
    # A module is built for one Python ABI: its extension suffix and header folder.
    abi = f"{sysconfig.get_config_var('EXT_SUFFIX')} {python_include()}"
    for part in (*sources, version.encode(), " ".join(FLAGS).encode(), platform.machine().encode(),
                 _cpu_flags().encode(), abi.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _why_untrusted(path: Path, *, is_dir: bool) -> str | None:
    """Why another user could have written ``path`` (None: they could not): not ours, group- or
    world-writable, or not a real folder / file (a link could point anywhere)."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
    if not kind:
        return f"{path} is not a {'folder' if is_dir else 'regular file'}"
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_dir(root: Path, key: str) -> Path:
    """``root / key``, each made 0700 where absent, after checking that no other user could have
    written either; raises ``OSError`` (cannot be made) or ``PermissionError`` (untrusted)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    out_dir = root / key
    for path in (root, out_dir):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        why = _why_untrusted(path, is_dir=True)
        if why:
            raise PermissionError(why)
    return out_dir


def _compile(compiler: str, out_dir: Path, target: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        sources = _sources()
        proc = subprocess.run([compiler, *_flags(), *map(str, sources), "-o", tmp],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            names = ", ".join(src.name for src in sources)
            raise RuntimeError(f"building {names} failed:\n{proc.stderr[-4000:]}")
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, which may let the group write
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build(root: Path | None = None) -> Path:
    """Compile the library (or find it already built) and return its path; raises on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    key = _build_key(compiler)
    roots = [root or cache_dir()]
    if root is None:  # no writable home: a folder of this uid's under the temp dir
        roots.append(Path(tempfile.gettempdir()) / f"orbitkv-native-{os.getuid()}")
    reasons = []
    for base in roots:
        try:
            out_dir = _private_dir(base, key)
        except OSError as exc:
            reasons.append(str(exc))
            continue
        target = out_dir / LIB_NAME
        if os.path.lexists(target) and _why_untrusted(target, is_dir=False) is None:
            return target
        # Absent, or writable by others (a build under a loose umask): ours to replace.
        return _compile(compiler, out_dir, target)
    # Every shared folder failed its checks: build in a new private one (for this process alone).
    log.warning("OrbitKV native CPU kernels: not loading a cached library (%s); building one in a "
                "private temp folder", "; ".join(reasons))
    out_dir = Path(tempfile.mkdtemp(prefix="orbitkv-native-"))
    return _compile(compiler, out_dir, out_dir / LIB_NAME)


class _Pointer(ctypes.c_void_p):
    """A pointer argument as the extension module takes it: an address, None, or a buffer."""

    @classmethod
    def from_param(cls, obj: Any) -> Any:
        if obj is None or isinstance(obj, int):
            return ctypes.c_void_p(obj)
        if isinstance(obj, bytes):
            return ctypes.c_char_p(obj)
        if hasattr(obj, "buffer_info"):  # array.array
            return ctypes.c_void_p(obj.buffer_info()[0])
        if isinstance(obj, bytearray):  # an output buffer; the caller holds it for the call
            return ctypes.c_void_p(ctypes.addressof((ctypes.c_char * len(obj)).from_buffer(obj))
                                   if obj else None)
        raise TypeError(f"a pointer must be an address, None or a buffer, got {type(obj).__name__}")


_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, _Pointer


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.orbitkv_cpu_vec_load.restype = _INT
    lib.orbitkv_cpu_vec_load.argtypes = [
        _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT,  # cache, geometry, dtype
        _PTR, _PTR, _I64, _PTR,  # k, v, num_tokens, slots
        _PTR, _PTR, _I64, _I64, _I64, _INT,  # cos, sin, cos_rows, rot_lo, rot_dim, style
        _PTR, _PTR, _INT,  # prod_k, prod_v, num_threads
    ]
    lib.orbitkv_cpu_vec_gather.restype = _INT
    lib.orbitkv_cpu_vec_gather.argtypes = [
        _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT,  # cache, geometry, element size
        _PTR, _PTR, _I64, _PTR, _INT,  # k, v, num_tokens, slots, num_threads
    ]
    # The CPU_AMX entry points take their CPU_VEC twins' arguments.
    for layout in ("vec", "amx"):
        load_many = getattr(lib, f"orbitkv_cpu_{layout}_load_many")
        load_many.restype = _INT
        load_many.argtypes = [
            _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT,  # jobs, caches, geometry, dtype
            _PTR, _PTR, _PTR, _PTR,  # ks, vs, num_tokens, slots
            _PTR, _PTR, _PTR, _I64, _I64, _INT, _INT,  # coss, sins, cos_rows, band, style, threads
        ]
        load_stacked = getattr(lib, f"orbitkv_cpu_{layout}_load_stacked")
        load_stacked.restype = _INT
        load_stacked.argtypes = [
            _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT,  # layers, caches, geometry, dtype
            _I64, _PTR, _I64, _I64, _INT, _INT,  # loads, their fields, band, style, threads
        ]
        gather_many = getattr(lib, f"orbitkv_cpu_{layout}_gather_many")
        gather_many.restype = _INT
        gather_many.argtypes = [
            _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT,  # jobs, caches, geometry, size
            _PTR, _PTR, _I64, _PTR, _INT,  # ks, vs, num_tokens, slots, num_threads
        ]
    lib.orbitkv_cdc_cuts.restype = _I64
    lib.orbitkv_cdc_cuts.argtypes = [
        _PTR, _PTR, _PTR, _PTR,  # tokens, stretches' starts then ends, table, cuts
        _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_uint64,  # sizes, walk, table_len, mask
    ]
    lib.orbitkv_chunk_keys.restype = _INT
    lib.orbitkv_chunk_keys.argtypes = [
        _PTR, _I64, _PTR, _I64,  # tokens, num_tokens, runs, num_runs
        _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR,  # prefix, items, version (each + nbytes), out
    ]
    lib.orbitkv_native_version.restype = _INT
    return lib


def _load(path: Path) -> Any:
    """The built library: imported as the extension module where it is one, else through ctypes."""
    if python_include() is None:
        return _bind(ctypes.CDLL(str(path)))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as {MODULE_NAME}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def library() -> Any:
    """The loaded library (module doc), building it on first use; None when it cannot be built
    (logged once)."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            import torch  # noqa: F401  (loads torch's libgomp first, so the library shares it)

            try:
                _state["lib"] = _load(build())
            except Exception as exc:  # no compiler, a failed build, an unloadable library
                log.warning("OrbitKV native CPU kernels unavailable (%s); using the torch path", exc)
                _state["lib"] = None
    return _state["lib"]  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    """``python -m orbitkv.kernels.native``: build now and print where the library is."""
    del argv
    try:
        path = build()
    except Exception as exc:
        print(f"native CPU kernels not built: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
