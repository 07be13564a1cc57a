"""The README's and the docs' examples run as written: every command block in a small form, every Python block as
it stands.

Commands are read from the ```bash blocks of README.md and docs/*.md (continuation lines joined, comments dropped,
`&&` split).
Each `.venv/bin/epikv` command must parse with the real CLI parser, and the files it reads must exist or be written
by an earlier command of its block; the CPU-sized ones then run with smaller sizes (SMALL); the GPU, server and
hour-long ones are parsed only (PARSE_ONLY). The ```text synopsis must name options the parser has, with its
defaults (docs/cli.md). The ```python blocks of each page run in order in one fresh interpreter per page, with
max_new_tokens lowered to 8. A block repeated on several pages runs once."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from epikv.cli import build_parser, main
from epikv.data import TRACES

ROOT = Path(__file__).resolve().parents[1]
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
         for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}
README = PAGES["README.md"]

# what a newcomer can run as written after scripts/install.sh (a bare `epikv` is not on PATH)
PROGRAMS = {".venv/bin/epikv", ".venv/bin/python", ".venv/bin/mkdocs", "bash", "curl"}
# the small form of each CPU command: options replaced (or added) to make it take seconds
SMALL = {
    "generate": {"--max-new-tokens": "8"},
    "eval": {"--limit": "1", "--max-new-tokens": "8", "--quiet": None},
    "retention": {"--limit": "1", "--max-reasoning-tokens": "48", "--max-answer-tokens": "8", "--budgets": "256"},
    "report": {},
    "trace": {},
    "policies": {},
}
# parsed, not run: a GPU or a hub model, a server, or minutes to hours on a CPU (covered by their own tests)
PARSE_ONLY = {"bench", "anatomy", "serve"}
# options naming a file or folder the command reads
INPUTS = {"--traces", "--data-dir", "--labels", "--profile", "--bands-file"}


def blocks(lang: str, page: str | None = None) -> list[str]:
    """The ```LANG blocks of one page, or of every page (README first) when page is None."""
    texts = [PAGES[page]] if page else list(PAGES.values())
    return [b for t in texts for b in re.findall(rf"^```{lang}\n(.*?)^```", t, flags=re.S | re.M)]


def fence_problems(text: str) -> list[str]:
    """Code fences that do not pair up: an opening fence inside an open block (a doubled or nested fence, which GitHub
    renders as code until the next fence), an empty block, a block never closed."""
    problems, open_at, lines = [], None, 0
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*(```+)(\S*)\s*$", line)
        if not m:
            lines += open_at is not None and bool(line.strip())
            continue
        if open_at is None:
            open_at, lines = n, 0
        elif m.group(2):
            problems.append(f"line {n}: fence {line.strip()!r} opens inside the block opened at line {open_at}")
        else:
            if not lines:
                problems.append(f"line {open_at}: empty code block")
            open_at = None
    if open_at is not None:
        problems.append(f"line {open_at}: code block never closed")
    return problems


def test_every_code_block_pairs_up():
    """Mutant: the doubled ```bash fence docs/benchmarks.md had, or an empty block, fails here."""
    bad = {page: fence_problems(text) for page, text in PAGES.items()}
    assert not {p: b for p, b in bad.items() if b}, bad
    assert fence_problems("```bash\n```bash\nls\n```\n")
    assert fence_problems("text\n```bash\n```\n")
    assert not fence_problems("```bash\nls\n```\n\n```text\nx\n```\n")


def commands(block: str) -> list[list[str]]:
    """Each command of a bash block as argv (env assignments dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            cmd, words = words[:cut], words[cut + 1:]
            while cmd and re.fullmatch(r"[A-Z_]+=.*", cmd[0]):
                cmd = cmd[1:]
            if cmd:
                out.append(cmd)
    return out


def epikv_blocks(page: str | None = None) -> list[list[list[str]]]:
    """Per bash block, its `.venv/bin/epikv` commands' arguments."""
    return [[c[1:] for c in commands(b) if c[0] == ".venv/bin/epikv"] for b in blocks("bash", page)]


def test_every_command_runs_from_the_venv():
    seen = [c for b in blocks("bash") for c in commands(b)]
    assert len(seen) > 15
    bad = [" ".join(c) for c in seen if c[0] not in PROGRAMS]
    assert not bad, f"README / docs commands a fresh clone cannot run as written: {bad}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_command_parses_and_finds_its_inputs(page):
    parser = build_parser()
    for block in epikv_blocks(page):
        written: set[str] = set()
        for argv in block:
            try:
                args = parser.parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"the CLI refuses {page}'s `epikv {' '.join(argv)}` (exit {e.code})")
            for opt, val in zip(argv, argv[1:]):
                if opt in INPUTS:
                    assert Path(ROOT / val).exists() or val in written or (opt == "--traces" and val in TRACES), \
                        f"`epikv {' '.join(argv)}` reads {val}, which neither exists nor is written above it"
            out = getattr(args, "out", None)
            if out:
                written.add(str(out))


