"""The command line: JSON output, listing, trace views, and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from epikv.cli import main
from epikv.policies import DEFAULT_POLICY


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(capsys, *argv) -> tuple:
    """`epikv ARGV` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_bad(capsys, *argv):
    """A bad invocation: non-zero exit, exactly one line on stderr, no traceback."""
    code, out, err = run_cli(capsys, *argv)
    assert code != 0
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_generate_json_on_embedded_model(capsys):
    code, out, err = run_cli(capsys, "generate", "--prompt", "Count from one to twenty: one, two, three,",
                             "--chat", "--max-new-tokens", "64", "--budget", "64", "--json")
    assert code == 0
    d = json.loads(out)
    for key in ("text", "prompt_tokens", "new_tokens", "max_cache_tokens", "final_cache_tokens", "evictions",
                "seconds", "tokens_per_s", "policy", "budget", "tau", "model"):
        assert key in d
    assert d["policy"] == DEFAULT_POLICY and d["budget"] == 64 and d["model"] == "smollm2"
    assert d["text"].strip() and d["new_tokens"] > 0
    # the rates agree with the counts and times beside them (3 decimals of seconds)
    assert d["seconds"] == pytest.approx(d["prefill_seconds"] + d["decode_seconds"], abs=2e-3)
    assert d["tokens_per_s"] == pytest.approx(d["new_tokens"] / d["seconds"], rel=0.01)
    assert d["decode_tokens_per_s"] == pytest.approx(d["new_tokens"] / d["decode_seconds"], rel=0.01)
    assert d["max_cache_tokens"] <= 64 + d["tau"] - 1  # the default's tau (128 for epikv-seg-q) between evictions
    if d["prompt_tokens"] + d["new_tokens"] > 64 + d["tau"] - 1:
        assert d["evictions"] > 0


def test_generate_streams_text_and_summary(capsys):
    code, out, err = run_cli(capsys, "generate", "--model", "random:tiny", "--prompt", "Hello world", "--raw",
                             "--max-new-tokens", "12", "--budget", "8", "--tau", "2")
    assert code == 0 and out.strip()
    assert f"[{DEFAULT_POLICY} K=8 tau=2]" in err and "evictions" in err


