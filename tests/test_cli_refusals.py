"""Bad or ignored command-line options: a one-line refusal with exit status 2 (or a one-line warning that lets the
command go on), never a traceback or silence."""

import json

import pytest

from epikv.cli import main

TINY = ["--model", "random:tiny"]
GEN = ["generate", *TINY, "--prompt", "Hello there, my friend", "--max-new-tokens", "2", "--json"]


def refused(capsys, *argv) -> str:
    """Exit status 2, exactly one line on stderr, no traceback; returns the line."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse refusals
        code = e.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- devices ---------------------------------------------------------------------------------------------------------
def test_cuda_device_without_cuda(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only machine, wherever this runs
    line = refused(capsys, *GEN, "--device", "cuda")
    assert "device 'cuda' is not available" in line and "--device cpu" in line


def test_unknown_device(capsys):
    assert "unknown device 'gpu0'" in refused(capsys, *GEN, "--device", "gpu0")


# -- --out of the wrong kind -----------------------------------------------------------------------------------------
@pytest.fixture
def paths(tmp_path):
    f = tmp_path / "a_file.txt"
    f.write_text("x")
    d = tmp_path / "a_folder"
    d.mkdir()
    return {"file": str(f), "folder": str(d), "under_file": str(f / "sub")}


# (command line before --out, which kind of existing path is wrong for it)
OUT_CASES = [
    (["eval", "--dataset", "gsm8k", *TINY], "file"),
    (["retention", *TINY], "file"),
    (["report", "x"], "file"),
    (["anatomy", "label", "--traces", "t.jsonl"], "file"),
    (["anatomy", "profile", "--labels", "x"], "file"),
    (["eval", "--dataset", "gsm8k", *TINY], "under_file"),
    (["anatomy", "bands", "--profile", "x"], "folder"),
    (["bench", "speed", *TINY], "folder"),
    (["bench", "memory", *TINY], "folder"),
    (["bench", "speed", *TINY], "under_file"),
]


@pytest.mark.parametrize("argv,kind", OUT_CASES, ids=[f"{' '.join(a[:2])}-{k}" for a, k in OUT_CASES])
def test_out_of_the_wrong_kind(capsys, paths, argv, kind):
    line = refused(capsys, *argv, "--out", paths[kind])
    assert "argument --out" in line and paths[kind] in line
    assert {"file": "is not a folder", "folder": "is a folder", "under_file": "is a file, not a folder"}[kind] in line


@pytest.mark.parametrize("opt", ["--html", "--png"])
def test_trace_output_that_is_a_folder(capsys, paths, opt):
    line = refused(capsys, "trace", *TINY, "--prompt", "Q", "--completion", " a b", opt, paths["folder"])
    assert f"argument {opt}" in line and "is a folder" in line


def test_trace_png_of_another_format_is_refused_while_parsing(capsys, tmp_path, monkeypatch):
    import epikv.commands.trace as trace

    monkeypatch.setattr(trace, "load", lambda args: pytest.fail("the model was loaded before the refusal"))
    line = refused(capsys, "trace", *TINY, "--prompt", "Q", "--completion", " a b", "--png", str(tmp_path / "x.html"))
    assert "argument --png" in line and "ending in .png" in line


# -- unreadable input ------------------------------------------------------------------------------------------------
def test_non_utf8_bands_file(capsys, tmp_path):
    bad = tmp_path / "bands.json"
    bad.write_bytes(b'{"layers": [1, 2], "note": "\xff\xfe"}')
    line = refused(capsys, *GEN, "--bands-file", str(bad))
    assert "cannot read bands file" in line and "not UTF-8" in line


# -- options that would be ignored -----------------------------------------------------------------------------------
def test_system_with_raw(capsys):
    assert "--system needs the chat template" in refused(capsys, *GEN, "--raw", "--system", "Be brief.")


def test_raw_and_chat_together(capsys):
    assert "not allowed with argument" in refused(capsys, *GEN, "--raw", "--chat")


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory):
    """random:tiny saved with a tokenizer that has no chat template."""
    from epikv.models import load_model

    lm = load_model("random:tiny")
    d = tmp_path_factory.mktemp("notemplate")
    lm.tokenizer.chat_template = None
    lm.model.save_pretrained(d)
    lm.tokenizer.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("opt", [["--system", "Be brief."], ["--chat"]])
def test_chat_options_without_a_chat_template(capsys, no_template_model, opt):
    line = refused(capsys, "generate", "--model", no_template_model, "--prompt", "Hi", "--max-new-tokens", "2", *opt)
    assert "has no chat template" in line and f"drop {opt[0]}" in line


def test_no_chat_template_means_raw_text(capsys, no_template_model):
    assert main(["generate", "--model", no_template_model, "--prompt", "Hi", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 1  # "Hi" alone


def test_n_sink_needs_no_protect_prompt(capsys):
    line = refused(capsys, *GEN, "--n-sink", "2")
    assert "--n-sink only applies with --no-protect-prompt" in line
    assert main([*GEN, "--n-sink", "2", "--no-protect-prompt"]) == 0  # where it matters, it is taken
    # a policy told through --set not to protect the prompt reads --n-sink too
    assert main([*GEN, "--policy", "epikv", "--n-sink", "2", "--set", "epikv.protect_prompt=false"]) == 0


@pytest.fixture
def bands_file(tmp_path):
    p = tmp_path / "bands.json"
    p.write_text(json.dumps({"layers": [1, 3], "band_a": [0, 1], "band_b": [2, 3]}))
    return str(p)


@pytest.mark.parametrize("argv,needle", [
    (["--policy", "full", "--bands-file", "BANDS"], "--bands-file: its layers and bands are read by"),
    (["--policy", "h2o", "--bands-file", "BANDS"], "not by h2o"),
    (["--policy", "epikv", "--bands", "0-1,2-3"], "--bands is read by epikv-band only"),
    (["--policy", "streaming", "--layers", "1,3"], "--layers is read by"),
])
def test_band_options_without_a_policy_that_reads_them(capsys, bands_file, argv, needle):
    line = refused(capsys, *GEN, *[bands_file if a == "BANDS" else a for a in argv])
    assert needle in line


def test_band_options_with_policies_that_read_them(capsys, bands_file):
    for argv in (["--policy", "epikv", "--bands-file", bands_file], ["--policy", "epikv-band", "--bands", "0-1,2-3"],
                 ["--policy", "epikv-band", "--bands-file", bands_file]):
        assert main([*GEN, *argv]) == 0, capsys.readouterr().err
    # a file holding only layers means nothing to epikv-band
    only_layers = bands_file.replace("bands.json", "layers.json")
    with open(only_layers, "w") as f:
        json.dump({"layers": [1, 3]}, f)
    assert "its layers are read by epikv, epikv-raw, epikv-a, not by epikv-band" in refused(
        capsys, *GEN, "--policy", "epikv-band", "--bands-file", only_layers)


def test_budget_with_full_warns_and_runs(capsys):
    assert main([*GEN, "--policy", "full", "--budget", "64"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["epikv generate: warning: full never evicts: --budget is ignored"]
    assert json.loads(out)["policy"] == "full"
    assert main([*GEN, "--policy", "full"]) == 0  # the default budget: nothing to warn about
    assert capsys.readouterr().err == ""
    assert main([*GEN, "--policy", "epikv", "--budget", "64"]) == 0
    assert capsys.readouterr().err == ""


# -- benchmarks/gpu.sh: a failed step fails the script ----------------------------------------------------------------
def _gpu_sh(tmp_path, fake_body=None, env_epikv=None, path_epikv="exit 0"):
    """Run a copy of benchmarks/gpu.sh in a scratch repository whose .venv/bin/epikv is a stub running fake_body
    (None: no venv); an `epikv` running path_epikv is first on PATH. Returns (rc, stdout + stderr, calls file)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(Path(__file__).parents[1] / "benchmarks" / "gpu.sh", repo / "benchmarks" / "gpu.sh")
    calls = tmp_path / "calls.txt"

    def stub(path, body):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'#!/usr/bin/env bash\necho "$0 $*" >> {calls}\n{body}\n')
        path.chmod(0o755)

    if fake_body is not None:
        stub(repo / ".venv" / "bin" / "epikv", fake_body)
    stub(tmp_path / "path" / "epikv", path_epikv)
    env = {k: v for k, v in os.environ.items() if k != "EPIKV"}
    env["PATH"] = f"{tmp_path / 'path'}:{env['PATH']}"
    if env_epikv is not None:
        env["EPIKV"] = env_epikv
    p = subprocess.run(["bash", str(repo / "benchmarks" / "gpu.sh"), str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr, calls.read_text() if calls.exists() else ""


def test_gpu_sh_fails_when_every_step_fails(tmp_path):
    rc, out, _ = _gpu_sh(tmp_path, fake_body="exit 0", env_epikv="false")
    assert rc != 0 and "done" not in out, out
    last = out.strip().splitlines()[-1]
    assert "3 of 3 steps failed" in last and all(f"{s} (exit 1" in last for s in ("speed", "throughput", "memory"))


def test_gpu_sh_names_the_one_failed_step(tmp_path):
    rc, out, _ = _gpu_sh(tmp_path, fake_body='[[ " $* " == *" throughput "* ]] && exit 3; exit 0')
    last = out.strip().splitlines()[-1]
    assert rc == 1 and "1 of 3 steps failed" in last and "throughput (exit 3" in last, out
    assert "speed (" not in last and "memory (" not in last


def test_gpu_sh_uses_the_venv_entry_point_not_path(tmp_path):
    rc, out, calls = _gpu_sh(tmp_path, fake_body="exit 0", path_epikv="exit 1")
    assert rc == 0 and "done in" in out, out
    assert calls.count("/.venv/bin/epikv bench") == 3 and "path/epikv" not in calls


def test_gpu_sh_without_an_entry_point(tmp_path):
    rc, out, calls = _gpu_sh(tmp_path, fake_body=None)  # no .venv: refuse before any step, not PATH's epikv
    assert rc == 2 and "no epikv entry point at" in out and ".venv/bin/epikv" in out and "EPIKV=" in out, out
    assert calls == ""


# -- the model's trained context -------------------------------------------------------------------------------------
@pytest.fixture
def short_context(monkeypatch):
    """random:tiny with a 64-position context (max_position_embeddings), so a run past it stays small."""
    from epikv import models

    monkeypatch.setitem(models.PRESETS, "tiny", dict(models.PRESETS["tiny"], max_position_embeddings=64))


LONG = " ".join(["word"] * 80)  # > 64 tokens


def test_budget_beyond_the_context_is_refused(capsys, short_context):
    line = refused(capsys, *GEN, "--raw", "--budget", "100000")
    assert "budget 100000 is larger than the model's 64-token context" in line and "--allow-beyond-context" in line
    assert main([*GEN, "--raw", "--budget", "64"]) == 0  # at the context: runs, nothing to say
    assert capsys.readouterr().err == ""
    assert main([*GEN, "--raw", "--budget", "65", "--allow-beyond-context"]) == 0  # the override runs it
    assert capsys.readouterr().err == ""  # 6 prompt + 2 new tokens never reach the context


def test_prompt_beyond_the_context_warns_once(capsys, short_context):
    argv = ["generate", *TINY, "--prompt", LONG, "--raw", "--max-new-tokens", "3", "--json"]
    assert main([*argv, "--policy", "full"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("epikv generate: warning: the ") and "-token prompt is longer than " \
        "the model's 64-token context" in err[0], err
    assert main([*argv, "--no-protect-prompt", "--budget", "32"]) == 0  # evicting does not make the prompt fit
    assert "prompt is longer than the model's 64-token context" in capsys.readouterr().err


def test_cache_growing_past_the_context_warns(capsys, short_context):
    argv = ["generate", *TINY, "--prompt", "Hello there, my friend", "--raw", "--json"]
    assert main([*argv, "--policy", "full", "--max-new-tokens", "80"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "may run past the model's 64-token context" in err[0] and "full keeps every token" in \
        err[0], err
    assert main([*argv, "--policy", "full", "--max-new-tokens", "50"]) == 0  # 6 + 50 <= 64: nothing to say
    assert capsys.readouterr().err == ""
    assert main([*argv, "--budget", "32", "--max-new-tokens", "80"]) == 0  # a budget within the context bounds it
    assert capsys.readouterr().err == ""


def test_library_generate_checks_the_context(tiny, monkeypatch):
    from epikv import generate
    from epikv.engine import model_context
    from epikv.errors import ContextWarning, EpiKVError

    assert model_context(tiny.model) == 8192  # the preset's max_position_embeddings
    monkeypatch.setattr(tiny.model.config, "max_position_embeddings", 64)
    assert model_context(tiny.model) == 64
    with pytest.raises(EpiKVError, match="budget 100 is larger than the model's 64-token context"):
        generate(tiny.model, tiny.tokenizer, "Hello there", budget=100, max_new_tokens=2)
    with pytest.warns(ContextWarning, match="may run past the model's 64-token context") as w:
        generate(tiny.model, tiny.tokenizer, "Hello there", budget=100, max_new_tokens=80, allow_beyond_context=True)
    assert w[0].message.kind == "cache"
    with pytest.warns(ContextWarning, match="prompt is longer than the model's 64-token context") as w:
        generate(tiny.model, tiny.tokenizer, LONG, policy="full", max_new_tokens=2)
    assert w[0].message.kind == "prompt"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextWarning)
        generate(tiny.model, tiny.tokenizer, "Hello there", budget=64, max_new_tokens=80)  # bounded: no warning


# -- output locations that cannot be written: refused before any work -------------------------------------------------
@pytest.fixture(params=["EACCES", "EROFS"])
def unwritable(request, tmp_path, monkeypatch):
    """tmp_path/ro behaves as a folder this process cannot write in (permission denied, or a read-only file system):
    tests run as root, which chmod does not stop, so file creation under it fails the way the kernel would say."""
    import errno
    import os
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    code = getattr(errno, request.param)
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):
        if dir is not None and str(dir).startswith(str(ro)):
            raise OSError(code, os.strerror(code), str(dir))
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)

    def no_work(*a, **kw):  # the refusal must come before any work (the model is the first of it)
        raise AssertionError("a model was loaded before the output location was checked")

    from epikv import models

    monkeypatch.setattr(models, "load_model", no_work)
    return ro, os.strerror(code)


# (command line, output option, where under the unwritable folder)
WRITE_CASES = [
    (["eval", "--dataset", "gsm8k", *TINY], "--out", ""),
    (["eval", "--dataset", "gsm8k", *TINY], "--out", "new/sub"),
    (["retention", *TINY], "--out", "results"),
    (["report", "x"], "--out", "rep"),
    (["trace", *TINY, "--prompt", "Q", "--completion", " a b"], "--png", "missing/t.png"),
    (["trace", *TINY, "--prompt", "Q", "--completion", " a b"], "--html", "t.html"),
    (["bench", "speed", *TINY], "--out", "s.json"),
    (["bench", "memory", *TINY], "--out", "deeper/m.json"),
    (["bench", "throughput", *TINY], "--out", "t.json"),
    (["anatomy", "label", "--traces", "t.jsonl"], "--out", "lab"),
    (["anatomy", "bands", "--profile", "x"], "--out", "b.json"),
]


@pytest.mark.parametrize("argv,opt,sub", WRITE_CASES, ids=[f"{' '.join(a[:2])}{o}-{s or '.'}" for a, o, s in WRITE_CASES])
def test_unwritable_output_is_refused_first(capsys, unwritable, argv, opt, sub):
    ro, why = unwritable
    target = ro / sub if sub else ro
    line = refused(capsys, *argv, opt, str(target))
    assert line.endswith(f"argument {opt}: cannot write in {ro}: {why}"), line
    assert list(ro.iterdir()) == []  # nothing made on the way (the missing folders neither)


def test_report_into_an_unwritable_first_folder(capsys, unwritable):
    ro, why = unwritable
    (ro / "results.jsonl").write_text("")  # a retention folder: the report goes into it by default
    line = refused(capsys, "report", str(ro))
    assert line == f"epikv report: error: report (no --out: into {ro}): cannot write in {ro}: {why}"


def test_existing_output_file_that_cannot_be_opened(capsys, tmp_path, monkeypatch):
    import builtins
    import errno

    out = tmp_path / "s.json"
    out.write_text("{}")
    real = builtins.open

    def fake_open(file, mode="r", *a, **kw):
        if str(file) == str(out) and "a" in mode:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake_open)
    line = refused(capsys, "bench", "speed", *TINY, "--out", str(out))
    assert line.endswith(f"argument --out: cannot write in {out}: Permission denied"), line
    assert out.read_text() == "{}"


def test_trace_makes_missing_output_folders(capsys, tmp_path):
    html, png = tmp_path / "a" / "b" / "t.html", tmp_path / "c" / "t.png"
    assert main(["trace", *TINY, "--prompt", "Q", "--completion", " a b c d", "--html", str(html),
                 "--png", str(png)]) == 0, capsys.readouterr().err
    assert html.stat().st_size > 0 and png.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.rglob(".epikv-write-check-*")) == []  # the probes leave nothing
