"""The default policy: one constant (epikv.policies.DEFAULT_POLICY), run by every entry point that takes a policy,
with a per-entry-point default (ENTRY_DEFAULTS) only where that entry point refuses it; and the claims its comment
makes about the raw retention files hold."""

from __future__ import annotations

import importlib.util
import inspect
import statistics
from pathlib import Path

import pytest

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
WRITTEN_DEFAULTS = {"torch": "epikv-seg-q", "serve-torch": "epikv-seg-q", "llama.cpp": "epikv-seg-q",
                    "serve-llama.cpp": "epikv-seg-q"}


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


def _vs(cells, name, ref, budget):
    mine, other = cells[(name, budget)], cells[(ref, budget)]
    both = sorted(set(mine) & set(other))
    assert len(both) == 28
    return statistics.fmean(mine[t] - other[t] for t in both)


def test_the_defaults_rest_on_the_raw_retention_files():
    """What the constant's comment says, recomputed from benchmarks/results/retention-full/: each default loses less
    answer likelihood than random at K = 1024 and than the flat `epikv` at every budget, and reads no attention
    weights (mutant: DEFAULT_POLICY = "epikv" fails; so does "h2o", which reads attention weights)."""
    _, cells = _render()._retention_records()
    for name in {DEFAULT_POLICY, *ENTRY_DEFAULTS.values()}:
        assert not get_policy(name).observes(32).attention_layers, name
        assert _vs(cells, name, "random", 1024) < 0, name
        for k in (512, 1024, 2048):
            assert _vs(cells, name, "epikv", k) < 0, (name, k)

