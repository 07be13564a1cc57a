"""Anatomy: occlusion labels, per-layer profile, band files (METHOD.md section 5). CPU, tiny random models."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from epikv.anatomy import labels as L  # noqa: E402
from epikv.anatomy.bands import choose_bands  # noqa: E402
from epikv.anatomy.profile import (LayerDeltas, TraceArrays, layer_deltas, partial_spearman_layers,  # noqa: E402
                                   profile_stats, spearman_layers, trailing_mean)
from epikv.cli import build_parser, main  # noqa: E402
from epikv.commands.common import policy_settings  # noqa: E402
from epikv.engine import Decoder  # noqa: E402
from epikv.errors import EpiKVError  # noqa: E402
from epikv.models import load_model  # noqa: E402
from epikv.policies import get_policy  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)  # a shared CPU: one thread is much faster under contention
    return load_model("random:tiny")


# -- window bookkeeping ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("r0,r1,w,s", [(5, 70, 8, 4), (3, 40, 32, 16), (10, 11, 32, 16), (0, 37, 5, 5)])
def test_windows_cover_every_reasoning_token_exactly_by_its_windows(r0, r1, w, s):
    wins = L.windows(r0, r1, w, s)
    assert all(r0 <= a < b <= r1 and b - a <= w for a, b in wins)
    for t in range(r0, r1):
        covering = [(a, b) for a, b in wins if a <= t < b]
        # every token is covered, by exactly the windows whose start lies in (t - w, t]
        assert covering and {a for a, _ in covering} == {a for a in range(r0, r1, s) if t - w < a <= t}
    vals = list(range(len(wins)))
    lab = L.token_labels(r1 + 6, wins, vals, "nll")
    assert all(v is None for v in lab[:r0] + lab[r1:])  # prompt and answer excluded
    assert all(lab[t] == max(k for k, (a, b) in enumerate(wins) if a <= t < b) for t in range(r0, r1))


def test_flip_labels_or_over_covering_windows():
    wins = L.windows(0, 12, 4, 2)
    flips = [0.0] * len(wins)
    flips[2] = 1.0  # window [4, 8)
    lab = L.token_labels(12, wins, flips, "flip")
    assert lab == [1.0 if 4 <= t < 8 else 0.0 for t in range(12)]


def test_stride_larger_than_window_is_rejected():
    with pytest.raises(EpiKVError, match="stride"):
        L.windows(0, 100, 8, 16)


def test_trace_spans_from_text(tiny):
    tok = tiny.tokenizer
    row = {"id": "x", "prompt": "Problem: add 2 and 3.\nSolution: \n<think>\n",
           "trace": "<think>\nFirst I add two and three carefully. That gives five.\n</think>\n\nThe answer is "
                    "\\boxed{5}. Done."}
    ids, offs, sp, n_reason = L.tokenize_trace(tok, row, answer_tokens=64, max_reasoning=None)
    text, p_chars = L.trace_text(row)
    assert text.startswith(row["prompt"]) and "<think>\nFirst" not in text[p_chars:]
    assert offs[sp.r0][1] > p_chars and offs[sp.r0 - 1][1] <= p_chars  # first reasoning token starts the trace
    assert tok.decode(ids[sp.r1 : sp.a1]).strip().startswith("The answer")  # answer = first non-space after </think>
    assert "</think>" in tok.decode(ids[sp.r0 : sp.r1]) and sp.a1 == len(ids) and n_reason == sp.r1 - sp.r0
    ids2, _, sp2, n2 = L.tokenize_trace(tok, row, answer_tokens=3, max_reasoning=4)
    assert sp2.r1 - sp2.r0 == 4 and sp2.a1 - sp2.r1 == 3 and n2 == n_reason
    assert ids2[sp2.r1 :] == ids[sp.r1 : sp.r1 + 3] and ids2[: sp2.r1] == ids[: sp.r0 + 4]


def test_extract_answer():
    assert L.extract_answer("so \\boxed{\\dfrac{1}{2}} and \\boxed{ 6.0 }") == "6"
    assert L.extract_answer("it is \\boxed{\\frac{a}{b}}.") == "\\frac{a}{b}"
    assert L.extract_answer("total 1,250 then 42.") == "42"
    assert L.extract_answer("no answer here") is None


# -- the prefix cache ------------------------------------------------------------------------------------------------
def test_forked_prefix_cache_equals_a_fresh_run(tiny):
    model = tiny.model
    x = torch.randint(5, 4000, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        base = Decoder(model, "full", budget=None)
        base.prefill(x[:, :30], [0])
        dec = base.fork(17)
        forked = dec.step(x[:, 17:40], all_logits=True)
        ref = model(input_ids=x).logits[:, 17:40]
        assert torch.allclose(forked, ref, atol=1e-4)
        assert base.cache.get_seq_length() == 30 and dec.cache.get_seq_length() == 40  # the base is untouched
        assert dec.cache.token_data["pos"][0].tolist() == list(range(40))  # positions stay aligned


# -- planted dependency ----------------------------------------------------------------------------------------------
def _planted(model, tok):
    """Reasoning = EOS everywhere except a planted span of distinct tokens; answer = the model's own greedy
    continuation. Occluding plain EOS with EOS changes nothing, so only windows over the span can matter."""
    eos = tok.eos_token_id
    prompt = [101, 202, 303, 404, 505]
    reasoning = [eos] * 48
    span = (len(prompt) + 20, len(prompt) + 28)
    reasoning[20:28] = [1500 + 37 * k for k in range(8)]
    ids = prompt + reasoning
    with torch.inference_mode():
        ans = []
        x = torch.tensor([ids])
        for _ in range(6):
            nxt = int(model(input_ids=x).logits[0, -1].argmax())
            ans.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], 1)
    return ids + ans, L.Spans(len(prompt), len(prompt) + 48, len(ids) + 6), span


def test_planted_span_gets_the_highest_nll_label(tiny):
    ids, sp, (p0, p1) = _planted(tiny.model, tiny.tokenizer)
    res = L.occlusion_labels(tiny.model, tiny.tokenizer, ids, sp, kind="nll", window=8, stride=4, filler="eos")
    lab = res["labels"]
    hits = [k for k, (a, b, _) in enumerate(res["windows"]) if a < p1 and b > p0]
    for k, (a, b, v) in enumerate(res["windows"]):
        if k not in hits:
            assert abs(v) < 1e-4  # identical input: no change
    assert max(res["windows"][k][2] for k in hits) > 0.01
    # the planted span holds the highest label; tokens no span window covers stay at 0
    near = {t for a, b, _ in res["windows"] if a < p1 and b > p0 for t in range(a, b)}
    top = max(lab[t] for t in range(sp.r0, sp.r1))
    assert max(lab[t] for t in range(p0, p1)) == top > 0.01
    assert all(abs(lab[t]) < 1e-4 for t in range(sp.r0, sp.r1) if t not in near)
    assert all(v is None for v in lab[: sp.r0] + lab[sp.r1 :])
    assert res["clean"]["answer_nll"] > 0 and res["filler_id"] == tiny.tokenizer.eos_token_id


def test_planted_span_flips_the_regenerated_answer(tiny, monkeypatch):
    monkeypatch.setattr(L, "extract_answer", lambda text: text)  # a random model writes no \boxed{}: compare text
    ids, sp, (p0, p1) = _planted(tiny.model, tiny.tokenizer)
    res = L.occlusion_labels(tiny.model, tiny.tokenizer, ids, sp, kind="flip", window=8, stride=4, filler="eos",
                             regen_tokens=6)
    flipped = {t for t in range(sp.r0, sp.r1) if res["labels"][t] == 1.0}
    covering_span = {t for a, b, _ in res["windows"] if a < p1 and b > p0 for t in range(a, b)}
    # some window over the span flips the answer; no window away from it can (its input is unchanged)
    assert flipped & set(range(p0, p1)) and flipped <= covering_span
    assert all(v == 0.0 for a, b, v in res["windows"] if b <= p0 or a >= p1)


def test_random_filler_is_seeded(tiny):
    a = L.filler_ids(tiny.tokenizer, "random", 8, 1000, seed=3)
    assert torch.equal(a, L.filler_ids(tiny.tokenizer, "random", 8, 1000, seed=3))
    assert not torch.equal(a, L.filler_ids(tiny.tokenizer, "random", 8, 1000, seed=4))


def _tokenizer_with_pad(tok, pad: str):
    import copy

    tok = copy.deepcopy(tok)
    tok.pad_token = pad
    return tok


@pytest.mark.parametrize("model", ["smollm2", "random:tiny"])
def test_pad_filler_is_refused_when_pad_is_eos(model):
    tok = load_model(model).tokenizer
    # SmolLM2's tokenizer (random:tiny uses it too) pads with <|im_end|>, its EOS: pad would be eos again
    assert tok.pad_token_id == tok.eos_token_id == 2
    with pytest.raises(EpiKVError, match="pad token is its EOS token"):
        L.filler_ids(tok, "pad", 4, 1000, 0)
    assert L.filler_token(tok, "eos") == 2 and L.filler_token(tok, "random") is None
    distinct = _tokenizer_with_pad(tok, "<|endoftext|>")  # a model whose pad token is not EOS
    assert L.filler_token(distinct, "pad") == 0 != L.filler_token(distinct, "eos")
    assert L.filler_ids(distinct, "pad", 3, 1000, 0).tolist() == [0, 0, 0]


def test_label_records_name_the_filler_token(tiny):
    ids = list(range(300, 340))
    sp = L.Spans(5, 30, 36)
    distinct = _tokenizer_with_pad(tiny.tokenizer, "<|endoftext|>")
    res = L.occlusion_labels(tiny.model, distinct, ids, sp, kind="nll", window=8, stride=8, filler="pad")
    assert res["filler_id"] == 0 and res["filler_token"] == "<|endoftext|>"
    res = L.occlusion_labels(tiny.model, tiny.tokenizer, ids, sp, kind="nll", window=8, stride=8, filler="eos")
    assert res["filler_id"] == 2 and res["filler_token"] == "<|im_end|>"
    with pytest.raises(EpiKVError, match="pad token is its EOS"):
        L.occlusion_labels(tiny.model, tiny.tokenizer, ids, sp, kind="nll", window=8, stride=8, filler="pad")


# -- profile ---------------------------------------------------------------------------------------------------------
def test_layer_deltas_match_the_model_hidden_states(tiny):
    ids = list(range(300, 345))
    g = layer_deltas(tiny.model, ids, chunk=16)  # chunked through the engine
    with torch.inference_mode():
        hs = tiny.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    for l in range(len(hs) - 2):  # transformers applies the final norm to the last entry: raw blocks only
        h = hs[l + 1][0].double()  # block l's output
        ref = (h[1:] - h[:-1]).norm(dim=-1).numpy()
        np.testing.assert_allclose(g[l, 1:], ref, rtol=1e-3, atol=1e-4)
    assert (g[:, 0] == 0).all() and LayerDeltas().observes(4).hidden_layers == (0, 1, 2, 3)


def test_trailing_mean():
    x = np.array([[1.0, 2, 3, 4, 5]])
    np.testing.assert_allclose(trailing_mean(x, 2), [[1, 1.5, 2.5, 3.5, 4.5]])
    np.testing.assert_allclose(trailing_mean(x, 64), [[1, 1.5, 2, 2.5, 3]])


def _fake_traces(n=6, m=80, layers=5, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        y = rng.normal(size=m)
        y[::7] = 0.0  # ties
        g = rng.normal(size=(layers, m))
        g[1] += 0.8 * y  # layer 1 positive, layer 3 negative
        g[3] -= 0.8 * y
        out.append(TraceArrays(f"t{k}", g, y, np.linspace(0, 1, m), np.abs(g)))
    return out


def test_profile_rho_equals_scipy_and_bootstrap_is_seeded():
    tr = _fake_traces()
    st = profile_stats(tr, n_boot=200, seed=7)
    g_all = np.concatenate([t.g for t in tr], -1)
    y_all = np.concatenate([t.y for t in tr])
    for l in range(5):
        assert st["pooled"][l] == pytest.approx(spearmanr(g_all[l], y_all).statistic, abs=1e-12)
        per = [spearmanr(t.g[l], t.y).statistic for t in tr]
        assert st["trace_mean"][l] == pytest.approx(np.mean(per), abs=1e-12)
        lo, hi = st["pooled_ci"][l]
        assert lo <= st["pooled"][l] <= hi
    assert st["pooled_ci"][1][0] > 0 and st["pooled_ci"][3][1] < 0
    again = profile_stats(tr, n_boot=200, seed=7)
    np.testing.assert_array_equal(st["pooled_ci"], again["pooled_ci"])
    other = profile_stats(tr, n_boot=200, seed=8)
    assert not np.array_equal(st["trace_mean_ci"], other["trace_mean_ci"])
    assert np.isnan(spearman_layers(np.ones((1, 5)), np.arange(5.0)))[0]


def test_partial_rho_matches_the_textbook_formula():
    rng = np.random.default_rng(3)
    pos = np.linspace(0, 1, 60)
    y = pos + rng.normal(size=60) * 0.3
    g = np.stack([pos + rng.normal(size=60) * 0.3, rng.normal(size=60)])
    got = partial_spearman_layers(g, y, pos)
    for l in range(2):
        r = lambda a, b: spearmanr(a, b).statistic  # noqa: E731
        rgy, rgp, ryp = r(g[l], y), r(g[l], pos), r(y, pos)
        assert got[l] == pytest.approx((rgy - rgp * ryp) / np.sqrt((1 - rgp**2) * (1 - ryp**2)), abs=1e-10)
    assert abs(got[0]) < abs(spearmanr(g[0], y).statistic)  # the shared position trend is removed


# -- bands -----------------------------------------------------------------------------------------------------------
def _profile_dict(rho, ci=None):
    ci = ci or [[r - 0.05, r + 0.05] for r in rho]
    return {"model": "m", "n_traces": 3, "label": "nll",
            "layers": [{"layer": i, "trace_mean": r, "trace_mean_ci": c, "pooled": r, "pooled_ci": c}
                       for i, (r, c) in enumerate(zip(rho, ci))]}


def test_choose_bands():
    b = choose_bands(_profile_dict([0.0, 0.1, 0.2, 0.15, 0.02, -0.05, -0.3, -0.2, -0.1, 0.01]))
    assert b["layers"] == [2, 6] and b["band_a"] == [1, 2, 3] and b["band_b"] == [6, 7]
    assert b["supported"] == {"band_a": True, "band_b": True}
    with pytest.raises(EpiKVError, match="two-band"):
        choose_bands(_profile_dict([0.1, 0.2, 0.3]))


def test_band_file_round_trips_into_policies(tmp_path, tiny):
    path = tmp_path / "bands.json"
    path.write_text(json.dumps(choose_bands(_profile_dict([-0.2, 0.3, 0.25, -0.1]))))
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--bands-file", str(path)])
    flat = get_policy("epikv", **policy_settings(args, "epikv"))
    band = get_policy("epikv-band", **policy_settings(args, "epikv-band"))
    default = get_policy("epikv")
    assert default.observes(4).hidden_layers == (1, 3)  # 10 and 21 of 32, scaled to 4 blocks
    assert flat.layers == (1, 0) and flat.observes(4).hidden_layers == (0, 1)
    assert band.bands == ((1, 2), (0,)) and band.channels(4) == [(1, 2), (0,)]
    with torch.inference_mode():  # the cache captures exactly the band file's layers
        dec = Decoder(tiny.model, band, budget=64)
        dec.prefill(torch.tensor([[5, 6, 7]]), [0])
        assert dec.cache._capture_hidden == frozenset({0, 1, 2})


# -- command line ----------------------------------------------------------------------------------------------------
def test_cli_label_profile_bands_end_to_end(tmp_path, capsys):
    rows = []
    for k in range(3):
        words = " ".join(f"step{k}{j} adds {j + k} more" for j in range(12))
        rows.append({"id": f"t{k}", "is_correct": k != 2, "prompt": f"Problem {k}: compute.\nSolution: \n<think>\n",
                     "trace": f"<think>\n{words}\n</think>\n\nSo the answer is \\boxed{{{k}}}."})
    traces = tmp_path / "traces.jsonl"
    traces.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lab = tmp_path / "labels"
    common = ["--traces", str(traces), "--model", "random:tiny", "--window", "8", "--stride", "4",
              "--answer-tokens", "8", "--max-reasoning-tokens", "40", "--out", str(lab)]
    assert main(["anatomy", "label", *common, "--limit", "2"]) == 0
    assert main(["anatomy", "label", *common]) == 0  # resumes: only the third trace is new
    assert "2 of 3 traces already labelled" in capsys.readouterr().out
    recs = [json.loads(x) for x in (lab / "labels.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == ["t0", "t1", "t2"]
    r = recs[0]
    assert r["label"] == "nll" and r["filler"] == "eos" and r["settings"]["window"] == 8
    assert r["filler_id"] == 2 and r["filler_token"] == "<|im_end|>"
    assert len(r["token_ids"]) == len(r["offsets"]) == len(r["labels"]) == len(r["tokens"])
    r0, r1 = r["reasoning"]
    assert r1 - r0 == 40 and r["truncated_from"] > 40 and r["answer"] == [r1, len(r["token_ids"])]
    assert all((v is None) == (not r0 <= i < r1) for i, v in enumerate(r["labels"]))
    prof = tmp_path / "prof"
    assert main(["anatomy", "profile", "--labels", str(lab), "--bootstrap", "50", "--smooth", "8",
                 "--out", str(prof)]) == 0
    p = json.loads((prof / "profile.json").read_text())
    assert p["n_traces"] == 3 and len(p["layers"]) == 4 and (prof / "profile.png").stat().st_size > 1000
    assert set(p["per_trace"]) == {"t0", "t1", "t2"}
    rc = main(["anatomy", "bands", "--profile", str(prof), "--out", str(tmp_path / "b.json")])
    if rc == 0:  # a random model may or may not show one positive and one negative layer
        b = json.loads((tmp_path / "b.json").read_text())
        assert set(b) >= {"layers", "band_a", "band_b"} and not set(b["band_a"]) & set(b["band_b"])
    else:
        assert "two-band" in capsys.readouterr().err


def test_cli_pad_filler_refused_in_one_line(tmp_path, capsys):
    row = {"id": "t0", "prompt": "Problem: add.\nSolution: \n<think>\n",
           "trace": "<think>\n" + " ".join(f"step {j}" for j in range(20)) + "\n</think>\n\nSo \\boxed{1}."}
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(row) + "\n")
    out = tmp_path / "labels"
    assert main(["anatomy", "label", "--traces", str(traces), "--model", "random:tiny", "--filler", "pad",
                 "--window", "8", "--stride", "8", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--filler pad" in err and "use --filler eos or random" in err
    assert "Traceback" not in err and not out.exists()  # refused before anything is written


@pytest.mark.parametrize("argv,msg", [
    (["anatomy", "label", "--traces", "/nonexistent.jsonl", "--out", "/tmp/x"], "does not exist"),
    (["anatomy", "label", "--traces", "/nonexistent.jsonl", "--window", "4", "--stride", "8", "--out", "/tmp/x"],
     "stride"),
    (["anatomy", "profile", "--labels", "/nonexistent", "--out", "/tmp/x"], "does not exist"),
    (["anatomy", "bands", "--profile", "/nonexistent", "--out", "/tmp/x.json"], "does not exist"),
])
def test_cli_bad_inputs_are_one_line_errors(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err
