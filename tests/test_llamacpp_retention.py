"""`epikv retention --engine llama.cpp`: the shared R1 traces teacher-forced through the llama.cpp engine by the
retention code itself. Chunked logits are the decoder's own, keep sets are the policy's own on the captured states,
records and folders name their engine, a report never pairs engines, and what llama.cpp cannot run is refused in
one line (exit 2). Traces are cut to a few hundred tokens: seconds on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from epikv.errors import EpiKVError
from test_llamacpp import assert_epikv_keeps, recording_decoder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gm():
    from epikv.llamacpp import load_gguf

    return load_gguf("smollm2")


@pytest.fixture(scope="module")
def item(gm):
    from epikv.retention.runner import load_traces, prepare_traces

    rows = load_traces("shared-28")[:1]
    items, skipped = prepare_traces(rows, gm.tokenizer, max_reasoning_tokens=300, max_answer_tokens=16)
    assert not skipped
    return items[0]


def test_chunk_logits_are_the_decoders_row_by_row(gm, item):
    """feed(all_logits) row j predicts token j + 1 of the chunk: its last row is exactly the last-token logits of
    the same feed, and each row is (to llama.cpp's batch noise) the logits of the chunk's prefix fed alone."""
    from epikv.llamacpp import LlamaDecoder

    p, chunk = len(item.prompt_ids), item.ids[len(item.prompt_ids): len(item.prompt_ids) + 16]

    def fresh():
        dec = LlamaDecoder(gm, "full", None, max_tokens=p + 16, threads=1, n_batch=max(16, p))
        dec.prefill(item.prompt_ids)
        return dec

    dec = fresh()
    rows = dec.feed(chunk, all_logits=True)  # [16, vocab]
    dec.close()
    assert rows.shape == (16, gm.tokenizer.n_vocab)
    dec = fresh()
    assert np.array_equal(rows[-1], dec.feed(chunk))
    dec.close()
    for j in (0, 7):
        dec = fresh()
        alone = dec.feed(chunk[: j + 1])
        dec.close()
        assert int(np.argmax(rows[j])) == int(np.argmax(alone))
        assert np.abs(rows[j] - alone).max() < 0.05 * np.abs(alone).max()


def test_retention_keep_sets_are_the_policy_code_on_the_captured_states(gm, item):
    """policy_pass through the llama.cpp engine at tau = 16: every keep set llama.cpp applied is the one epikv's own
    code gives on the block outputs captured in that run; the metrics are finite and the cache stayed in budget."""
    from epikv.retention.llamacpp import LlamaCppTraces
    from epikv.retention.runner import policy_pass, reference_pass

    K, tau = 160, 16
    model = LlamaCppTraces(gm, threads=1)
    ref = reference_pass(model, item, tau)
    assert ref.peak_cache_tokens == len(item.ids) - 1  # the full cache holds every fed token
    seen = []
    model.on_decoder = lambda dec: seen.append(recording_decoder(dec))
    m = policy_pass(model, item, ref, "epikv", K, tau)
    (feeds, keeps), = seen
    assert len(keeps) == m["evictions"] > 5
    assert_epikv_keeps(feeds, keeps, len(item.prompt_ids), K, gm.depth, tau=tau)
    assert K <= m["peak_cache_tokens"] <= K + tau - 1 and 0 < m["top1_agreement"] < 1 and m["kl"] > 0
    # the prompt ends off the chunk grid, yet the first eviction comes at K + tau cells, as every later one (the
    # peak --kv-memory plans for). Mutant: no short first chunk (the cells reach K + 2 tau - 1 - (K - p) % tau)
    assert (K - len(item.prompt_ids)) % tau and m["kv_peak_cells"] == K + tau


def test_a_long_tau_is_fed_in_chunks_of_a_divisor():
    """Retention feeds Seg-Q's tau 128 in chunks of 16 (its evictions stay on the chunks' grid); a tau with no
    divisor near 16 is fed whole. Mutant: feed_chunk returns tau."""
    from epikv.retention.llamacpp import feed_chunk

    assert [feed_chunk(t) for t in (1, 8, 16, 20, 64, 128, 131)] == [1, 8, 16, 10, 16, 16, 131]


def _arriving_row(gm, policy: str) -> int:
    """Bytes one token's arriving keys / values take, stored as F16 (two bytes a value), by hand."""
    from epikv.policies import get_policy

    parts = get_policy(policy).observes(gm.depth).kv_parts
    dims = {"k": gm.head_dim_k, "v": gm.head_dim_v}
    return sum(gm.n_layers * gm.n_head_kv * dims[p] * 2 for p in "kv" if p in parts)