def test_policies_json(capsys):
    code, out, _ = run_cli(capsys, "policies", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    for name in ("epikv", "epikv-raw", "epikv-a", "epikv-band", "lag-kv", "full", "streaming", "random"):
        assert rows[name]["attention_free"] is True
        assert rows[name]["paper"] and "defaults" in rows[name]
    # what the engine reads on the embedded model (30 blocks: 10, 21 of 32 scaled), and on a 32-block one
    assert rows["epikv"]["observes"] == "hidden states at blocks 9,20 (for a 30-block model)"
    assert rows["epikv"]["observes_32_blocks"] == "hidden states at blocks 10,21"
    assert rows["lag-kv"]["observes"].startswith("cached keys/values")


def test_attention_free_is_one_rule():
    """attention-free = reads no attention scores: no attention weights and no recomputed queries (q.K)."""
    from epikv.policies import REGISTRY

    for name, cls in REGISTRY.items():
        obs = cls().observes(30)
        assert cls.attention_free == (not obs.attention_layers and not obs.queries), name
    assert not REGISTRY["snapkv"].attention_free and not REGISTRY["epikv-seg-q"].attention_free


def _policies_out(*argv, columns=None):
    """`epikv policies ...` in a subprocess, stdout piped; COLUMNS set (a terminal that wide) or unset (a pipe)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns:
        env["COLUMNS"] = str(columns)
    r = subprocess.run([sys.executable, "-m", "epikv.cli", "policies", *argv], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr
    return r.stdout


@pytest.mark.parametrize("columns", [80, 100, None], ids=["80", "100", "pipe"])
def test_policies_one_line_a_policy_and_no_word_split(columns):
    """Default: one line a policy (name, attention-free, engines, what it reads) and a few notes, within 80 columns
    whatever the terminal; --wide: the settings under each policy, wrapped between words only. Every word of a
    policy's rule and of its settings appears whole. Mutants: the former rich table (folded cells, several lines a
    policy) fails the line count; textwrap with break_long_words=True and the settings joined with ", " split
    words at a narrow width."""
    from epikv.commands.policies import own_defaults
    from epikv.policies import REGISTRY

    out = _policies_out(columns=columns)
    lines = out.splitlines()
    names = list(REGISTRY)
    starts = [l.split()[0] for l in lines if l.strip()]
    assert all(starts.count(n) == 1 for n in names), out  # exactly one line each
    row = {l.split()[0]: l for l in lines if l.strip()}
    assert len(lines) <= len(names) + 12 and max(len(row[n]) for n in names) <= 80, out  # the rows fit 80 anyway
    assert max(map(len, lines)) <= (columns or 80), out  # the notes below wrap at the width
    assert row["epikv-seg-q"].split()[1:5] == ["no", "torch", "serve", "llama.cpp"], row["epikv-seg-q"]
    assert "hybrid" in row["streaming"] and "eager" in row["h2o"] and "window=64" not in out  # settings: --wide
    wide = _policies_out("--wide", columns=columns)
    assert max(map(len, wide.splitlines())) <= (columns or 80), wide
    words = set(wide.split())
    for name, cls in REGISTRY.items():
        d = cls().describe()
        assert set(d["doc"].split()) <= words, (name, set(d["doc"].split()) - words)
        assert set(own_defaults(d).split()) <= words, (name, set(own_defaults(d).split()) - words)
    assert 'reserve_stat="range"' in words and "lag=128" in words


def test_policies_narrow_terminal_splits_no_word():
    """At 20 columns the notes and settings wrap, still between words: a word longer than a line stands alone.
    Mutant: break_long_words=True in _wrap cuts reserve_stat="range" (and the long words of the rules)."""
    from epikv.policies import REGISTRY

    wide = _policies_out("--wide", columns=20)
    words = set(wide.split())
    for name, cls in REGISTRY.items():
        assert set(cls().describe()["doc"].split()) <= words, name
    assert {'reserve_stat="range"', 'window_over="decode"', "attention-free,"} <= words


def test_policies_engines_match_the_engines_checks():
    """The "runs in" column restates the hybrid and llama.cpp refusal rules without importing torch; for every
    registered policy it equals the engines' own checks (epikv.support). Mutant: dropping `not obs.queries` from
    _hybrid_ok lists epikv-seg-q as running on hybrid models."""
    from epikv.commands.policies import runs_in
    from epikv.policies import REGISTRY
    from epikv.support import refusal

    keys = {"torch": "torch", "hybrid": "torch-hybrid", "serve": "serve-torch", "llama.cpp": "llama.cpp"}
    for name, cls in REGISTRY.items():
        want = [e for e, key in keys.items() if refusal(key, cls()) is None]
        assert runs_in(cls()) == want, name
    assert "hybrid" not in runs_in(REGISTRY["epikv-seg-q"]())


def test_policies_json_lists_the_engines(capsys):
    code, out, _ = run_cli(capsys, "policies", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["streaming"]["runs_in"] == ["torch", "hybrid", "serve", "llama.cpp"]
    assert rows["h2o"]["runs_in"] == ["torch"]


def test_version_and_bare_command():
    """`epikv --version` prints the version (exit 0); bare `epikv` prints the help on stdout and exits 2 (a missing
    command, as argparse). Mutant: without the bare-command branch argparse prints a one-line error, no help."""
    import epikv

    r = subprocess.run([sys.executable, "-m", "epikv.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"epikv {epikv.__version__}"
    r = subprocess.run([sys.executable, "-m", "epikv.cli"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout.startswith("usage: epikv") and "generate" in r.stdout and not r.stderr


def _options(parser, path=("epikv",)):
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _options(sp, path + (name,))
        else:
            yield " ".join(path), a


def test_every_option_of_every_command_has_help():
    """Mutant: removing the help of `generate --seed` (or of any option) fails here."""
    from epikv.cli import build_parser

    bare = [f"{cmd} {'/'.join(a.option_strings) or a.dest}" for cmd, a in _options(build_parser())
            if not (a.help or "").strip()]
    assert not bare, bare


def test_trace_views(capsys, tmp_path):
    html, png = tmp_path / "t.html", tmp_path / "t.png"
    code, out, _ = run_cli(capsys, "trace", "--model", "random:tiny", "--prompt", "Question: what is 2+2?",
                           "--completion", " Let me think. Two plus two is four. So the answer is 4." * 3,
                           "--budget", "24", "--policy", "epikv", "--html", str(html), "--png", str(png))
    assert code == 0 and "evicted" in out
    text = html.read_text()
    assert text.count("<span") > 40 and "line-through" in text
    assert png.stat().st_size > 5000
    code, out, _ = run_cli(capsys, "trace", "--model", "random:tiny", "--prompt", "Q", "--completion",
                           " a b c d e f g h i j k l m n o p", "--budget", "10")
    assert code == 0 and "tokens evicted" in out


@pytest.fixture(scope="module")
def no_decoder_model(tmp_path_factory):
    """A GPT-2 folder: a causal LM without model.model.layers."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from epikv.models import smollm2_folder

    d = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=49152)).save_pretrained(d)
    AutoTokenizer.from_pretrained(smollm2_folder()).save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("argv,needle", [
    (["--budget", "abc"], "positive integer"),
    (["--budget", "-5"], "positive integer"),
    (["--temperature", "-1"], ">= 0"),
    (["--top-p", "x"], ">= 0"),
    (["--top-p", "nan"], ">= 0"),
    (["--budget", "1.5"], "positive integer"),
    (["--seed", "-1"], "integer >= 0"),
    (["--set", "epikv.nope=1"], "has no setting 'nope'"),
    (["--set", "epikv.window"], "POLICY.SETTING=VALUE"),
    (["--set", "nope.window=1"], "unknown policy 'nope'"),
    (["--set", "epikv.window=abc"], "expects int, got"),
    (["--set", "epikv.tau=4"], "is --tau"),
    (["--policy", "epikv", "--set", "epikv.layers=[1,2,3]"], "takes 2 layer blocks"),
    (["--policy", "epikv-seg-q", "--layers", "5"], "takes 2 layer blocks"),
    (["--set", "lagkv.lag=128"], "does not run"),
    (["--max-new-tokens", "0"], "positive integer"),
    (["--policy", "nope"], "unknown policy"),
    (["--model", "random:nope"], "unknown random preset"),
    (["--model", "/nonexistent/folder"], "does not exist"),
    (["--budget", "4"], "smaller than what is protected"),
    (["--policy", "epikv-seg-q", "--layers", "1,99"], "out of range"),
    (["--layers", "a,b"], "layer indices"),
    (["--prompt-file", "/nonexistent.txt"], "cannot read"),
    (["--top-p", "1.5"], "top-p"),
    (["--bands-file", "/nonexistent.json"], "does not exist"),
    (["--attn", "flash_attention_2"], "not available"),
    (["--attn", "bogus"], "not available"),
])
def test_generate_bad_input(capsys, argv, needle):
    base = ["generate", "--model", "random:tiny", "--max-new-tokens", "4"]
    if "--prompt-file" not in argv:
        base += ["--prompt", "Hello there, my friend"]
    line = run_bad(capsys, *base, *argv)
    assert needle in line


