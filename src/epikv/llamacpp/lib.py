"""The llama.cpp library as epikv uses it: llama-cpp-python's low-level ctypes API, plus the few ggml tensor
functions it does not bind (read from the shipped libggml-base), loaded once with a one-line error when absent.

Everything here is public C API of llama.cpp / ggml (llama.h, ggml.h, ggml-backend.h); nothing is read from a
private struct except the first field of `struct ggml_tensor` (its type), which ggml.h declares first.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from types import SimpleNamespace

from ..errors import EpiKVError

INSTALL_HINT = "bash scripts/install.sh --llamacpp"


@functools.lru_cache(maxsize=None)
def load() -> SimpleNamespace:
    """llama_cpp (the module) and libggml-base's tensor functions; EpiKVError in one line when llama.cpp is missing
    or failed to build. The backend is initialised once per process."""
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or OSError / RuntimeError from a broken shared library
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EpiKVError(f"--engine llama.cpp needs llama-cpp-python, which is not usable here ({first}): "
                         f"install it with `{INSTALL_HINT}`") from None
    libdir = Path(llama_cpp.__file__).parent / "lib"
    cands = [p for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll") for p in [libdir / name]
             if p.exists()]
    if not cands:
        raise EpiKVError(f"llama-cpp-python at {libdir.parent} ships no libggml-base: reinstall it with "
                         f"`{INSTALL_HINT}`")
    ggml = ctypes.CDLL(str(cands[0]))
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    ggml.ggml_backend_tensor_get.restype = None
    llama_cpp.llama_backend_init()
    _quiet(llama_cpp)
    return SimpleNamespace(ll=llama_cpp, ggml=ggml, version=getattr(llama_cpp, "__version__", "?"))


def system_info() -> str:
    """llama.cpp's own line of the CPU features its build uses (e.g. "CPU : SSE3 = 1 | AVX2 = 1 | ..."), recorded
    with benchmark results: a portable build and a native one differ severalfold on the same machine."""
    return (load().ll.llama_print_system_info() or b"").decode(errors="replace").strip()


def available() -> bool:
    """Whether llama-cpp-python is installed and its library loads (the llama.cpp engine can run here)."""
    try:
        load()
        return True
    except EpiKVError:
        return False


_LOG_KEEP: list = []  # the log callback must outlive every call into llama.cpp


def _quiet(ll) -> None:
    """llama.cpp logs every load to stderr; keep only its errors (level 4 = GGML_LOG_LEVEL_ERROR)."""

    @ll.llama_log_callback
    def log(level, text, user_data):
        if level == 4 and text:
            import sys

            sys.stderr.write(text.decode("utf-8", "replace"))

    _LOG_KEEP.append(log)
    ll.llama_log_set(log, ctypes.c_void_p(0))
