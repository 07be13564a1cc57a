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


def test_long_generation_stderr_and_plot_show_one_kv_measure(tmp_path):
    """The stderr line and the plot's KV panel: the same measure (buffers allocated) under the same name."""
    import matplotlib

    matplotlib.use("Agg")
    from epikv.bench.plots import plot_speed
    from epikv.commands.bench import _fmt_point

    p = {"generated": 10, "segment_tokens_per_s": 5.0, "cache_length": 18, "peak_gib": 1.0, "kv_buffer_mib": 0.25,
         "kv_cache_peak_mib": 0.08, "policy": "full", "budget": None}
    line = _fmt_point(p)
    assert "KV buffers allocated 0.25 MiB" in line and "0.08" not in line
    import matplotlib.pyplot as plt

    captured = []
    orig = plt.Figure.savefig
    plt.Figure.savefig = lambda self, *a, **k: captured.append(self)
    try:
        plot_speed({"model": "m", "device": "cpu", "dtype": "float32", "budgets": [], "long": [p, dict(p, generated=20)]},
                   tmp_path / "s.png")
    finally:
        plt.Figure.savefig = orig
    labels = [ax.get_ylabel() for ax in captured[0].axes]
    assert "KV buffers allocated (MiB)" in labels


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
    (["bench", "speed", "--model", "random:tiny", "--policies", "epikv", "--long-lengths", "1024,8129"],
     "context limit of 8192 positions: the longest checkpoint can be 8128"),
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


# -- bench throughput: the memory accounting, the batch search, the command ------------------------------------------
from epikv.bench.throughput import MIB, Plan, batch_bytes, chunks, fits, max_batch  # noqa: E402
from epikv.engine import Decoder, attention_for, left_pad  # noqa: E402


def _real_peaks(model, plan, prompts, new_tokens):
    """Independent of the accounting: run a Decoder and read the real tensors. Returns (peak bytes of the K/V buffers
    summed over layers, peak over forwards of those buffers + every attention-weight / hidden-state tensor the
    policy's observed layers produced in that forward)."""
    obs = plan.policy.observes(len(model.model.layers))
    seen = []  # bytes of the observed tensors of the current forward
    handles = []
    for i, layer in enumerate(model.model.layers):
        if i in obs.attention_layers:
            handles.append(layer.self_attn.register_forward_hook(
                lambda m, a, out: seen.append(out[1].numel() * out[1].element_size())))
        if i in obs.hidden_layers:
            handles.append(layer.register_forward_hook(
                lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).numel() * 4)))
    ids, n_pad = left_pad(prompts, 0)
    kv_peak = total_peak = 0
    try:
        with torch.inference_mode(), attention_for(model, plan.policy):
            dec = Decoder(model, plan.policy, plan.budget)

            def measure():
                nonlocal kv_peak, total_peak
                kv = sum(l._kbuf.numel() * l._kbuf.element_size() + l._vbuf.numel() * l._vbuf.element_size()
                         for l in dec.cache.layers)
                kv_peak, total_peak = max(kv_peak, kv), max(total_peak, kv + sum(seen))
                seen.clear()

            nxt = dec.prefill(ids, n_pad).argmax(-1)
            measure()
            for _ in range(new_tokens - 1):
                nxt = dec.step(nxt[:, None]).argmax(-1)
                measure()
    finally:
        for h in handles:
            h.remove()
    return kv_peak, total_peak


@pytest.mark.parametrize("name, budget, tau, width, new_tokens", [
    ("full", None, None, 12, 300),  # 256 slots, grows to 512
    ("full", None, None, 300, 12),  # a prompt wider than the hint: 300 slots, then 600
    ("epikv", 40, 1, 12, 60),  # K + tau + slack from the start, never more
    ("epikv", 40, 8, 12, 60),
    ("h2o", 40, 4, 20, 50),  # + the attention weights of every layer (largest at the prefill)
])
def test_throughput_accounting_matches_the_real_buffers(tiny, name, budget, tau, width, new_tokens):
    plan = Plan.make(tiny.model, name, budget, tau)
    prompts = [list(range(100, 100 + width)), list(range(200, 200 + width - 3))]  # padded to `width`
    kv, total = _real_peaks(tiny.model, plan, prompts, new_tokens)
    pred = batch_bytes(plan, [len(p) for p in prompts], 2, new_tokens)[0]
    assert pred["kv_bytes"] == kv
    assert pred["peak_bytes"] == total
    assert plan.shape.slot_bytes == 4 * 2 * 16 * 2 * 4  # layers x kv_heads x head_dim x K,V x float32


