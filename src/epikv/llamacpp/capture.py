"""Reading decoder-block outputs from llama.cpp for every token: the scheduler's eval callback on the graph nodes
named `l_out-<il>`.

`l_out-<il>` is the residual output of block il (0-based), transformers' `hidden_states[il + 1]`: exactly the block
`--layers` names in the torch engine (tests/test_llamacpp.py pins it against the torch engine's hidden states).
Rows are the forward's tokens in batch order (one sequence, n_ubatch >= the batch), float32, [n_tokens, n_embd].

Two implementations of one callback: a small C function (capture.c, compiled once with the system C compiler into
$EPIKV_CACHE_DIR/llamacpp/) and, where no compiler is found, the same logic in Python through ctypes. The scheduler
asks the callback about every graph node (about 31 per block), which in Python costs a few percent of a step; in C
the ask is a prefix test.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ..errors import EpiKVError
from . import lib

MAX_NODES, NAME = 64, 64
GGML_TYPE_F32 = 0


class _Struct(ctypes.Structure):
    _fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p), ("tensor_get", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("pad", ctypes.c_int32), ("names", (ctypes.c_char * NAME) * MAX_NODES),
                ("dst", ctypes.c_void_p * MAX_NODES), ("cap", ctypes.c_uint64 * MAX_NODES),
                ("got", ctypes.c_uint64 * MAX_NODES), ("type", ctypes.c_int32 * MAX_NODES),
                ("asks", ctypes.c_uint64)]


_SRC = Path(__file__).with_name("capture.c")
_TOO_BIG = 2**64 - 1


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.lru_cache(maxsize=None)
def _compiler_id(cc: str) -> str:
    """The compiler's own first line of `--version` (its path when it prints none)."""
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return (r.stdout.strip().splitlines() or [cc])[0]
    except (OSError, subprocess.SubprocessError):
        return cc


def _lib_path(cc: str, folder: Path | None = None) -> Path:
    """The cached library, keyed by the source, the compiler and the llama.cpp it is loaded into: a new compiler
    or llama-cpp-python builds it anew rather than loading a library made for another."""
    from ..models import cache_dir

    key = "\0".join([hashlib.sha256(_SRC.read_bytes()).hexdigest(), _compiler_id(cc), lib.load().version])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return (folder or cache_dir() / "llamacpp") / f"epikv-capture-{digest}.so"


def build_c(force: bool = False) -> Path | None:
    """Compile capture.c once (cached by source, compiler and llama.cpp version); None, with a warning that
    carries the compiler's own message, when no C compiler is on PATH or the build fails. A cache folder that
    cannot be written falls back to a temporary one."""
    cc = _compiler()
    if not cc:
        return None
    out = _lib_path(cc)
    if out.exists() and not force:
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".write-test{os.getpid()}")
        probe.touch()
        probe.unlink()
    except OSError:
        user = os.getuid() if hasattr(os, "getuid") else 0
        out = _lib_path(cc, Path(tempfile.gettempdir()) / f"epikv-llamacpp-{user}")
        if out.exists() and not force:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SRC)], capture_output=True,
                           text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"epikv: the C capture callback could not be compiled with {cc} ({e}); using the Python one",
                      stacklevel=2)
        return None
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        msg = (r.stderr or r.stdout).strip().splitlines()
        warnings.warn(f"epikv: compiling {_SRC.name} with {cc} failed ({msg[0] if msg else f'exit {r.returncode}'}); "
                      "using the Python capture callback", stacklevel=2)
        return None
    os.replace(tmp, out)
    return out


