"""The default policy: one constant (epikv.policies.DEFAULT_POLICY), run by every entry point that takes a policy,
with a per-entry-point default (ENTRY_DEFAULTS) only where that entry point refuses it; and the claims its comment
makes about the raw retention files hold."""

from __future__ import annotations

import importlib.util
import inspect
import statistics
from pathlib import Path

import pytest
from conftest import bench_module

import epikv
from epikv.cli import build_parser
from epikv.policies import DEFAULT_POLICY, ENTRY_DEFAULTS, DefaultName, default_policy, get_policy
from epikv.support import ENTRY_POINTS, entry_point, refusal

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("entry", [e.key for e in ENTRY_POINTS if e.has_default])
def test_each_entry_points_default_runs_there(entry):
    """Mutant: DEFAULT_POLICY = "h2o" (or "lagkv": per-head keep sets) fails here for the llama.cpp entry points."""
    assert refusal(entry, default_policy(entry)) is None


# What each entry point runs when no policy is named, written out so that changing one (DEFAULT_POLICY, or an
# override in ENTRY_DEFAULTS) fails here until this table, the help and docs/choosing.md say the new one.
WRITTEN_DEFAULTS = {"torch": "epikv-learned-decay", "serve-torch": "epikv-learned-decay",
                    "llama.cpp": "epikv-learned-decay", "serve-llama.cpp": "epikv-learned-decay"}


def test_each_entry_points_default_is_the_written_one():
    """Mutant: DEFAULT_POLICY = "epikv-seg", or ENTRY_DEFAULTS = {"serve-torch": "epikv-seg"}, fails here."""
    assert {e.key: default_policy(e.key) for e in ENTRY_POINTS if e.has_default} == WRITTEN_DEFAULTS


def test_an_entry_point_has_its_own_default_exactly_where_it_refuses_the_common_one():
    """Over every entry point that takes a policy: an override in ENTRY_DEFAULTS where (and only where) the entry
    point refuses DEFAULT_POLICY, and only for real entry points. Mutant: an override for an entry point that runs
    DEFAULT_POLICY (ENTRY_DEFAULTS = {"serve-torch": "epikv-seg"}) fails, as does one under an unknown key."""
    keys = [e.key for e in ENTRY_POINTS if e.has_default]
    assert len(keys) == 4
    assert set(ENTRY_DEFAULTS) <= set(keys), f"overrides for no entry point: {set(ENTRY_DEFAULTS) - set(keys)}"
    for key in keys:
        refused = refusal(key, DEFAULT_POLICY)
        assert (key in ENTRY_DEFAULTS) == (refused is not None), (key, refused)


def test_the_python_entry_points_default_to_the_constant():
    from epikv.llamacpp import LlamaDecoder, generate as llama_generate
    from epikv.serving import ServeSpec
    from epikv.serving.llamacpp import LlamaBackend

    for fn in (epikv.generate, epikv.EpiKVCache, epikv.press, epikv.Decoder, llama_generate, LlamaDecoder, LlamaBackend):
        assert inspect.signature(fn).parameters["policy"].default == DEFAULT_POLICY, fn
    assert ServeSpec().policy == default_policy("serve-torch")


def test_the_cli_defaults_to_the_constant():
    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x"]).policy == DEFAULT_POLICY
    assert p.parse_args(["generate", "--prompt", "x", "--engine", "llama.cpp"]).policy == DEFAULT_POLICY
    assert p.parse_args(["eval", "--out", "o", "--dataset", "math500"]).policies == [DEFAULT_POLICY]
    assert p.parse_args(["serve"]).policy is None  # resolved by --engine in `serve`'s run (default_policy)
    # no --policy: the default as a DefaultName, so an engine may fall back where the model cannot run it; a named
    # policy and a measurement's list are plain names, refused rather than replaced (mutant: [DEFAULT_POLICY] lists)
    assert isinstance(p.parse_args(["generate", "--prompt", "x"]).policy, DefaultName)
    assert not isinstance(p.parse_args(["generate", "--prompt", "x", "--policy", str(DEFAULT_POLICY)]).policy, DefaultName)
    assert not isinstance(p.parse_args(["eval", "--out", "o", "--dataset", "math500"]).policies[0], DefaultName)
    assert all(isinstance(default_policy(e.key), DefaultName) for e in ENTRY_POINTS if e.has_default)
    assert p.parse_args(["policies"])  # the command exists
    help_text = p._subparsers._group_actions[0].choices["generate"].format_help()
    assert DEFAULT_POLICY in " ".join(help_text.split())