def _sub_parser(name: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[name]


def test_synopsis_names_real_options_with_their_defaults():
    (synopsis,) = [b for b in blocks("text", "docs/cli.md") if b.startswith(".venv/bin/epikv")]
    checked = 0
    for line in synopsis.replace("\\\n", " ").splitlines():
        words = line.split("#")[0].split()
        p = _sub_parser(words[1])
        opts = {o: a for a in p._actions for o in a.option_strings}
        for m in re.finditer(r"(--[a-z-]+)(?: ([^\s\[\]|-][^\s\[\]|]*))?", line.split("#")[0]):
            opt, val = m.group(1), m.group(2)
            assert opt in opts, f"synopsis of `epikv {words[1]}` shows {opt}, which it does not accept"
            default = p.get_default(opts[opt].dest)
            if val and not val.isupper() and "[" in line[:m.start()] and default is not None and not isinstance(default, bool):
                assert str(default) == val, f"synopsis: `epikv {words[1]} {opt} {val}`, but the default is {default}"
                checked += 1
    assert checked >= 6


def small_form(argv: list[str]) -> list[str]:
    argv = list(argv)
    for opt, val in SMALL[argv[0]].items():
        if opt in argv:
            if val is not None:
                argv[argv.index(opt) + 1] = val
        else:
            argv += [opt] if val is None else [opt, val]
    return argv


@pytest.fixture
def repo_like(tmp_path, monkeypatch):
    """A fresh working directory with nothing beside it (no `../shared/data`): the commands read the data shipped in
    the package, and `runs/` is fresh."""
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    return tmp_path / "repo"


def runnable_blocks() -> list[list[list[str]]]:
    out = []
    for block in epikv_blocks():
        if block and block[0][0] not in PARSE_ONLY and "cuda" not in block[0] and block not in out:
            out.append(block)
    return out


def test_the_cpu_blocks_are_the_expected_ones():
    firsts = sorted(b[0][0] for b in runnable_blocks())
    # generate: the main job, the README's first runs (torch, llama.cpp), getting-started's, llama.cpp's page;
    # retention: torch and llama.cpp
    assert firsts == ["eval", "generate", "generate", "generate", "generate", "generate", "retention",
                      "retention"], firsts


def placeholder(argv: list[str]) -> bool:
    """A command showing where the user's own file goes (`path/to/...`): parsed above, not run."""
    return any(a.startswith("path/to/") for a in argv)


@pytest.mark.parametrize("i", range(len(runnable_blocks())))
def test_cpu_block_runs_in_small_form(repo_like, capsys, i):
    for argv in runnable_blocks()[i]:
        if placeholder(argv):
            continue
        assert argv[0] in SMALL, f"no small form for `epikv {argv[0]}`: add it to SMALL or PARSE_ONLY"
        code = main(small_form(argv))
        out, err = capsys.readouterr()
        assert code == 0, f"`epikv {' '.join(small_form(argv))}` exited {code}: {err[-2000:]}"


def library_blocks(page: str) -> list[str]:
    """A page's Python blocks that use the library itself (the `openai` client blocks need a server: see below)."""
    return [b for b in blocks("python", page) if "from openai import" not in b]


PYTHON_PAGES = sorted(p for p in PAGES if library_blocks(p))


def test_the_python_pages_are_the_expected_ones():
    assert PYTHON_PAGES == ["README.md", "docs/SERVING.md", "docs/python-api.md", "docs/reasoning.md"], PYTHON_PAGES
    assert "next_turn" in "".join(library_blocks("docs/python-api.md"))


@pytest.mark.parametrize("page", [p for p in PYTHON_PAGES if p != "docs/SERVING.md"])
def test_python_blocks_run_as_written(tmp_path, page):
    code = "\n\n".join(library_blocks(page))
    assert "inputs" in code or page == "docs/reasoning.md"
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=8", code)
    # a GPU example (a hub reasoning model on CUDA) runs here with the embedded model on the CPU in its place
    gpu = r'load_model\("[\w./-]+", device="cuda"\)'
    assert page != "docs/reasoning.md" or re.search(gpu, code)
    code = re.sub(gpu, 'load_model("smollm2")', code)
    (tmp_path / "readme_blocks.py").write_text(code, encoding="utf-8")
    r = subprocess.run([sys.executable, str(tmp_path / "readme_blocks.py")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "max_length" not in r.stderr, r.stderr[-3000:]  # a reply cut by generate's fallback length


def test_openai_client_blocks_run_against_a_server(tiny, monkeypatch):
    """docs/serve.md's `openai` client blocks, as written, against `epikv serve`'s app on 127.0.0.1 (a
    scripted engine that answers with a reasoning model's text) with --reasoning-parser deepseek-r1."""
    pytest.importorskip("prometheus_client")
    openai = pytest.importorskip("openai")
    from test_serving_app import App, Scripted

    (code,) = [b for b in blocks("python", "docs/serve.md") if "from openai import" in b]
    backend = Scripted(tiny.tokenizer, eos=tiny.tokenizer.eos_token_id)
    backend.sampling_fields = frozenset({"temperature", "top_p", "top_k", "min_p", "seed"})
    # served under the block's name, so the block runs as printed
    app = App(backend, tiny.tokenizer, reasoning_parser="deepseek-r1", aliases=("smollm2",))
    try:
        code = code.replace("http://127.0.0.1:8000", app.url)  # the block as printed, but for the test server's port
        printed: list = []
        exec(compile(code, "docs/serve.md", "exec"), {"print": lambda *a: printed.extend(a), "__name__": "readme"})
    finally:
        app.close()
    assert printed == ["Let me add 2 and 2: that is 4.", "The answer is 4."], printed


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_python_block_compiles(page):
    """Python blocks that only sketch an interface (docs/SERVING.md's, which need a model and a started engine) are
    at least valid Python; the others run above."""
    for i, code in enumerate(blocks("python", page)):
        compile(code, f"{page} python block {i + 1}", "exec")
