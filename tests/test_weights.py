"""Learned weights tied to the model they were fitted on (issue 57 item 2): the GGUF fingerprint the llama.cpp engine
checks (read from the file's header), the shipped weights accepted for the embedded GGUF and refused for a same-shape
"fine-tune" of it, the weights cache folder the engines search and `epikv calibrate` writes to, `--weights FILE`
on the commands that run a learned policy, and `--also-for` recording a GGUF conversion."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from epikv.errors import EpiKVError
from epikv.fingerprint import model_fingerprint
from epikv.policies.learned import (LearnedWeights, accepted_fingerprints, cache_dir, find_weights, load_weights,
                                    shipped_weights)

from test_cli import run_bad, run_cli

EMBEDDED_GGUF_FP = ('{"heads": 9, "hidden": 576, "kv_heads": 3, "layers": 30, "model_type": "llama", "vocab": 49152}'
                    "|gguf:7bf629a34232ade6")
# sha256 of the shipped file's score tensors' bytes (the first 345,960 bytes after its header: bias, mean, std,
# weight): the weights the docs' tables measured, unchanged by the GGUF fingerprint added to the header and by the
# decay map appended after them (policies/learned.graft_decay)
SHIPPED_TENSORS = "c42787855d765ca917c9a531d6eae1eeb0f7055b1167add166f5015af33c8f98"
SCORE_BYTES = 345960


def _embedded_gguf() -> Path:
    from epikv.llamacpp.model import gguf_path

    return gguf_path("smollm2")


def _weights(path, fingerprint: str | None, seed: int, layers: int = 4, kv: int = 2, hidden: int = 64,
             model: str = "tiny") -> str:
    g = torch.Generator().manual_seed(seed)
    meta = {"model": model, **({"fingerprint": fingerprint} if fingerprint else {})}
    LearnedWeights(torch.randn(layers, kv, hidden, generator=g), torch.randn(layers, kv, generator=g),
                   torch.zeros(layers, hidden), torch.ones(layers, hidden), meta,
                   torch.randn(layers, kv, hidden, generator=g) * 0.01, torch.full((layers, kv), -0.03)).save(path)
    return str(path)


def _tuned(model):
    """The same architecture and shapes with every weight nudged, as a fine-tune leaves them."""
    tuned = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    return tuned


def _tiny_gguf(path, gguf, name: str = "tiny", alignment: int | None = None) -> Path:
    """A small GGUF of random:tiny's shapes (llama, 4 blocks, hidden 64, 4 heads, 2 KV heads, 49,152 tokens), written
    with the `gguf` package; never loaded by llama.cpp (two tensors a block)."""
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((49152, 64)).astype(np.float16))
    for blk in range(4):
        w.add_tensor(f"blk.{blk}.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float16))
        w.add_tensor(f"blk.{blk}.attn_norm.weight", rng.standard_normal(7).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def test_gguf_header_is_read_as_the_gguf_package_reads_it(tmp_path):
    """The pure-Python header reader (no llama.cpp, no `gguf` needed at run time) finds every tensor where the
    `gguf` package does, in the embedded GGUF and in one whose header ends off its 64-byte alignment, and the
    embedded one's signature is the transformers model's. Mutant: the tensor data's start not aligned to
    general.alignment (every offset off)."""
    gguf = pytest.importorskip("gguf")
    from epikv.llamacpp.gguf_file import gguf_signature, read_header

    odd = _tiny_gguf(tmp_path / "odd.gguf", gguf, name="odd-length-name", alignment=64)
    for path, n in ((_embedded_gguf(), 272), (odd, 9)):
        mine = read_header(path)
        ref = gguf.GGUFReader(str(path))
        assert len(mine.tensors) == len(ref.tensors) == n
        for t in ref.tensors:
            m = mine.tensors[t.name]
            assert (m.offset, m.dims, m.ggml_type) == (int(t.data_offset), tuple(int(x) for x in t.shape),
                                                       int(t.tensor_type)), (path, t.name)
            assert m.nbytes >= int(t.n_bytes)
    assert read_header(odd).meta["general.alignment"] == 64
    assert gguf_signature(read_header(_embedded_gguf())) == {"model_type": "llama", "layers": 30, "hidden": 576,
                                                             "heads": 9, "kv_heads": 3, "vocab": 49152}


def test_a_damaged_gguf_is_refused_in_one_line(tmp_path):
    """Mutant: the reader's bounds check removed (a truncated header reads past the end: struct.error escapes)."""
    from epikv.llamacpp.gguf_file import gguf_fingerprint

    src = _embedded_gguf()
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(100_000))  # inside the vocabulary: the header is cut
    with pytest.raises(EpiKVError) as e:
        gguf_fingerprint(bad)
    assert "\n" not in str(e.value) and "truncated or damaged" in str(e.value)
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(EpiKVError, match="not a readable GGUF"):
        gguf_fingerprint(tmp_path / "not.gguf")