def test_set_passes_any_policy_setting(capsys):
    import argparse

    from epikv.commands.common import policy_setting, settings_by_policy
    from epikv.errors import EpiKVError

    assert policy_setting("lagkv.lag=128") == ("lagkv", "lag", 128)
    assert policy_setting("knorm.skip_layers=[]") == ("knorm", "skip_layers", ())
    assert policy_setting("lagkv.ratio=1") == ("lagkv", "ratio", 1)  # an int where a float is expected
    for bad in ("lagkv.lag=true", "lagkv.lag=1.5", "lagkv.protect_prompt=1"):  # bool is not an int, nor int a bool
        with pytest.raises(argparse.ArgumentTypeError, match="expects"):
            policy_setting(bad)
    args = argparse.Namespace(recent=None, n_sink=None, no_protect_prompt=False, layers=None, bands=None,
                              set=[policy_setting("lagkv.lag=128")])
    assert settings_by_policy(args, ["lagkv", "epikv"]) == {"lagkv": {"lag": 128}, "epikv": {}}
    with pytest.raises(EpiKVError, match="does not run"):
        settings_by_policy(args, ["epikv"])
    # bench: the names it runs include its default policy list and the long-run policies
    line = run_bad(capsys, "bench", "speed", "--model", "random:tiny", "--policies", "epikv", "--no-long",
                   "--set", "full.n_sink=2")
    assert "--set names full, which this command does not run" in line


