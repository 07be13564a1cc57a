"""Reading decoder-block outputs from llama.cpp for every token: the scheduler's eval callback on the graph nodes
named `l_out-<il>`; and, for the policies that read them (Observes.queries / keys_values / arriving_kv), the
rotated queries and keys of a layer (`Qcur-<il>` / `Kcur-<il>`, the node whose op is ROPE: the pre-RoPE node has the
same name) and its values (`Vcur-<il>`, the RESHAPE node [head_dim, kv_heads, n_tokens]), each [n_tokens, heads,
head_dim] float32 in batch order, as the Llama and Qwen2 builders name them (LLAMACPP.md section 8).

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
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import EpiKVError
from . import lib

MAX_NODES, NAME = 256, 64
GGML_TYPE_F32 = 0
# ggml's op numbers (enum ggml_op, ggml.h of the vendored llama.cpp), checked against ggml_op_name when loaded
OPS = {"RESHAPE": 36, "ROPE": 48}
# what each kind of node is: its name prefix and the op of the node to copy (None: any)
KINDS = {"q": ("Qcur", "ROPE"), "k": ("Kcur", "ROPE"), "v": ("Vcur", "RESHAPE")}


class _Struct(ctypes.Structure):
    _fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p), ("tensor_get", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("pad", ctypes.c_int32), ("names", (ctypes.c_char * NAME) * MAX_NODES),
                ("dst", ctypes.c_void_p * MAX_NODES), ("cap", ctypes.c_uint64 * MAX_NODES),
                ("got", ctypes.c_uint64 * MAX_NODES), ("type", ctypes.c_int32 * MAX_NODES),
                ("asks", ctypes.c_uint64), ("want_op", ctypes.c_int32 * MAX_NODES),
                ("ne", (ctypes.c_int64 * 4) * MAX_NODES), ("nb", (ctypes.c_uint64 * 4) * MAX_NODES)]


class _TensorHead(ctypes.Structure):
    """The leading fields of struct ggml_tensor (ggml.h), in its order."""

    _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int32)]


def op_numbers() -> dict[str, int]:
    """OPS, checked against the loaded ggml (its op names): a ggml whose enum moved is refused in one line."""
    L = lib.load()
    fn = L.ggml.ggml_op_name
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_char_p
    for name, num in OPS.items():
        if fn(num) != name.encode():
            raise EpiKVError(f"this ggml numbers its ops differently (op {num} is {fn(num)!r}, not {name}): the "
                             "query/key/value capture needs the llama.cpp version epikv was written against")
    return dict(OPS)


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


class LayerRows(Mapping):
    """layer -> [tokens, heads, head_dim] rows of one kind (q, k or v), backed by one [layers, tokens, heads,
    head_dim] array (`stacked`, in `layers` order), so a sequence takes its tokens of every layer in one slice and
    one copy (`rows(lo, hi)`, then sequence._layers) instead of one per layer."""

    def __init__(self, layers: list[int], stacked: np.ndarray, _at: dict[int, int] | None = None) -> None:
        self.layers, self.stacked = layers, stacked
        self._at = _at if _at is not None else {l: j for j, l in enumerate(layers)}

    def __getitem__(self, layer: int) -> np.ndarray:
        return self.stacked[self._at[layer]]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def rows(self, lo: int, hi: int) -> "LayerRows":
        """Tokens lo .. hi - 1 of every layer (a view)."""
        return LayerRows(self.layers, self.stacked[:, lo:hi], self._at)  # per sequence per decode: no new index


class BlockCapture:
    """Buffers for the outputs of `blocks` over forwards of up to `max_tokens` tokens, and the callback that fills
    them. Pass `cb` and `user_data` into llama_context_params; keep this object alive as long as the context."""

    def __init__(self, blocks: list[int], n_embd: int, max_tokens: int, method: str = "auto", *,
                 queries: list[int] = (), keys: list[int] = (), values: list[int] = (),
                 heads: tuple[int, int, int] = (0, 0, 0), interleaved: bool = False) -> None:
        """queries / keys / values: the layers whose rotated queries, rotated keys or values are copied too;
        heads: (n_head, n_head_kv, head_dim) of the model (their row shapes). interleaved: the GGUF's query and key
        weights were permuted for ggml's pairwise RoPE (Llama conversions), so each head's channels come as
        (0, d/2, 1, d/2 + 1, ...) of transformers' order: attn_rows puts them back in transformers' order."""
        n_nodes = len(blocks) + len(queries) + len(keys) + len(values)
        if n_nodes > MAX_NODES:
            raise EpiKVError(f"at most {MAX_NODES} graph nodes can be captured, {n_nodes} asked")
        L = lib.load()
        self.blocks = list(blocks)
        self.n_embd = n_embd
        self.error: BaseException | None = None  # an exception inside the Python callback, raised by rows()
        self.on_node = None  # test hook (Python callback): called with a block after its rows are copied
        self.buf = np.zeros((len(blocks), max_tokens, n_embd), dtype=np.float32)  # [blocks, tokens, dim]
        n_head, n_head_kv, head_dim = heads
        # transformers' channel j of a head is ggml's channel 2j (j < d/2) or 2(j - d/2) + 1
        self.unpermute = (np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
                          if interleaved and head_dim else None)
        ops = op_numbers() if (queries or keys or values) else {}
        # one buffer per kind, [layers, tokens, heads, head_dim]; the query / key / value nodes: (kind, layer, node
        # name, op wanted, its buffer [tokens, heads, head_dim])
        self.attn_layers = {kind: list(ls) for kind, ls in (("q", queries), ("k", keys), ("v", values))}
        self.attn_buf = {kind: np.zeros((len(ls), max_tokens, n_head if kind == "q" else n_head_kv, head_dim),
                                        np.float32) for kind, ls in self.attn_layers.items()}
        self.attn_nodes = [(kind, l, f"{KINDS[kind][0]}-{l}", ops.get(KINDS[kind][1], -1), self.attn_buf[kind][j])
                           for kind, ls in self.attn_layers.items() for j, l in enumerate(ls)]
        heads_of = [buf.shape[1] for *_, buf in self.attn_nodes]
        self._want_ne = np.array([[head_dim, h, 0, 1] for h in heads_of], dtype=np.int64).reshape(-1, 4)
        self._want_nb = np.array([[4, 4 * head_dim, 4 * head_dim * h] for h in heads_of],
                                 dtype=np.uint64).reshape(-1, 3)
        self._row_bytes = np.array([4 * head_dim * h for h in heads_of], dtype=np.uint64)
        s = _Struct()
        s.get_name = ctypes.cast(L.ggml.ggml_get_name, ctypes.c_void_p).value
        s.nbytes = ctypes.cast(L.ggml.ggml_nbytes, ctypes.c_void_p).value
        s.tensor_get = ctypes.cast(L.ggml.ggml_backend_tensor_get, ctypes.c_void_p).value
        s.n = n_nodes
        for i, b in enumerate(blocks):
            s.names[i].value = f"l_out-{b}".encode()
            s.dst[i] = self.buf[i].ctypes.data
            s.cap[i] = self.buf[i].nbytes
            s.want_op[i] = -1
        for i, (_, _, name, op, buf) in enumerate(self.attn_nodes, start=len(blocks)):
            s.names[i].value = name.encode()
            s.dst[i] = buf.ctypes.data
            s.cap[i] = buf.nbytes
            s.want_op[i] = op
        self.struct = s
        # numpy views of what the callback reports per node (bytes, type, shape, strides): checked at once
        self._got, self._type = np.ctypeslib.as_array(s.got), np.ctypeslib.as_array(s.type)
        self._block_at = {b: j for j, b in enumerate(self.blocks)}
        self._ne, self._nb = np.ctypeslib.as_array(s.ne), np.ctypeslib.as_array(s.nb)
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
        index = {s.names[i].value: i for i in range(s.n)}

        def cb(t, ask, user_data):
            try:
                i = index.get(get_name(t))
                if i is not None and s.want_op[i] >= 0 and _TensorHead.from_address(t).op != s.want_op[i]:
                    i = None
                if ask:
                    s.asks += 1
                    return i is not None
                if i is None:
                    return True
                h = _TensorHead.from_address(t)
                s.type[i] = h.type
                for d in range(4):
                    s.ne[i][d], s.nb[i][d] = h.ne[d], h.nb[d]
                nb = nbytes(t)
                if nb > s.cap[i]:
                    s.got[i] = _TOO_BIG
                    return True
                tensor_get(t, s.dst[i], 0, nb)
                s.got[i] = nb
                if self.on_node is not None and i < len(self.blocks):
                    self.on_node(self.blocks[i])
                return True
            except BaseException as e:  # KeyboardInterrupt included: raised again by rows()
                if self.error is None:
                    self.error = e
                return True

        return cb

    def reset(self) -> None:
        self.error = None
        for i in range(self.struct.n):
            self.struct.got[i] = 0

    def _raise_error(self) -> None:
        """An exception kept by the Python callback: the forward's outputs cannot be trusted."""
        if self.error is not None:
            e, self.error = self.error, None
            if not isinstance(e, Exception):
                raise e
            raise EpiKVError(f"the capture callback failed during llama_decode: {type(e).__name__}: {e}") from e

    def rows(self, n_tokens: int) -> "LayerRows":
        """block -> [n_tokens, n_embd] float32 of the last forward, one [blocks, n_tokens, n_embd] view of the
        buffer (LayerRows.stacked: copy to keep); EpiKVError when a block was not seen (its builder names no
        `l_out`), was not float32, or did not hold one row a token."""
        self._raise_error()
        nb, want = len(self.blocks), n_tokens * self.n_embd * 4
        if ((self._got[:nb] == np.uint64(want)) & (self._type[:nb] == GGML_TYPE_F32)).all():  # every step: one test
            return LayerRows(self.blocks, self.buf[:, :n_tokens], self._block_at)
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
        raise EpiKVError("the captured block outputs failed a check")  # (not reached: one block failed)

    def attn_rows(self, n_tokens: int) -> dict[str, dict[int, np.ndarray]]:
        """"q" / "k" / "v" -> layer -> [n_tokens, heads, head_dim] float32 of the last forward, each head's channels
        in transformers' order (views of the buffers, or copies when reordered: copy to keep); EpiKVError when a node
        was not seen with its op (a builder that names no rotated Qcur / Kcur or no Vcur), or was not float32
        [head_dim, heads, n_tokens] laid out contiguously."""
        self._raise_error()
        lo, hi = len(self.blocks), len(self.blocks) + len(self.attn_nodes)
        want_ne = self._want_ne.copy()
        want_ne[:, 2] = n_tokens
        ok = ((self._got[lo:hi] == self._row_bytes * np.uint64(n_tokens)) & (self._type[lo:hi] == GGML_TYPE_F32)
              & (self._ne[lo:hi] == want_ne).all(1) & (self._nb[lo:hi, :3] == self._want_nb).all(1))
        if not ok.all():
            self._refuse(n_tokens)
        out: dict[str, LayerRows] = {}
        for kind, ls in self.attn_layers.items():
            rows = self.attn_buf[kind][:, :n_tokens]  # [layers, tokens, heads, dim]
            if self.unpermute is not None and kind != "v" and ls:
                rows = rows[..., self.unpermute]  # one copy for every layer
            out[kind] = LayerRows(list(ls), rows)
        return out

    def _refuse(self, n_tokens: int) -> None:
        """The one-line error of attn_rows for its first node that fails a check."""
        s = self.struct
        for j, (kind, l, name, op, buf) in enumerate(self.attn_nodes):
            i = len(self.blocks) + j
            got = s.got[i]
            what = f"{name} ({KINDS[kind][1]} node)"
            if got == 0:
                noun = {"q": "rotated queries", "k": "rotated keys", "v": "values"}[kind]
                raise EpiKVError(f"llama.cpp's graph for this model has no node {what}: its builder does not name "
                                 f"the {noun} the policy reads, so they cannot be captured")
            if s.type[i] != GGML_TYPE_F32:
                raise EpiKVError(f"{what} is of ggml type {s.type[i]}, not float32")
            dim, heads = (int(x) for x in self._want_ne[j, :2])
            ne, nb = tuple(s.ne[i]), tuple(s.nb[i])
            want_ne, want_nb = (dim, heads, n_tokens, 1), tuple(int(x) for x in self._want_nb[j])
            if ne != want_ne or nb[:3] != want_nb or got != int(self._row_bytes[j]) * n_tokens:
                raise EpiKVError(f"{what} has shape {list(ne)} and strides {list(nb)} ({got} bytes) for {n_tokens} "
                                 f"tokens: not one contiguous [{dim}, {heads}] row a token as expected")
        raise EpiKVError("the captured query/key/value nodes failed a check")  # (not reached: one node failed)

    @property
    def asks(self) -> int:
        return int(self.struct.asks)