def test_shipped_weights_fit_smollm2_and_its_embedded_gguf_with_their_tensors_unchanged():
    """The shipped file records the transformers SmolLM2's fingerprint and the embedded GGUF's (its header only was
    rewritten: the tensor bytes are those fitted). Mutant: accepted_fingerprints ignoring `also_fits` (the GGUF is
    then refused)."""
    from epikv.llamacpp.gguf_file import gguf_fingerprint

    [f] = shipped_weights()
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert {k: v["data_offsets"] for k, v in header.items() if k in ("bias", "mean", "std", "weight")} == {
        "bias": [0, 360], "mean": [360, 69480], "std": [69480, 138600], "weight": [138600, SCORE_BYTES]}
    assert hashlib.sha256(raw[8 + n:8 + n + SCORE_BYTES]).hexdigest() == SHIPPED_TENSORS
    lw = load_weights(f)
    assert gguf_fingerprint(_embedded_gguf()) == EMBEDDED_GGUF_FP
    assert find_weights(None, 30, fingerprint=EMBEDDED_GGUF_FP) is lw
    assert accepted_fingerprints(lw)[0].endswith("|ddd329c734b5459a")


def test_llamacpp_refuses_the_shipped_weights_on_a_same_shape_gguf_fine_tune(tmp_path, capsys):
    """Issue 57 item 2 in the llama.cpp engine: a GGUF of SmolLM2's architecture and shapes with other weights (the
    embedded file with a few stored bytes of its first block changed, as a fine-tune changes them) is refused in one
    line by the decoder and by `epikv generate --engine llama.cpp` (exit 2), with or without --weights naming the
    shipped file, while the embedded GGUF runs them. Mutant: weights chosen and checked by shape only (the
    fingerprint's signature part): the fine-tune gets SmolLM2's weights."""
    from epikv.llamacpp import LlamaDecoder, available, load_gguf
    from epikv.llamacpp.gguf_file import gguf_fingerprint

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    tuned = _tuned_gguf(tmp_path)
    fp = gguf_fingerprint(tuned)
    assert fp.split("|")[0] == EMBEDDED_GGUF_FP.split("|")[0] and fp != EMBEDDED_GGUF_FP
    gm = load_gguf(str(tuned))
    try:
        for name in ("epikv-learned-mean", "epikv-learned-decay"):
            with pytest.raises(EpiKVError) as e:
                LlamaDecoder(gm, name, 64, max_tokens=80, threads=1)
            assert "\n" not in str(e.value) and "other weights" in str(e.value), str(e.value)
    finally:
        gm.close()
    base = ["generate", "--engine", "llama.cpp", "--model", str(tuned), "--prompt", "Hi", "--raw",
            "--max-new-tokens", "4", "--budget", "32", "--threads", "1", "--policy", "epikv-learned-age"]
    assert "other weights" in run_bad(capsys, *base)
    line = run_bad(capsys, *base, "--weights", str(shipped_weights()[0]))
    assert "other weights" in line and "fingerprint" in line
    code, out, err = run_cli(capsys, *base[:4], "smollm2", *base[5:])  # the embedded GGUF: its own weights
    assert code == 0, err


