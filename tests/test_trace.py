"""`epikv trace` beyond the EPIKV scores: the default policy, the keep set over time of a policy with no score on
arrival, and one-line refusals of the policies with nothing to trace (issue 55, item 12)."""

import pytest

from test_cli import run_cli
from epikv.policies import DEFAULT_POLICY

TEXT = " a b c d e f g h i j k l m n o p" * 4


_run = run_cli


def test_trace_defaults_to_the_default_policy(capsys, tmp_path):
    """No --policy: the default policy (epikv-learned-decay, whose rank of a token changes with its age, so its score
    on arrival is not what it keeps by) is traced, its keep set shown.
    Pre-fix: `trace` silently ran flat `epikv`, and `--policy epikv-seg-q` ended in KeyError: 'score'. Mutant:
    set_defaults(policy="epikv") in commands/trace.py fails the name check."""
    html = tmp_path / "t.html"
    code, out, err = _run(capsys, "trace", "--model", "random:tiny", "--prompt", "Q: what", "--completion", TEXT,
                          "--budget", "24", "--tau", "4", "--html", str(html))
    assert code == 0 and not err, err
    text = html.read_text()
    assert f"{DEFAULT_POLICY} keep set, K=24" in text and "evicted after token #" in text and "line-through" in text
    code, out, err = _run(capsys, "trace", "--model", "random:tiny", "--prompt", "Q: what", "--completion", TEXT,
                          "--budget", "24", "--tau", "4")
    assert code == 0 and DEFAULT_POLICY in out and "how long each token stayed" in out, out + err


def test_keep_set_over_time_is_streamings_window(tiny):
    """streaming keeps its S = 4 sink tokens and the newest K - S, so (tau 1) token i >= S leaves the cache exactly
    when token i + K - S arrives: after i + K - S + 1 tokens were fed; the last K - S stay. The last row of the keep set
    over time is the final cache. Mutants: reading the keep set before the step's tokens count (read_keep(s)) or
    recording the eviction time one token late both fail."""
    from epikv.trace import keep_matrix, trace_scores

    p_ids, c_ids = list(range(400, 406)), list(range(1000, 1040))
    K, S = 16, 4
    n = len(p_ids) + len(c_ids)
    tr = trace_scores(tiny.model, tiny.tokenizer, p_ids, c_ids, policy="streaming", budget=K, tau=1)
    assert tr.scores is None  # streaming scores no token on arrival
    want = [None] * S + [i + K - S + 1 if i < n - (K - S) else None for i in range(S, n)]
    assert tr.evicted_at == want
    assert tr.evicted == [w is not None for w in want]
    times, rows = keep_matrix(tr)
    assert times[-1] == n and sum(rows[-1]) == K
    assert [sum(r) for r in rows] == [min(t, K) for t in times]  # the cache fills to K, then holds it


def test_default_policy_trace_matches_its_final_cache(tiny):
    """The default policy's keep set read over time ends at the cache the decode kept (no token counted evicted
    that is still cached, none missed), and at most K + tau - 1 tokens are cached after any forward. Mutant: an
    ageing policy shown by its arrival score (policy.ages ignored in trace_scores)."""
    import torch

    from epikv.engine import Decoder
    from epikv.trace import keep_matrix, trace_scores

    p_ids, c_ids = list(range(400, 408)), list(range(1000, 1100))
    K, tau = 32, 8
    tr = trace_scores(tiny.model, tiny.tokenizer, p_ids, c_ids, policy=DEFAULT_POLICY, budget=K, tau=tau)
    assert tr.scores is None and sum(tr.evicted) > 0
    ids = torch.tensor([p_ids + c_ids])
    with torch.inference_mode():
        dec = Decoder(tiny.model, DEFAULT_POLICY, budget=K, tau=tau)
        dec.prefill(ids[:, :8], [0])
        for s in range(8, ids.shape[1], tau):
            dec.step(ids[:, s : s + tau])
        kept = set(dec.cache.token_data["pos"][0].tolist())
    assert [not e for e in tr.evicted] == [i in kept for i in range(ids.shape[1])]
    _, rows = keep_matrix(tr)
    assert max(sum(r) for r in rows) <= K + tau - 1


def test_score_policies_keep_their_scores(tiny):
    """An EPIKV policy still shows the score it gave each token on arrival, with the keep set beside it."""
    from epikv.trace import trace_scores

    tr = trace_scores(tiny.model, tiny.tokenizer, list(range(400, 406)), list(range(1000, 1040)), policy="epikv",
                      budget=16, tau=1)
    assert tr.scores is not None and len(tr.scores) == 46 and sum(tr.evicted) == 46 - 16
    assert all((e is None) != ev for e, ev in zip(tr.evicted_at, tr.evicted))


@pytest.mark.parametrize("policy,why", [("full", "never evicts"), ("h2o", "per head"), ("random-head", "per head")])
def test_policies_with_nothing_to_trace_are_refused_in_one_line(capsys, policy, why):
    """Exit 2, one line naming why and the policies that can be traced, before any model loads (a model path that
    does not exist would otherwise be the error). Mutant: without the check in commands/trace.py the missing model
    is reported instead."""
    code, out, err = _run(capsys, "trace", "--model", "/nonexistent/model", "--prompt", "Q", "--completion", " a b",
                          "--policy", policy)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert why in lines[0] and "streaming" in lines[0] and DEFAULT_POLICY in lines[0] and policy + "," not in \
        lines[0].split("trace one of:")[1], lines[0]


def _traceable():
    from epikv.trace import traceable_names

    # epikv-learned-mean and its ageing variants need weights fitted to the model (the shipped ones fit SmolLM2
    # only): a one-line refusal
    return [n for n in traceable_names() if not n.startswith("epikv-learned")]


@pytest.mark.parametrize("policy", _traceable())
def test_every_traceable_policy_traces(tiny, policy):
    """Every policy the refusal lists as traceable runs (those reading attention weights switch to eager attention
    for the pass). Mutant: without attention_for in trace_scores, h2o-global, raas and thinkv are refused."""
    from epikv.trace import trace_scores

    tr = trace_scores(tiny.model, tiny.tokenizer, list(range(400, 406)), list(range(1000, 1040)), policy=policy,
                      budget=24, tau=4)
    assert sum(tr.evicted) > 0 and len(tr.evicted_at) == 46
    assert tiny.model.config._attn_implementation != "eager"  # put back after the pass