def test_seg_q_at_tau_128_waits_for_16_rows_at_most_and_fits_its_plan(gm, item):
    """Seg-Q (tau 128, arriving keys of every layer) through retention: its arriving rows wait as F16 and are
    scored every 16 tokens at most, so the rows waiting never pass 15 + one chunk of 16; the measured peak is within
    the plan --kv-memory picks K from, and the cells peak at K + tau at the most. Mutants: arriving rows kept as
    float32; the flush interval left at the recent window (40 here); the chunk left at tau."""
    from epikv.llamacpp.kvtypes import plan_peak
    from epikv.policies import get_policy
    from epikv.retention.llamacpp import LlamaCppTraces
    from epikv.retention.runner import policy_pass, reference_pass

    K, tau, p = 160, 128, len(item.prompt_ids)
    model = LlamaCppTraces(gm, threads=1)
    ref = reference_pass(model, item, 16)
    reports = []

    def on_decoder(dec):  # the run's every buffer at the most, read before the decoder closes
        close = dec.close
        dec.close = lambda: (reports.append(dec.peak_report()), close())

    model.on_decoder = on_decoder
    m = policy_pass(model, item, ref, "epikv-seg-q", K, tau)
    assert m["evictions"] >= 1 and m["kv_peak_cells"] <= K + tau
    (rep,) = reports
    assert 0 < rep["buffer_peak_bytes"]["waiting_kv"] <= (15 + 16) * _arriving_row(gm, "epikv-seg-q")
    plan = plan_peak(gm, get_policy("epikv-seg-q", tau=tau), K, step_tokens=16, n_batch=16, prompt_tokens=p)
    assert m["kv_peak_bytes"] <= plan.total


def test_seg_q_decoding_scores_arriving_keys_every_16_tokens(gm):
    """One-token steps at K = 512 (recent window 128): Seg-Q's arriving keys wait 16 tokens at most, as F16.
    Mutants: ARRIVING_EVERY ignored (48 rows wait); rows kept as float32."""
    from epikv.llamacpp import LlamaDecoder

    dec = LlamaDecoder(gm, "epikv-seg-q", 512, max_tokens=100, threads=1, flash_attn=False)
    try:
        assert dec.recent == 128
        logits = dec.prefill([int(t) for t in np.random.default_rng(0).integers(100, 40000, 8)])
        for _ in range(40):
            logits = dec.step(int(np.argmax(logits)))
        assert dec.peak_report()["buffer_peak_bytes"]["waiting_kv"] == 16 * _arriving_row(gm, "epikv-seg-q")
    finally:
        dec.close()


def test_full_policy_scores_zero_against_its_reference(gm, item):
    """Two independent full-cache streams of one trace agree exactly: the reference is reproducible, so a policy's
    loss is its eviction's, not the engine's noise."""
    from epikv.retention.llamacpp import LlamaCppTraces
    from epikv.retention.runner import policy_pass, reference_pass

    model = LlamaCppTraces(gm, threads=1)
    ref = reference_pass(model, item, 16)
    m = policy_pass(model, item, ref, "full", None, 16)
    assert m["kl"] == 0 and m["top1_agreement"] == 1 and m["evictions"] == 0


def test_reference_predictions_line_up_with_a_token_by_token_decode(gm, item):
    """Prediction j of the chunked reference is the distribution over token P + j: the same argmax as llama.cpp
    fed the trace one token at a time, for the first 40 positions (across chunk boundaries)."""
    from epikv.llamacpp import LlamaDecoder
    from epikv.retention.llamacpp import LlamaCppTraces
    from epikv.retention.runner import reference_pass

    ref = reference_pass(LlamaCppTraces(gm, threads=1), item, 16)
    p = len(item.prompt_ids)
    # the prompt in micro-batches of 16, as the reference feeds it: the comparison is of offsets, not batch noise
    dec = LlamaDecoder(gm, "full", None, max_tokens=p + 40, threads=1, n_batch=16)
    logits = [dec.prefill(item.prompt_ids)] + [dec.step(t) for t in item.ids[p: p + 39]]
    dec.close()
    top = [int(np.argmax(x)) for x in logits]
    assert sum(a == b for a, b in zip(top, ref.top1[:40].tolist())) >= 38  # batch noise may flip a near tie