class BlockCapture:
    """Buffers for the outputs of `blocks` over forwards of up to `max_tokens` tokens, and the callback that fills
    them. Pass `cb` and `user_data` into llama_context_params; keep this object alive as long as the context."""

    def __init__(self, blocks: list[int], n_embd: int, max_tokens: int, method: str = "auto") -> None:
        if len(blocks) > MAX_NODES:
            raise EpiKVError(f"at most {MAX_NODES} blocks can be captured, {len(blocks)} asked")
        L = lib.load()
        self.blocks = list(blocks)
        self.n_embd = n_embd
        self.error: BaseException | None = None  # an exception inside the Python callback, raised by rows()
        self.on_node = None  # test hook (Python callback): called with a block after its rows are copied
        self.buf = np.zeros((len(blocks), max_tokens, n_embd), dtype=np.float32)  # [blocks, tokens, dim]
        s = _Struct()
        s.get_name = ctypes.cast(L.ggml.ggml_get_name, ctypes.c_void_p).value
        s.nbytes = ctypes.cast(L.ggml.ggml_nbytes, ctypes.c_void_p).value
        s.tensor_get = ctypes.cast(L.ggml.ggml_backend_tensor_get, ctypes.c_void_p).value
        s.n = len(blocks)
        for i, b in enumerate(blocks):
            s.names[i].value = f"l_out-{b}".encode()
            s.dst[i] = self.buf[i].ctypes.data
            s.cap[i] = self.buf[i].nbytes
        self.struct = s
        self.user_data = ctypes.cast(ctypes.pointer(s), ctypes.c_void_p)
        proto = L.ll.ggml_backend_sched_eval_callback
        so = build_c() if method in ("auto", "c") else None
        if method == "c" and so is None:
            raise EpiKVError("the C capture callback could not be compiled (no C compiler on PATH?)")
        if so is not None:
            self._so = ctypes.CDLL(str(so))
            self.cb = proto(ctypes.cast(self._so.epikv_eval_cb, ctypes.c_void_p).value)
            self.method = "c"
        else:
            self.cb = proto(self._python_cb())
            self.method = "python"

    def _python_cb(self):
        """The same callback as capture.c, in Python (a ctypes trampoline per graph node). It never lets an
        exception out: ctypes would swallow it and answer false, and ggml would stop the forward half-way while
        llama_decode still reports success. The first exception is kept and raised by rows()."""
        L = lib.load()
        get_name, nbytes, tensor_get = L.ggml.ggml_get_name, L.ggml.ggml_nbytes, L.ggml.ggml_backend_tensor_get
        s = self.struct
        index = {f"l_out-{b}".encode(): i for i, b in enumerate(self.blocks)}

        def cb(t, ask, user_data):
            try:
                i = index.get(get_name(t))
                if ask:
                    s.asks += 1
                    return i is not None
                if i is None:
                    return True
                s.type[i] = ctypes.c_int32.from_address(t).value
                nb = nbytes(t)
                if nb > s.cap[i]:
                    s.got[i] = _TOO_BIG
                    return True
                tensor_get(t, s.dst[i], 0, nb)
                s.got[i] = nb
                if self.on_node is not None:
                    self.on_node(self.blocks[i])
                return True
            except BaseException as e:  # KeyboardInterrupt included: raised again by rows()
                if self.error is None:
                    self.error = e
                return True

        return cb

    def reset(self) -> None:
        self.error = None
        for i in range(len(self.blocks)):
            self.struct.got[i] = 0

    def rows(self, n_tokens: int) -> dict[int, np.ndarray]:
        """block -> [n_tokens, n_embd] float32 of the last forward (views of the buffers: copy to keep); EpiKVError
        when a block was not seen (its builder names no `l_out`), was not float32, or did not hold one row a token."""
        if self.error is not None:  # raised inside the callback: the forward's outputs cannot be trusted
            e, self.error = self.error, None
            if not isinstance(e, Exception):
                raise e
            raise EpiKVError(f"the capture callback failed during llama_decode: {type(e).__name__}: {e}") from e
        out = {}
        want = n_tokens * self.n_embd * 4
        for i, b in enumerate(self.blocks):
            got = self.struct.got[i]
            if got == 0:
                raise EpiKVError(f"llama.cpp's graph for this model has no node l_out-{b}: its builder does not name "
                                 "block outputs, so the hidden states EPIKV reads cannot be captured")
            if self.struct.type[i] != GGML_TYPE_F32:
                raise EpiKVError(f"block output l_out-{b} is of ggml type {self.struct.type[i]}, not float32")
            if got != want:
                raise EpiKVError(f"block output l_out-{b} holds {got} bytes for {n_tokens} tokens of {self.n_embd} "
                                 f"floats ({want} bytes expected): its rows are not one per token")
            out[b] = self.buf[i, :n_tokens]
        return out

    @property
    def asks(self) -> int:
        return int(self.struct.asks)