def test_engines_choose_the_cached_file_fitted_on_their_model(tiny, tmp_path, monkeypatch):
    """The weights cache folder holds two files of random:tiny's shape: the one fitted on it and, written later (so
    first by date), one fitted on a fine-tune of it. Each model gets its own file, in the torch engine and the
    paged server; a model whose fingerprint no file records is refused in one line naming the folder. Mutant: the
    first file of the model's shape taken (fingerprints not compared)."""
    from epikv.engine import Decoder
    from epikv.serving import ServeSpec, check_serving

    monkeypatch.setenv("EPIKV_WEIGHTS_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    assert cache_dir() == tmp_path / "cache"
    tuned = _tuned(tiny.model)
    other = _tuned(tuned)
    own = _weights(tmp_path / "cache" / "a-own.safetensors", model_fingerprint(tiny.model, tiny.model.model.layers),
                   1, model="own")
    _weights(tmp_path / "cache" / "b-tuned.safetensors", model_fingerprint(tuned, tuned.model.layers), 2,
             model="tuned")
    import os

    os.utime(own, ns=(1, 1))  # the tuned model's file is newer
    for model, want in ((tiny.model, "own"), (tuned, "tuned")):
        dec = Decoder(model, "epikv-learned-mean", 24)
        assert dec.cache.policy._checked[1].meta["model"] == want
        with torch.inference_mode():
            dec.prefill(torch.randint(3, 900, (1, 12), generator=torch.Generator().manual_seed(0)), [0])
        assert dec.cache.state["_lw"].meta["model"] == want
        spec = ServeSpec(policy="epikv-learned-decay", budget=64, page=8, num_blocks=32, max_batch_tokens=32)
        assert check_serving(model, spec)._checked[1].meta["model"] == want
    with pytest.raises(EpiKVError) as e:
        Decoder(other, "epikv-learned-window", 24)
    msg = str(e.value)
    assert "\n" not in msg and "other weights" in msg, msg


def test_calibrate_writes_to_the_cache_folder_and_the_engines_find_it(tiny, tmp_path, monkeypatch, capsys):
    """`epikv calibrate` without --out writes MODEL-CHECKSUM.safetensors into $EPIKV_WEIGHTS_DIR (created), and
    `epikv generate` with a learned policy then runs on that model with no weights named. Mutant: the engines not
    looking in the cache folder (cached_weights() empty)."""
    cache = tmp_path / "new" / "cache"
    monkeypatch.setenv("EPIKV_WEIGHTS_DIR", str(cache))
    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"id": f"x{i}", "text": f"Step {i}: add {i} and {i + 1} to get {2 * i + 1}."
                                         " Then multiply by two."}) + "\n" for i in range(3)))
    gen = ["generate", "--model", "random:tiny", "--prompt", "Hello there", "--raw", "--max-new-tokens", "6",
           "--budget", "16", "--recent", "4", "--policy", "epikv-learned-mean"]
    assert "no weights fit this model" in run_bad(capsys, *gen)
    code, out, err = run_cli(capsys, "calibrate", "--model", "random:tiny", "--texts", str(texts), "--max-tokens", "24")
    assert code == 0, err
    check = model_fingerprint(tiny.model, tiny.model.model.layers).rsplit("|", 1)[1]
    written = Path(json.loads(out)["out"])
    assert written == cache / f"random-tiny-{check}.safetensors" and written.is_file()
    code, _, err = run_cli(capsys, *gen)
    assert code == 0, err


def test_weights_option_names_a_file_checked_against_the_model(tiny, tmp_path, capsys):
    """--weights FILE runs a learned policy with that file (outside every searched folder); a missing file, a file
    fitted on another model of the same shape, and --weights beside a policy that reads none are refused in one
    line (exit 2), on every command that runs a policy. Mutant: --weights not passed to the policy (the tiny model
    then has no weights)."""
    fp = model_fingerprint(tiny.model, tiny.model.model.layers)
    mine = _weights(tmp_path / "mine.safetensors", fp, 3)
    theirs = _weights(tmp_path / "theirs.safetensors", fp.rsplit("|", 1)[0] + "|0123456789abcdef", 4)
    gen = ["generate", "--model", "random:tiny", "--prompt", "Hello there", "--raw", "--max-new-tokens", "6",
           "--budget", "16", "--recent", "4", "--policy", "epikv-learned-decay"]
    code, _, err = run_cli(capsys, *gen, "--weights", mine)
    assert code == 0, err
    line = run_bad(capsys, *gen, "--weights", theirs)
    assert "other weights" in line
    assert "no such file" in run_bad(capsys, *gen, "--weights", str(tmp_path / "none.safetensors"))
    assert "not an epikv-learned/1 file" in run_bad(capsys, *gen, "--weights", str(_write(tmp_path / "x.safetensors")))
    assert "--weights is read by the epikv-learned policies" in run_bad(
        capsys, *gen[:-1], "random", "--weights", mine)
    missing = str(tmp_path / "none.safetensors")
    for argv in (["eval", "--dataset", "gsm8k", "--out", str(tmp_path / "e")],
                 ["retention", "--out", str(tmp_path / "r")],
                 ["bench", "speed"], ["serve"], ["trace", "--prompt", "x", "--completion", "y"]):
        pol = ["--policies" if argv[0] in ("eval", "retention", "bench") else "--policy", "epikv-learned-mean"]
        line = run_bad(capsys, *argv, "--model", "random:tiny", *pol, "--weights", missing)
        assert "no such file" in line, (argv, line)