def _render():
    spec = importlib.util.spec_from_file_location("epikv_render_defaults", ROOT / "benchmarks" / "render.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _vs(cells, name, ref, budget, all_traces=True):
    mine, other = cells[(name, budget)], cells[(ref, budget)]
    both = sorted(set(mine) & set(other))
    assert len(both) == 28 or not all_traces and len(both) >= 5
    return statistics.fmean(mine[t] - other[t] for t in both)


def test_the_defaults_rest_on_the_raw_retention_files():
    """What the constants' comments say, recomputed from the raw records: each default reads no attention weights and
    loses less than random at K = 1,024 on the whole traces through llama.cpp; the fallback loses less than random at
    K = 1,024 on the 28 whole traces through torch (benchmarks/results/retention-full/) and runs on every entry point
    and on hybrid models. Mutants: DEFAULT_POLICY = "epikv-learned-mean" (more loss than random), "h2o" (attention
    weights); FALLBACK_POLICY = "epikv-seg-q" (refused on hybrid models)."""
    from epikv.policies import FALLBACK_POLICY
    from epikv.support import hybrid_refusal

    wt = _whole_traces()
    cells = wt.load("llama.cpp")
    for name in {DEFAULT_POLICY, *ENTRY_DEFAULTS.values()}:
        assert not get_policy(name).observes(32).attention_layers, name
        assert _vs(cells, name, "random", 1024, all_traces=False) < 0, name
    _, torch_cells = _render()._retention_records()
    assert _vs(torch_cells, FALLBACK_POLICY, "random", 1024) < 0
    fb = get_policy(FALLBACK_POLICY)
    assert getattr(fb, "check_model", None) is None and hybrid_refusal(fb) is None
    assert all(refusal(e.key, fb) is None for e in ENTRY_POINTS if e.has_default)


def _whole_traces():
    return bench_module("whole_traces", "epikv_whole_traces")


def test_each_entry_points_default_is_the_whole_trace_winner():
    """Issue 57 item 4: every entry point's default is the per-token policy with the least answer-NLL increase at
    K = 1,024 on the whole traces through llama.cpp (benchmarks/results/whole-traces/, rendered in
    docs/choosing.md) among those it runs. Mutant: the ranking reversed (its worst policy) fails here."""
    wt = _whole_traces()
    rank = wt.ranking(wt.load("llama.cpp"))
    assert len(rank) >= 5, [r["policy"] for r in rank]  # the run's candidates, on common traces
    for e in ENTRY_POINTS:
        if e.has_default:
            assert default_policy(e.key) == wt.winner(e.key, rank), (e.key, [r["policy"] for r in rank])


def test_the_fallback_is_the_best_ranked_policy_that_runs_on_every_model():
    """FALLBACK_POLICY is the first policy of the whole-trace ranking that needs no fitted weights and runs on every
    entry point and on hybrid models. Mutant: the ranking reversed."""
    from epikv.policies import FALLBACK_POLICY
    from epikv.support import hybrid_refusal

    wt = _whole_traces()
    for r in wt.ranking(wt.load("llama.cpp")):
        pol = get_policy(r["policy"])
        if getattr(pol, "check_model", None) is None and hybrid_refusal(pol) is None and all(
                refusal(e.key, pol) is None for e in ENTRY_POINTS if e.has_default):
            assert r["policy"] == FALLBACK_POLICY
            return
    raise AssertionError("no ranked policy runs everywhere")
