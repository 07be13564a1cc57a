"""A GGUF file's header read in pure Python (no llama.cpp, no `gguf` package: both are optional) and the model's
fingerprint from it (issue 57 item 2), the llama.cpp engine's counterpart of epikv/fingerprint.py.

The fingerprint has the transformers one's form, '<signature as sorted JSON>|<checksum>': the signature holds the
same keys (model_type = the GGUF architecture, layers, hidden, heads, kv_heads, vocab = the token embedding's rows),
read from the GGUF metadata, so a GGUF and a transformers model of the same architecture and shapes share it; the
checksum, 'gguf:' and 16 hex digits of a sha256, covers the name, type, dimensions and first SAMPLE_BYTES bytes of
the token embedding and of every tensor of the first and the last block, as stored (quantized), so a fine-tune or
another checkpoint of the same shape differs. The stored bytes are not the transformers engine's values: a
transformers model and its GGUF conversion (or two quantizations of one model) have two fingerprints, and a weights
file accepts each one it lists (policies/learned.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import EpiKVError

SAMPLE_BYTES = 8192  # bytes hashed from each sampled tensor
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 4096  # numeric arrays up to this length are decoded (per-layer head counts); longer ones skipped


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class Tensor:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    offset: int  # absolute, in the file
    nbytes: int  # up to the next tensor's start (or the file's end): the tensor and its alignment padding


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    meta: dict  # key -> value (scalars, strings, small numeric arrays as lists; other arrays as their length)
    tensors: dict  # name -> Tensor


def read_header(path: str | Path, buf=None) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (versions 2 and 3); anything else is refused in one line."""
    p = Path(path)
    if buf is None:
        try:
            with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return read_header(p, m)
        except EpiKVError:
            raise
        except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
            raise EpiKVError(f"cannot read GGUF file {p}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return _parse(buf)
    except (_Truncated, struct.error, UnicodeDecodeError):
        raise EpiKVError(f"{p} is not a readable GGUF file (its header is truncated or damaged)") from None


def _parse(b) -> GGUFHeader:
    size = len(b)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise _Truncated
        v = struct.unpack_from(fmt, b, pos)[0]
        pos += n
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > size:
            raise _Truncated
        s = bytes(b[pos:pos + n]).decode("utf-8")
        pos += n
        return s

    def skip_string() -> None:
        nonlocal pos
        n = take("<Q")
        pos += n
        if pos > size:
            raise _Truncated

    def value(kind: int):
        nonlocal pos
        if kind in _SCALAR:
            return take(_SCALAR[kind])
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            sub, count = take("<I"), take("<Q")
            if sub in _SCALAR and count <= _SMALL_ARRAY:
                return [take(_SCALAR[sub]) for _ in range(count)]
            if sub in _SCALAR:  # a long numeric array (token types, scores): its length is all a fingerprint needs
                pos += count * struct.calcsize(_SCALAR[sub])
                if pos > size:
                    raise _Truncated
            elif sub == _STRING:
                for _ in range(count):
                    skip_string()
            else:  # arrays of arrays: not written by llama.cpp's converters
                raise _Truncated
            return count
        raise _Truncated

    if bytes(b[:4]) != b"GGUF":
        raise _Truncated
    pos = 4
    version = take("<I")
    if version not in (2, 3):  # version 1 (32-bit counts) predates every GGUF llama.cpp still loads
        raise _Truncated
    n_tensors, n_kv = take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        infos.append((name, take("<I"), dims, take("<Q")))
    align = meta.get("general.alignment", 32)
    align = align if isinstance(align, int) and align > 0 else 32
    data = pos + (-pos) % align
    starts = sorted({data + off for _, _, _, off in infos} | {size})
    nxt = {s: starts[i + 1] for i, s in enumerate(starts[:-1])}
    tensors = {}
    for name, kind, dims, off in infos:
        start = data + off
        if start > size:
            raise _Truncated
        tensors[name] = Tensor(name, kind, dims, start, nxt.get(start, size) - start)
    return GGUFHeader(version, meta, tensors)


def _num(v):
    """A head count as a number: a per-layer array of equal counts is that count, an uneven one the list."""
    if isinstance(v, list):
        return v[0] if v and all(x == v[0] for x in v) else v
    return v


def gguf_signature(h: GGUFHeader) -> dict:
    """The architecture and shapes, with the keys and meaning of fingerprint.model_signature."""
    m = h.meta
    arch = m.get("general.architecture")
    layers = m.get(f"{arch}.block_count")
    if not isinstance(arch, str) or not isinstance(layers, int):
        raise EpiKVError("this GGUF names no architecture or block count (general.architecture, <arch>.block_count)")
    heads = _num(m.get(f"{arch}.attention.head_count"))
    emb = h.tensors.get("token_embd.weight")
    vocab = emb.dims[1] if emb is not None and len(emb.dims) == 2 else m.get(f"{arch}.vocab_size",
                                                                           m.get("tokenizer.ggml.tokens"))
    return {"model_type": arch, "layers": layers, "hidden": m.get(f"{arch}.embedding_length"), "heads": heads,
            "kv_heads": _num(m.get(f"{arch}.attention.head_count_kv")) or heads, "vocab": vocab}


def _sampled(h: GGUFHeader, layers: int) -> list[Tensor]:
    out = [h.tensors["token_embd.weight"]] if "token_embd.weight" in h.tensors else []
    for blk in dict.fromkeys((0, layers - 1)):
        out += sorted((t for n, t in h.tensors.items() if n.startswith(f"blk.{blk}.")), key=lambda t: t.name)
    return out


def gguf_checksum(h: GGUFHeader, buf, layers: int) -> str:
    """'gguf:' and the first 16 hex digits of the sha256 of the sampled tensors' names, types, dimensions and
    first SAMPLE_BYTES stored bytes."""
    sample = _sampled(h, layers)
    if not sample:
        raise EpiKVError("this GGUF has no token embedding and no block tensors to fingerprint")
    d = hashlib.sha256()
    for t in sample:
        d.update(f"{t.name}:{t.ggml_type}:{','.join(map(str, t.dims))};".encode())
        d.update(bytes(buf[t.offset:t.offset + min(SAMPLE_BYTES, t.nbytes)]))
    return "gguf:" + d.hexdigest()[:16]


def gguf_fingerprint(path: str | Path) -> str:
    """'<signature as sorted JSON>|gguf:<checksum>' of a GGUF file; refused in one line when it cannot be read."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError as e:
        raise EpiKVError(f"cannot read GGUF file {p}: {e.strerror}") from None
    return _fingerprint(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _fingerprint(path: str, mtime: int, size: int) -> str:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            h = read_header(path, m)
            sig = gguf_signature(h)
            return json.dumps(sig, sort_keys=True) + "|" + gguf_checksum(h, m, sig["layers"])
    except EpiKVError:
        raise
    except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
        raise EpiKVError(f"cannot read GGUF file {path}: {getattr(e, 'strerror', None) or e}") from None