def _write(path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "other"})
    return path


def test_also_for_records_a_gguf_conversion_of_the_same_shape(tiny, tmp_path, capsys):
    """`epikv calibrate --also-for FILE.gguf` records the GGUF's fingerprint beside the model's, so find_weights
    picks the file for that GGUF; a GGUF of another shape (the embedded SmolLM2 for random:tiny) is refused in one
    line before any text is run. Mutant: no shape check on --also-for (SmolLM2's fingerprint recorded for tiny)."""
    gguf = pytest.importorskip("gguf")
    from epikv.llamacpp.gguf_file import gguf_fingerprint

    path = _tiny_gguf(tmp_path / "tiny.gguf", gguf)
    fp = gguf_fingerprint(path)
    assert fp.rsplit("|", 1)[0] == model_fingerprint(tiny.model, tiny.model.model.layers).rsplit("|", 1)[0]
    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"id": f"x{i}", "text": f"Step {i}: add {i} and {i + 1}."}) + "\n"
                             for i in range(2)))
    argv = ["calibrate", "--model", "random:tiny", "--texts", str(texts), "--max-tokens", "16"]
    line = run_bad(capsys, *argv, "--out", str(tmp_path / "no.safetensors"), "--also-for", "smollm2")
    assert "another architecture or shape" in line
    assert "no such file" in run_bad(capsys, *argv, "--also-for", str(tmp_path / "none.gguf"))
    out = tmp_path / "w.safetensors"
    code, _, err = run_cli(capsys, *argv, "--out", str(out), "--also-for", str(path))
    assert code == 0, err
    lw = load_weights(out)
    assert accepted_fingerprints(lw)[1:] == [fp]
    assert find_weights(str(out), 4, fingerprint=fp) is lw


def test_add_fingerprints_rewrites_the_header_only(tmp_path):
    """add_fingerprints (how the shipped file gained the embedded GGUF's fingerprint) appends to the fingerprints a
    file fits and leaves its tensor bytes as they were; one of another shape is refused in one line. Mutant: the
    list replaced instead of appended to (the first conversion recorded is lost)."""
    from epikv.policies.learned import add_fingerprints

    sig = '{"heads": 4, "hidden": 64, "kv_heads": 2, "layers": 4, "model_type": "llama", "vocab": 49152}'
    path = Path(_weights(tmp_path / "w.safetensors", sig + "|00000000000000aa", 6))

    def tensor_bytes():
        raw = path.read_bytes()
        return raw[8 + struct.unpack("<Q", raw[:8])[0]:]

    before = tensor_bytes()
    assert add_fingerprints(path, [sig + "|gguf:00000000000000bb"]) == [sig + "|gguf:00000000000000bb"]
    assert add_fingerprints(path, [sig + "|gguf:00000000000000cc", sig + "|00000000000000aa"]) == \
        [sig + "|gguf:00000000000000cc"]
    assert tensor_bytes() == before
    assert accepted_fingerprints(load_weights(path)) == [sig + "|00000000000000aa", sig + "|gguf:00000000000000bb",
                                                         sig + "|gguf:00000000000000cc"]
    with pytest.raises(EpiKVError, match="another shape"):
        add_fingerprints(path, [sig.replace('"layers": 4', '"layers": 30') + "|gguf:00000000000000dd"])


def test_the_default_falls_back_where_no_weights_fit_and_a_named_policy_is_refused(tiny, tmp_path, monkeypatch):
    """Issue 57 item 4's fallback: a learned policy given as the default (DefaultName: no policy named) on a model no
    weights were fitted on runs FALLBACK_POLICY instead with one DefaultFallbackWarning, in the torch engine, the
    paged server's check and the llama.cpp decoder (a same-shape fine-tune of the embedded GGUF); the same name given
    as a plain string is refused in one line. Mutants: the fallback taken for any policy (the named one runs
    streaming), no warning, the fallback without the caller's tau."""
    import warnings

    from epikv.cache import EpiKVCache
    from epikv.errors import DefaultFallbackWarning
    from epikv.policies import FALLBACK_POLICY, DefaultName
    from epikv.serving import ServeSpec, check_serving

    monkeypatch.setenv("EPIKV_WEIGHTS_DIR", str(tmp_path / "empty"))
    default = DefaultName("epikv-learned-decay")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        cache = EpiKVCache(tiny.model, default, budget=24, tau=4)
        spec = ServeSpec(policy=default, budget=64, page=8, num_blocks=32, max_batch_tokens=32)
        served = check_serving(tiny.model, spec)
    assert cache.policy.name == FALLBACK_POLICY and cache.policy.tau == 4 and served.name == FALLBACK_POLICY
    msgs = [str(w.message) for w in got if issubclass(w.category, DefaultFallbackWarning)]
    assert len(msgs) == 2 and all("\n" not in m and FALLBACK_POLICY in m and "epikv-learned-decay" in m
                                  for m in msgs), msgs
    for named in ("epikv-learned-decay", str(default)):
        with pytest.raises(EpiKVError):
            EpiKVCache(tiny.model, named, budget=24)
    with pytest.raises(EpiKVError):  # a default with its own settings was chosen by the caller: refused too
        EpiKVCache(tiny.model, default, budget=24, per_token=False, beta=0.5)


