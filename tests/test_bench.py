"""`epikv bench speed|memory` on the tiny random model: the commands run, the JSON holds the ratios, bad inputs fail
cleanly, the memory cap turns an oversized point into a reported failure. No timing is asserted."""

import json

import pytest
import torch

from epikv.bench.memory import AttentionWeights, Journal, forward_pass, run_in_child, summarize
from epikv.bench.speed import build_configs, default_policies, long_generation, ratios, run_budget
from epikv.cli import main
from epikv.errors import EpiKVError
from epikv.policies import REGISTRY

ATTN = [n for n, c in REGISTRY.items() if not c.attention_free][:1]  # one attention-based policy, if registered


def test_default_policies_cover_the_issue_list():
    names = default_policies()
    assert {"epikv", "full"} <= set(names)
    assert all(not REGISTRY[n].attention_free for n in names[: len(names) - 4])  # attention-based ones come first


def test_run_budget_interleaves_and_keeps_the_budget(tiny):
    cfgs = build_configs(ATTN + ["epikv", "full", "streaming"], [1, 4])
    assert [c.label for c in cfgs if c.policy == "full"] == ["full"]  # full is timed once, tau means nothing to it
    block = run_budget(tiny.model, cfgs, budget=48, gen_tokens=8, prompt_tokens=8, fill_chunk=16)
    rows = {r["label"]: r for r in block["configs"]}
    assert block["rounds"] == 2 and block["round_steps"] == 4
    for r in rows.values():
        assert len(r["round_ms_per_token"]) == 2 and r["ms_per_token"] > 0
        if r["evicts"]:  # an evicting config never holds more than budget + tau - 1 tokens between steps
            assert all(n <= 48 + r["tau"] - 1 for n in r["cache_length_after_round"])
            assert r["evictions"] > 0
    # full starts at K - gen/2 and grows by one token per step: its mean length over the timed steps is K
    assert rows["full"]["cache_length_after_round"] == [48 - 4 + 4 + 4, 48 - 4 + 4 + 8]
    rat = block["ratios"]
    assert set(rat["speedup_vs_full"]) == set(rows) - {"full"}
    assert rat["speedup_vs_full"]["epikv@tau=1"] == pytest.approx(rows["full"]["ms_per_token"] / rows["epikv@tau=1"]["ms_per_token"])
    assert set(rat["epikv_overhead_vs_sdpa_step"]) == {"tau=1", "tau=4"}
    assert set(rat["tau1_vs_tau4_time"]) == {"epikv", "streaming"} | set(ATTN)
    if ATTN:
        assert set(rat["epikv_speedup_vs_attention"]) == {f"{ATTN[0]}@tau=1", f"{ATTN[0]}@tau=4"}


def test_ratios_arithmetic():
    rows = [dict(label="full", policy="full", tau=None, attention_free=True, ms_per_token=10.0),
            dict(label="epikv@tau=1", policy="epikv", tau=1, attention_free=True, ms_per_token=11.0),
            dict(label="epikv@tau=128", policy="epikv", tau=128, attention_free=True, ms_per_token=10.0),
            dict(label="h2o@tau=1", policy="h2o", tau=1, attention_free=False, ms_per_token=22.0)]
    r = ratios(rows)
    assert r["epikv_overhead_vs_sdpa_step"] == pytest.approx({"tau=1": 0.1, "tau=128": 0.0})
    assert r["epikv_speedup_vs_attention"] == pytest.approx({"h2o@tau=1": 2.0})
    assert r["tau1_vs_tau128_time"] == pytest.approx({"epikv": 1.1})
    assert r["speedup_vs_full"]["h2o@tau=1"] == pytest.approx(10 / 22)
    assert ratios(rows[:1]) == {}  # full alone: no ratio has both sides


def test_long_generation_checkpoints(tiny):
    pts = long_generation(tiny.model, "epikv", 40, [30, 10], prompt_tokens=8, memory=lambda: {"peak_gib": 1.0})
    assert [p["generated"] for p in pts] == [10, 30]
    assert [p["cache_length"] for p in pts] == [18, 38]
    assert pts[0]["kv_buffer_mib"] > 0 and pts[1]["peak_gib"] == 1.0


def test_attention_weights_probe_reads_every_layer(tiny):
    obs = AttentionWeights().observes(4)
    assert obs.attention_layers == (0, 1, 2, 3) and not AttentionWeights.evicts
    forward_pass(tiny.model, "eager+attn", 32)
    forward_pass(tiny.model, "sdpa+hidden", 32)
    assert tiny.model.config._attn_implementation == "sdpa"  # eager only inside the pass
    with pytest.raises(EpiKVError, match="unknown memory mode"):
        forward_pass(tiny.model, "flash", 32)


def test_child_cap_reports_instead_of_crashing():
    # 4 layers x 4 heads x 8192^2 float32 weights = 4 GiB: cannot fit a 1.5 GiB cap, and must not crash anything
    bad = run_in_child({"task": "point", "model": "random:tiny", "mode": "eager+attn", "n": 8192, "threads": 1},
                       cap=int(1.5 * 2**30))
    assert bad[-1]["status"] in ("oom", "over-cap")


def test_summary_ratio_and_journal(tmp_path):
    pts = [dict(mode="eager+attn", n=1024, status="ok"), dict(mode="eager+attn", n=2048, status="oom"),
           dict(mode="sdpa+hidden", n=1024, status="ok"), dict(mode="sdpa+hidden", n=2048, status="ok")]
    s = summarize(pts)
    assert s["max_feasible"] == {"eager+attn": 1024, "sdpa+hidden": 2048}
    assert s["feasible_context_ratio"] == 2 and s["ratio_is_lower_bound"]
    j = Journal(tmp_path / "x.jsonl")
    j.add({"key": "a", "v": 1})
    (tmp_path / "x.jsonl").open("a").write('{"key": "b", "v"')  # a line cut by a killed run
    assert Journal(tmp_path / "x.jsonl").done == {"a": {"key": "a", "v": 1}}


