"""`epikv calibrate --engine llama.cpp` (issue 57 item 2): calibrate's per-layer runs through llama.cpp on a GGUF
are transformers' eager runs of the same weights (features, attention weights recomputed from the captured rotated
queries and keys, values, W_o de-quantized from the file, and the targets fitted on them), and the file it writes
is the one the llama.cpp engine accepts for that GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")

from test_learned import _cli  # noqa: E402


@pytest.fixture(scope="module")
def gguf():
    from epikv.llamacpp import load_gguf
    from epikv.llamacpp.model import gguf_path

    return load_gguf("smollm2"), gguf_path("smollm2")


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.flatten().double().numpy(), b.flatten().double().numpy())[0, 1])


def test_gguf_runs_are_transformers_eager_runs_of_the_same_weights(gguf):
    """On one 96-token text of the embedded SmolLM2, layer by layer (first, second, middle, last two): the features, the
    attention weights, the values, W_o and both score targets and the decay targets of the llama.cpp run correlate
    with transformers' eager run above 0.998 (llama.cpp computes with Q8 activations; measured: 0.999 and up).
    Mutants: the scale 1/d instead of 1/sqrt(d), no causal mask, W_o transposed, the features one block late."""
    from epikv.calibrate import attention_targets, decay_targets, torch_runs
    from epikv.llamacpp.calibrate import gguf_runs
    from epikv.models import load_model

    gm, path = gguf
    runs = gguf_runs(gm, path, 96, 1)
    lm = load_model("smollm2", attn_implementation="eager")
    tr = torch_runs(lm.model, lm.tokenizer)
    text = "Let x be the number of apples. Then 3x + 5 = 20, so 3x = 15 and x = 5. " * 8
    ids = torch.tensor([tr.tokenize(text)[:96]])
    assert runs.tokenize(text)[:96] == ids[0].tolist()  # the GGUF's vocabulary is the checkpoint's
    try:
        ours = runs.layers(ids)
    finally:
        runs.close()
    ref = tr.layers(ids)
    assert runs.signature["layers"] == len(ours) == len(ref) == 30
    for l in (0, 1, 15, 28, 29):
        (x, a, v, wo), (xr, ar, vr, wor) = ours[l], ref[l]
        assert x.shape == xr.shape and a.shape == ar.shape and v.shape == vr.shape and wo.shape == wor.shape
        assert min(_corr(x, xr), _corr(a, ar), _corr(v, vr), _corr(wo, wor)) > 0.998, l
        # the residual stream moves little from one block to the next (correlation 0.999 too): the relative error
        # tells them apart (measured: at most 0.014 at the same block, 0.02 to 1.0 at the next)
        assert float((x - xr).norm() / xr.norm()) < 0.018, l
        t, tref = attention_targets(a, v, wo), attention_targets(ar, vr, wor)
        for k in t:
            assert _corr(t[k][:, 1:], tref[k][:, 1:]) > 0.998, (l, k)
        (lb, ok), (lbr, okr) = decay_targets(a, v.shape[0], 32), decay_targets(ar, vr.shape[0], 32)
        assert torch.equal(ok, okr) and _corr(lb[:, ok], lbr[:, ok]) > 0.99, l


def test_cli_calibrates_a_gguf_into_weights_the_llama_cpp_engine_takes(gguf, tmp_path, capsys):
    """`epikv calibrate --engine llama.cpp --model smollm2` writes a file that records the GGUF's fingerprint (so
    --engine llama.cpp finds and accepts it for that file) and the GGUF's shapes; --weights runs it. Mutant: the
    file records no fingerprint (then only its shape ties it to the model). The decay map is fitted too (the
    file runs epikv-learned-decay)."""
    from epikv.llamacpp.gguf_file import gguf_fingerprint
    from epikv.policies.learned import find_weights, fitted_on, load_weights

    gm, path = gguf
    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"id": f"x{i}", "text": f"Step {i}: add {i} and {i + 1} to get {2 * i + 1}. "
                                         "Then multiply the result by two and check it once more. " * 3}) + "\n"
                             for i in range(3)))
    out = tmp_path / "w.safetensors"
    code, stdout, err = _cli(["calibrate", "--engine", "llama.cpp", "--model", "smollm2", "--texts", str(texts),
                              "--max-tokens", "64", "--threads", "1", "--horizon", "16", "--out", str(out)], capsys)
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["engine"] == "llama.cpp" and report["texts"] == 3 and report["tokens"] > 100
    lw = load_weights(out)
    fp = gguf_fingerprint(path)
    assert fitted_on(lw, fp) and lw.weight.shape[:2] == (gm.n_layers, gm.n_head_kv)
    find_weights(str(out), gm.n_layers, gm.n_head_kv, gm.n_embd, fingerprint=fp)  # accepted, checksum included
    code, stdout, err = _cli(["generate", "--engine", "llama.cpp", "--policy", "epikv-learned-decay", "--weights", str(out),
                              "--budget", "48", "--tau", "8", "--max-new-tokens", "24", "--threads", "1", "--prompt",
                              "Count from one to twenty."], capsys)
    assert code == 0, err


@pytest.mark.parametrize("argv, needle", [
    (["--device", "cpu"], "--device: torch engine options"),
    (["--attn", "sdpa"], "--attn: torch engine options"),
])
def test_calibrate_on_llama_cpp_refuses_torch_options_in_one_line(tmp_path, capsys, argv, needle):
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"id": "a", "text": "one two three"}) + "\n")
    code, _, err = _cli(["calibrate", "--engine", "llama.cpp", "--texts", str(texts), "--out",
                         str(tmp_path / "w.safetensors"), *argv], capsys)
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_weights_fitted_from_the_gguf_score_held_texts_as_the_transformers_fit_does(gguf, tmp_path):
    """Calibrate on the same 8 GSM8K texts (the package's copy; 256 tokens each) once through llama.cpp on the GGUF
    and once through transformers on its weights; on 2 held texts the two files' scores (every layer and KV head)
    correlate above 0.98, and so do their log retention rates (measured: 0.999 and 0.995 on both held texts). Mutant:
    the GGUF run's features one block late (its score then rates other hidden states: 0.88 and 0.51)."""
    from importlib import resources

    from epikv.calibrate import calibrate, torch_runs
    from epikv.llamacpp.calibrate import gguf_runs
    from epikv.models import load_model
    from epikv.policies.learned import feature_block, linear_scores

    gm, path = gguf
    rows = [json.loads(l) for l in resources.files("epikv.datasets").joinpath("gsm8k_test.jsonl")
            .read_text(encoding="utf-8").splitlines()[:40]]
    texts = [(f"g{i}", "\n\n".join(f"{r['problem']}\n{r['solution']}" for r in rows[4 * i: 4 * i + 4]))
             for i in range(10)]
    fit, held = texts[:8], texts[8:]
    runs = gguf_runs(gm, path, 256, 1)
    try:
        ours, _ = calibrate(runs, None, fit, str(tmp_path / "gguf.safetensors"), max_tokens=256, horizon=64)
    finally:
        runs.close()
    lm = load_model("smollm2", attn_implementation="eager")
    tr = torch_runs(lm.model, lm.tokenizer)
    ref, _ = calibrate(lm.model, lm.tokenizer, fit, str(tmp_path / "torch.safetensors"), max_tokens=256, horizon=64)
    assert ours.has_decay and ref.has_decay
    for _, text in held:
        ids = torch.tensor([tr.tokenize(text)[:256]])
        hidden = {feature_block(l): r[0][None] for l, r in enumerate(tr.layers(ids))}  # block -> [1, T, dim]
        (s1, d1), (s2, d2) = (linear_scores(w, hidden, gm.n_layers, decay=True) for w in (ours, ref))
        assert _corr(s1, s2) > 0.98 and _corr(d1, d2) > 0.98, (_corr(s1, s2), _corr(d1, d2))