def _tuned_gguf(tmp_path):
    """The embedded GGUF with a few bytes of one weight changed: a same-shape fine-tune, another fingerprint."""
    from epikv.llamacpp.gguf_file import read_header

    tuned = tmp_path / "tuned.gguf"
    shutil.copyfile(_embedded_gguf(), tuned)
    t = read_header(tuned).tensors["blk.0.attn_q.weight"]
    with open(tuned, "r+b") as f:  # Q4_1 blocks: 2-byte scale, 2-byte minimum, 16 bytes of nibbles; nibbles changed
        f.seek(t.offset + 4)
        b = f.read(16)
        f.seek(t.offset + 4)
        f.write(bytes(x ^ 0x11 for x in b))
    return tuned


def test_llamacpp_default_falls_back_on_a_gguf_no_weights_fit(tmp_path, monkeypatch):
    """The llama.cpp decoder on a same-shape fine-tune of the embedded GGUF: the default runs FALLBACK_POLICY, a named
    learned policy is refused, and the embedded GGUF itself runs the learned default (its weights ship). Mutant: the
    fallback taken where the weights fit."""
    import warnings

    from epikv.errors import DefaultFallbackWarning
    from epikv.llamacpp import LlamaDecoder, load_gguf
    from epikv.policies import FALLBACK_POLICY, DefaultName

    monkeypatch.setenv("EPIKV_WEIGHTS_DIR", str(tmp_path / "empty"))
    tuned = _tuned_gguf(tmp_path)
    default = DefaultName("epikv-learned-decay")
    for path, want in ((tuned, FALLBACK_POLICY), (_embedded_gguf(), "epikv-learned-decay")):
        gm = load_gguf(str(path))
        try:
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                dec = LlamaDecoder(gm, default, 64, max_tokens=80, threads=1)
            assert dec.policy.name == want
            assert any(issubclass(w.category, DefaultFallbackWarning) for w in got) == (want == FALLBACK_POLICY)
            if want == FALLBACK_POLICY:
                with pytest.raises(EpiKVError):
                    LlamaDecoder(gm, "epikv-learned-decay", 64, max_tokens=80, threads=1)
        finally:
            gm.close()


def test_llamacpp_serve_kv_memory_warns_the_fallback_once(tmp_path, monkeypatch):
    """`epikv serve --engine llama.cpp --kv-memory` with no policy named, on a GGUF no weights fit: the budget is sized
    for the fallback and the backend runs that very policy, with one DefaultFallbackWarning (not one from the sizing
    and another from the backend). Mutant: the backend given the policy's name instead of the sized policy."""
    import warnings

    from epikv.errors import DefaultFallbackWarning
    from epikv.policies import FALLBACK_POLICY, DefaultName
    from epikv.serving.build import _prepare_llamacpp
    from epikv.serving.config import ServeConfig

    monkeypatch.setenv("EPIKV_WEIGHTS_DIR", str(tmp_path / "empty"))
    tuned = _tuned_gguf(tmp_path)
    cfg = ServeConfig(model=str(tuned), engine="llama.cpp", policy=DefaultName("epikv-learned-decay"),
                      kv_memory=24 << 20, sequences=1, threads=1)
    from epikv.serving import llamacpp as served

    made = []
    init = served.LlamaBackend.__init__
    monkeypatch.setattr(served.LlamaBackend, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _prepare_llamacpp(cfg)
    (backend,) = made
    try:
        assert backend.policy.name == FALLBACK_POLICY
        assert sum(issubclass(w.category, DefaultFallbackWarning) for w in got) == 1, [str(w.message) for w in got]
    finally:
        backend.stop()