def test_unreadable_prompt_and_trace_files(capsys, tmp_path):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    line = run_bad(capsys, "generate", "--model", "random:tiny", "--prompt-file", str(binary))
    assert "cannot read prompt file" in line and "prompt.bin" in line
    line = run_bad(capsys, "trace", "--model", "random:tiny", "--text-file", str(tmp_path / "missing.txt"))
    assert "cannot read" in line and "missing.txt" in line


def test_empty_prompt_and_no_decoder(capsys, no_decoder_model):
    assert "empty prompt" in run_bad(capsys, "generate", "--model", "random:tiny", "--prompt", "  ")
    line = run_bad(capsys, "generate", "--model", no_decoder_model, "--prompt", "hi")
    assert "no decoder layers" in line


def test_console_script_exit_code():
    """The installed entry point, as a user runs it."""
    p = subprocess.run([sys.executable, "-m", "epikv.cli", "generate", "--prompt", "x", "--policy", "nope",
                        "--model", "random:tiny"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().startswith("epikv generate: error: unknown policy")
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("tau", [1, 4])
def test_trace_colours_come_from_the_evicting_pass(tiny, tau):
    """The scores trace colours with are the ones the evicting pass computed on arrival (evicted tokens included),
    not those of a pass without eviction, which differ once tokens are gone (later hidden states change)."""
    import torch

    from epikv.engine import Decoder
    from epikv.trace import trace_scores

    p_ids, c_ids = list(range(400, 412)), list(range(1000, 1090))
    budget = 24
    tr = trace_scores(tiny.model, tiny.tokenizer, p_ids, c_ids, policy="epikv", budget=budget, tau=tau)
    ids = torch.tensor([p_ids + c_ids])
    n, p = ids.shape[1], len(p_ids)

    def arrival_scores(budget):
        # each token's stored score read right after the step that brought it in (it is in the protected recent
        # window then: min(128, K / 4) >= tau), whatever is evicted later
        got = {}
        with torch.inference_mode():
            dec = Decoder(tiny.model, "epikv", budget=budget, tau=tau)
            dec.prefill(ids[:, :p], [0])
            got.update(zip(dec.cache.token_data["pos"][0].tolist(), dec.cache.token_data["score"][0].tolist()))
            for s in range(p, n, tau):
                dec.step(ids[:, s : s + tau])
                td = dec.cache.token_data
                got.update((q, v) for q, v in zip(td["pos"][0].tolist(), td["score"][0].tolist()) if q >= s)
            kept = set(dec.cache.token_data["pos"][0].tolist())
        return [got[i] for i in range(n)], dec.cache.evictions, kept

    evicting, evictions, kept = arrival_scores(budget)
    never, _, _ = arrival_scores(n + 1)
    assert evictions > 0 and n - budget - tau < sum(tr.evicted) <= n - budget
    assert tr.evicted == [i not in kept for i in range(n)]
    assert tr.scores == pytest.approx(evicting, abs=1e-6)
    # the case matters: without eviction the later tokens get other scores
    assert max(abs(a - b) for a, b in zip(evicting, never)) > 1e-3
    assert tr.scores != pytest.approx(never, abs=1e-6)


def test_generate_applies_the_chat_template_by_default(capsys, monkeypatch, smollm2):
    """The embedded instruct model fed raw text ends at once; the CLI formats with its chat template unless --raw."""
    import epikv.engine as engine

    seen = []
    encode = engine.encode_prompts
    monkeypatch.setattr(engine, "encode_prompts", lambda *a, **k: seen.append(encode(*a, **k)[0]) or [seen[-1]])
    prompt = "Explain step by step why the sum of two odd numbers is even."
    tok = smollm2.tokenizer
    templated = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    templated = list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    base = ["generate", "--prompt", prompt, "--max-new-tokens", "8", "--json"]
    code, out, _ = run_cli(capsys, *base)
    assert code == 0 and seen[-1] == templated
    assert json.loads(out)["text"].strip() and json.loads(out)["prompt_tokens"] == len(templated)
    assert run_cli(capsys, *base, "--chat")[0] == 0 and seen[-1] == templated  # --chat: the same (kept alias)
    assert run_cli(capsys, *base, "--raw")[0] == 0
    assert seen[-1] == tok(prompt, add_special_tokens=True)["input_ids"] != templated
    code, out, _ = run_cli(capsys, *base, "--system", "Answer in French.")
    assert code == 0 and seen[-1] == list(encode(tok, [prompt], chat=True, system="Answer in French.")[0])


def test_trace_shows_cjk_and_emoji_split_into_byte_tokens(tiny, tmp_path, capsys):
    """SmolLM2's byte-level tokenizer (random:tiny uses it) splits 学, 答, 案 and ✅ into tokens holding incomplete
    UTF-8 sequences; the trace decodes them as groups, so the HTML shows the characters, never U+FFFD."""
    from epikv.trace import token_texts

    tok = tiny.tokenizer
    text = " 数学 🙂 答案是 ✅ ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 6  # the split this test is about
    parts = token_texts(tok, ids)
    assert len(parts) == len(ids) and "".join(parts) == tok.decode(ids) and not any("\ufffd" in p for p in parts)
    assert "学" in parts and " 答" in parts and " ✅" in parts  # each character whole, on its first byte's token
    assert token_texts(tok, ids[:-1]) == parts[:-1]  # " ok" dropped
    cut = ids[:-2]  # ✅ cut short: it never completes, so its tokens keep their own decodings
    assert token_texts(tok, cut) == parts[:-4] + [tok.decode([i]) for i in cut[-2:]]
    out = tmp_path / "t.html"
    assert main(["trace", "--model", "random:tiny", "--prompt", "Q:", "--completion", text, "--html", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert "\ufffd" not in page and all(c in page for c in "数学🙂答案是✅")


def test_live_rate_waits_until_it_means_something(tiny):
    """The first decode step timed alone read 3,359 tok/s: the live rate stays blank for the first steps and the
    first half second, then reads tokens over time."""
    from epikv import generate
    from epikv.commands.generate import status_line
    from epikv.engine import StepInfo
    from epikv.progress import live_rate, rate_text

    assert live_rate(1, 0.0003) is None and live_rate(7, 10.0) is None and live_rate(8, 0.49) is None
    assert live_rate(8, 0.5) == 16.0 and live_rate(30, 2.0) == 15.0
    assert rate_text(None) == "... tok/s" and rate_text(12.345) == "12.3 tok/s"
    info = StepInfo(step=0, new_token_ids=[5], new_text="x", cache_tokens=9, evictions=0, tokens_per_s=None)
    assert status_line(info) == "[1 tokens | cache 9 | 0 evictions | ... tok/s]"
    info.step, info.tokens_per_s = 19, 14.04
    assert status_line(info) == "[20 tokens | cache 9 | 0 evictions | 14.0 tok/s]"
    seen = []
    generate(tiny.model, tiny.tokenizer, "Hello there", budget=64, max_new_tokens=12, eos_token_ids=[],
             on_step=seen.append)
    assert len(seen) == 12 and seen[0].tokens_per_s is None  # the first step: no rate, whatever the clock said
    assert all(s.tokens_per_s is None or s.step + 1 >= 8 for s in seen)


def test_generate_stop_string_is_cut_as_in_the_library_and_server(capsys):
    """`--stop S` ends the text before S (the OpenAI rule, epikv.stops), streamed and in --json alike."""
    base = ["generate", "--model", "random:tiny", "--prompt", "Hello world", "--raw", "--max-new-tokens", "16",
            "--budget", "64"]
    code, out, _ = run_cli(capsys, *base, "--json")
    full = json.loads(out)["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = full[:full.index(stop)]
    code, out, _ = run_cli(capsys, *base, "--stop", stop, "--json")
    d = json.loads(out)
    assert code == 0 and (d["text"], d["finish_reason"]) == (want, "stop") and d["new_tokens"] < 16
    code, out, _ = run_cli(capsys, *base, "--stop", stop)
    assert code == 0 and out == want + "\n"


def test_trace_joins_prompt_and_completion_as_words(capsys):
    code, out, _ = run_cli(capsys, "trace", "--model", "random:tiny", "--prompt", "What is 13?", "--completion",
                           "First, add them up.", "--budget", "64")
    assert code == 0 and "13? First" in out
    code, out, _ = run_cli(capsys, "trace", "--model", "random:tiny", "--prompt", "What is 13?", "--completion",
                           "\nFirst", "--budget", "64")
    assert code == 0 and "13?\nFirst" in out  # whitespace already there: nothing added


def test_trace_png_colours_by_score_and_keeps_its_legend_off_the_points():
    import matplotlib.pyplot as plt

    from epikv.trace import TokenTrace, _colour, _scale, png_figure

    n = 60
    tr = TokenTrace(tokens=[f"t{i}" for i in range(n)], scores=[((i * 7) % 11 - 5) / 5 for i in range(n)],
                    evicted=[4 <= i < 40 and i % 3 == 0 for i in range(n)], is_prompt=[i < 4 for i in range(n)],
                    policy="epikv", budget=32)
    fig = png_figure(tr)
    try:
        ax = fig.axes[0]
        scale = _scale(tr)
        kept, ev = ax.collections[:2]
        want = lambda idx: [c / 255 for i in idx for c in _colour(tr.scores[i], scale)]  # noqa: E731
        k_idx = [i for i in range(n) if not tr.evicted[i] and not tr.is_prompt[i]]
        e_idx = [i for i in range(n) if tr.evicted[i]]
        assert [float(x) for c in kept.get_facecolors() for x in c[:3]] == pytest.approx(want(k_idx))
        assert [float(x) for c in ev.get_facecolors() for x in c[:3]] == pytest.approx(want(e_idx))
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        assert ax.get_legend().get_window_extent(r).x0 >= ax.get_window_extent(r).x1  # beside the axes
    finally:
        plt.close(fig)


def test_policies_lists_without_importing_torch_or_transformers():
    """`epikv policies` prints its table from the registry alone (lazy imports); mutant: a plain `import torch` at the
    top of epikv/signals.py (or epikv/__init__.py importing .cache) fails here."""
    code = ("import io, sys, contextlib\nfrom epikv.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n    assert main(['policies']) == 0\n"
            "assert 'epikv-seg-q' in out.getvalue(), out.getvalue()\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