def test_cli_speed_json(tmp_path, capsys):
    out = tmp_path / "speed.json"
    rc = main(["bench", "speed", "--model", "random:tiny", "--policies", "epikv,full", "--budgets", "40",
               "--taus", "1,4", "--gen-tokens", "8", "--prompt-tokens", "8", "--long-lengths", "4,8",
               "--long-policies", "epikv", "--threads", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert (tmp_path / "speed.json.jsonl").exists()
    r = res["budgets"][0]["ratios"]
    assert set(r["epikv_overhead_vs_sdpa_step"]) == {"tau=1", "tau=4"} and "tau1_vs_tau4_time" in r
    assert [p["generated"] for p in res["long"]] == [4, 8] and all(p["status"] == "ok" for p in res["long"])
    assert all(p["peak_gib"] > 0 for p in res["long"])


def test_cli_memory_json(tmp_path):
    out = tmp_path / "mem.json"
    rc = main(["bench", "memory", "--model", "random:tiny", "--lengths", "64", "--cap-gib", "4",
               "--threads", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {(p["mode"], p["n"]) for p in res["points"]} == {("eager+attn", 64), ("sdpa+hidden", 64)}
    assert all(p["status"] == "ok" and p["peak_gib"] > p["delta_gib"] >= 0 for p in res["points"])
    assert res["summary"]["feasible_context_ratio"] == 1.0
    assert out.with_suffix(".png").exists()
    # rerun: every point comes from the journal, nothing is measured again
    lines = (tmp_path / "mem.json.jsonl").read_text().splitlines()
    assert main(["bench", "memory", "--model", "random:tiny", "--lengths", "64", "--cap-gib", "4",
                 "--out", str(out)]) == 0
    assert (tmp_path / "mem.json.jsonl").read_text().splitlines() == lines


@pytest.mark.parametrize("argv, msg", [
    (["bench", "speed", "--model", "random:tiny", "--policies", "nope"], "unknown policy 'nope'"),
    (["bench", "speed", "--model", "random:tiny", "--policies", "epikv", "--gen-tokens", "8"], "shorter than one round"),
    (["bench", "speed", "--model", "random:tiny", "--policies", "epikv", "--long-policies", "zzz"], "unknown policy 'zzz'"),
    (["bench", "memory", "--model", "random:tiny", "--lengths", "64"], "needs --cap-gib"),
    (["bench", "memory", "--model", "random:tiny", "--modes", "foo", "--cap-gib", "1"], "unknown mode 'foo'"),
])
def test_bad_inputs_fail_cleanly(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["bench", "speed", "--budgets", "0"], ["bench", "memory", "--lengths", "x"],
                                  ["bench"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("batch, heads_keep", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("first_evicted", [0, 5, 29])
def test_compaction_moves_only_the_tail_and_matches_a_gather(batch, heads_keep, first_evicted):
    """BufferLayer.compact (row copies, tail only on the CPU) keeps exactly what a plain gather would."""
    from epikv.cache import BufferLayer

    n, k = 41, 30
    g = torch.Generator().manual_seed(first_evicted)
    keys, values = torch.randn(batch, 2, n, 8, generator=g), torch.randn(batch, 2, n, 4, generator=g)
    layer = BufferLayer(64)
    layer.update(keys, values)
    rows = []
    for _ in range(batch * (2 if heads_keep else 1)):
        rest = torch.randperm(n - first_evicted - 1, generator=g)[: k - first_evicted] + first_evicted + 1
        rows.append(torch.cat([torch.arange(first_evicted), rest.sort().values]))
    keep = torch.stack(rows).view(batch, 2 if heads_keep else 1, k)  # [batch, 1 or heads, K]
    idx = keep.expand(batch, 2, k)
    layer.compact(keep if heads_keep else keep[:, 0], target_capacity=64, start=first_evicted)  # slots before stay
    assert layer.length == k and layer.capacity == 64
    assert torch.equal(layer.keys, keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, 8)))
    assert torch.equal(layer.values, values.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, 4)))
    before = layer.keys.clone()
    layer.compact(torch.arange(k - 1)[None].expand(batch, k - 1), target_capacity=k)  # shrinks: 64 > 2 * 30
    assert layer.capacity == k and torch.equal(layer.keys, before[:, :, : k - 1])


@pytest.mark.parametrize("evicted", [[3], [36], [0, 1], [39, 40], [5, 20, 33], list(range(2, 14))])
def test_compaction_moves_the_shorter_side(evicted):
    """With the back run still, the head shifts right (the offset advances); both sides give the plain gather, and
    later appends land after the kept run."""
    from epikv.cache import BufferLayer

    n = 41
    keys, values = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 4)
    layer = BufferLayer(60)
    layer.update(keys, values)
    keep = torch.tensor([[i for i in range(n) if i not in evicted]])
    k = keep.shape[-1]
    start = min(evicted)
    still = n - 1 - max(evicted)
    layer.compact(keep, target_capacity=60, start=start, still=still)
    assert layer.off == (n - k if still > start else 0)
    ref_k = keys[:, :, keep[0]]
    assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, values[:, :, keep[0]])
    for step in range(20):  # appends past the end of the buffer rebase the run to offset 0
        new_k, new_v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 4)
        layer.update(new_k, new_v)
        ref_k = torch.cat([ref_k, new_k], dim=2)
        assert torch.equal(layer.keys, ref_k) and layer.capacity == 60
    assert layer.off + layer.length <= 60