# -- records and reports keep engines apart ---------------------------------------------------------------------------

def _rec(engine, policy, budget, trace, **metrics):
    r = {"kind": "retention", "policy": policy, "budget": budget, "trace_id": trace, "tau": 16, **metrics}
    return {**r, "engine": engine} if engine else r


def test_a_report_refuses_records_of_two_engines(tmp_path):
    from epikv.retention.bootstrap import unique
    from epikv.retention.report import render_retention

    m = dict(answer_nll_increase=0.1, top1_agreement=0.9, kl=0.1)
    torch_recs = [_rec(None, "epikv", 512, "t1", **m), _rec("torch", "random", 512, "t1", **m)]
    assert len(unique(torch_recs)) == 2  # records without an engine are torch's
    mixed = torch_recs + [_rec("llama.cpp", "epikv", 512, "t1", **m)]
    with pytest.raises(EpiKVError, match="engines llama.cpp and torch"):
        unique(mixed)
    with pytest.raises(EpiKVError, match="report each engine's folders on their own"):
        render_retention(mixed, tmp_path)


def test_a_folder_holds_one_engine(tmp_path):
    from epikv.retention.runner import _check_config

    cfg = {"model": "smollm2", "tau": 16, "max_reasoning_tokens": None, "max_answer_tokens": None, "system": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # a folder written before engines were recorded
    _check_config(tmp_path, {**cfg, "engine": "torch"})  # is torch's
    with pytest.raises(EpiKVError, match="different engine"):
        _check_config(tmp_path, {**cfg, "engine": "llama.cpp"})


# -- the command line --------------------------------------------------------------------------------------------------

def _cli(*argv):
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "epikv.cli", *argv], capture_output=True, text=True, env=e,
                          timeout=300)


CUT = ["--limit", "2", "--max-reasoning-tokens", "120", "--max-answer-tokens", "8", "--threads", "1"]


def test_cli_retention_on_llama_cpp_records_its_engine_and_resumes(tmp_path):
    out = tmp_path / "ret"
    args = ["retention", "--engine", "llama.cpp", *CUT, "--policies", "full,epikv,streaming", "--budgets", "144",
            "--out", str(out)]
    p = _cli(*args)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * 3 and {r["engine"] for r in recs} == {"llama.cpp"}
    assert all(r["peak_cache_tokens"] <= 144 + 15 for r in recs if r["policy"] != "full")
    assert json.loads((out / "config.json").read_text())["engine"] == "llama.cpp"
    assert "engine llama.cpp" in (out / "retention.md").read_text()
    p = _cli(*args, "--no-report")  # resumed: nothing computed twice
    assert p.returncode == 0 and "0 records written, 6 already done" in p.stdout, p.stdout + p.stderr
    p = _cli("retention", *CUT, "--model", "random:tiny", "--policies", "full", "--out", str(out))
    assert p.returncode == 2 and "different model, engine" in p.stderr and p.stderr.count("\n") == 1, p.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--policies", "full,h2o"], "policy h2o is not supported by --engine llama.cpp: it reads attention weights"),
    (["--policies", "snapkv"], "policy snapkv is not supported by --engine llama.cpp"),
    (["--dtype", "bfloat16"], "--dtype: torch engine options"),
    (["--batch-traces", "2"], "--batch-traces 2: the llama.cpp engine streams one trace at a time"),
    (["--model", "/nowhere/x.gguf"], "does not exist"),
])
def test_cli_retention_refusals_exit_2_in_one_line(tmp_path, argv, needle):
    p = _cli("retention", "--engine", "llama.cpp", *CUT, "--out", str(tmp_path / "r"), *argv)
    assert p.returncode == 2, p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr
    assert not (tmp_path / "r").exists()