@pytest.mark.parametrize("name, budget", [("full", None), ("epikv", 32), ("h2o", 32)])
def test_throughput_batch_search_is_exact(tiny, name, budget):
    """The found batch fits the cap and batch + 1 does not, by the bytes the real tensors hold."""
    plan = Plan.make(tiny.model, name, budget, 4)
    widths = [10, 14, 9, 11, 13, 8, 12, 10, 14]
    prompts = [list(range(100, 100 + w)) for w in widths]
    new_tokens = 40
    one = _real_peaks(tiny.model, plan, [prompts[1]], new_tokens)[1]  # one sequence of the longest prompt
    cap = int(3.5 * one)
    b = max_batch(plan, widths, new_tokens, cap)
    assert 1 <= b < len(widths)

    def worst(batch):
        return max(_real_peaks(tiny.model, plan, [prompts[i] for i in idx], new_tokens)[1]
                   for idx in chunks(len(widths), batch))

    assert worst(b) <= cap < worst(b + 1)
    assert fits(plan, widths, b, new_tokens, cap) and not fits(plan, widths, b + 1, new_tokens, cap)


def _problems(tmp_path, n=4):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)})
                            + "\n" for i in range(n)))
    return str(path)


def test_cli_throughput_json(tmp_path):
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", "random:tiny", "--policies", "full,epikv", "--budgets", "64",
            "--cap-mib", "0.6", "--data", _problems(tmp_path), "--requests", "3", "--max-new-tokens", "60",
            "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    s = res["search"]
    assert s["full"]["max_batch"] < s["epikv@K=64"]["max_batch"] and not s["full"]["batch_plus_one_fits"]
    assert all(p["kv_accounting_exact"] and p["predicted_peak_bytes"] <= 0.6 * MIB for p in res["points"])
    top = {p["label"]: p for p in res["points"] if p["full_request_set"]}
    assert top["full"]["requests_run"] == 3 and top["full"]["time_all_requests_s"] > 0
    assert res["ratios"]["at_max_batch"]["epikv@K=64"]["batch"] == s["epikv@K=64"]["max_batch"] / s["full"]["max_batch"]
    assert "at_full_batch" in res["ratios"] and "static batches" in res["static_batches"]
    # a partial last batch: its empty slots are the reported waste (EOS never ends a random model's output here)
    f = top["full"]
    assert f["batch"] == 2 and f["slot_steps_idle"] == 60 and f["slot_steps"] == 2 * 2 * 60
    assert f["static_waste_fraction"] == 0.25
    lines = (tmp_path / "tp.json.jsonl").read_text().splitlines()
    assert main(argv) == 0  # rerun: every batch comes from the journal
    assert (tmp_path / "tp.json.jsonl").read_text().splitlines() == lines


@pytest.mark.parametrize("extra, msg", [
    (["--cap-mib", "0.05"], "too small for one full sequence"),
    (["--cap-mib", "0"], "--cap-mib must be positive"),
    (["--policies", "epikv"], "must include full"),
    (["--policies", "full,nope"], "unknown policy 'nope'"),
    (["--requests", "9"], "has only 4 prompts"),
    (["--budgets", "8"], "budget 8 is smaller than what epikv protects"),
    (["--max-new-tokens", "9000"], "context limit of 8192"),
    (["--data", "/nonexistent/x.jsonl"], "does not exist"),
])
def test_cli_throughput_refuses_bad_inputs(tmp_path, capsys, extra, msg):
    base = {"--policies": "full,epikv", "--budgets": "64", "--cap-mib": "4", "--data": _problems(tmp_path),
            "--requests": "2", "--max-new-tokens": "8"}
    for k, v in zip(extra[::2], extra[1::2]):
        base[k] = v
    argv = ["bench", "throughput", "--model", "random:tiny"] + [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
