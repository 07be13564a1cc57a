"""The documentation stays true to its sources: every generated block of README.md and docs/*.md (measured tables
from committed raw files, the CLI reference from the parsers, the policy table from the registry) is what
benchmarks/render.py renders now; no table of measured numbers is written by hand; the site builds with
`mkdocs build --strict` (no broken link, no missing page, no warning). mkdocs comes from the `docs` extra, which
scripts/install.sh installs: a missing mkdocs fails here, it is not skipped."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RENDER = ROOT / "benchmarks" / "render.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _render_module():
    spec = importlib.util.spec_from_file_location("epikv_render", RENDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _render_module()


def run_render(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("EPIKV_POLICIES", None)
    return subprocess.run([sys.executable, str(RENDER), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env)


def test_every_generated_block_is_current():
    """Re-render every block (tables from benchmarks/results/, the CLI reference, the policy table) and compare."""
    r = run_render("--check")
    assert r.returncode == 0, r.stderr + r.stdout


def test_the_expected_blocks_are_on_their_pages():
    found = {p.relative_to(ROOT).as_posix(): set(render.OPEN.findall(p.read_text(encoding="utf-8"))) for p in PAGES}
    assert "headline" in found["README.md"]
    assert {"llamacpp-step", "llamacpp-capture", "llamacpp-long", "llamacpp-interleaved",
            "llamacpp-retention"} <= found["docs/llamacpp.md"]
    assert {"serve-streams", "serve-llama-server", "serve-h200", "serve-sampled", "soak"} <= found["docs/serve.md"]
    assert "retention-vs-random" in found["docs/choosing.md"]
    assert {"bench-overhead", "bench-long"} <= found["docs/benchmarks.md"]
    assert "pages" in found["docs/SERVING.md"]
    assert {"policies", "policy-matrix"} <= found["docs/policies.md"]
    # every command of the CLI has its generated reference
    sub = render._sub(render._command_parser([]))
    names = set()
    for name, p in sub.choices.items():
        names.add(f"cli:{name}")
        inner = render._sub(p)
        names |= {f"cli:{name}.{n}" for n in (inner.choices if inner else ())}
    assert names <= found["docs/cli.md"], names - found["docs/cli.md"]
    # every renderer is used somewhere
    used = set().union(*found.values())
    assert set(render.RENDERERS) <= used, set(render.RENDERERS) - used


def _rendered(page: str, name: str) -> tuple[str, str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    m = re.search(rf"<!-- render:{re.escape(name)} -->\n(.*?)<!-- /render:{re.escape(name)} -->", text, re.S)
    assert m, f"{page} has no block {name}"
    return text, m.group(1)


def test_a_number_edited_by_hand_is_caught():
    """The check is not vacuous: a figure changed inside a rendered table makes the page differ from its render."""
    text, body = _rendered("docs/llamacpp.md", "llamacpp-step")
    assert "44.43" in body
    edited = text.replace("44.43", "80.00", 1)
    assert render.render_page(edited, "docs/llamacpp.md", {}) == text
    assert render.render_page(edited, "docs/llamacpp.md", {}) != edited


def test_a_cli_option_added_to_the_parser_shows_in_the_reference():
    text, body = _rendered("docs/cli.md", "cli:generate")
    for opt in ("--budget", "--policy", "--engine", "--max-new-tokens"):
        assert f"`{opt}`" in body


def test_each_measured_table_names_its_raw_file_command_and_date():
    for p in PAGES:
        text = p.read_text(encoding="utf-8")
        for m in render.MARKER.finditer(text):
            if m.group("name").startswith("cli") or m.group("name") in ("policies", "policy-matrix", "serve-fields"):  # not measured
                continue
            body = m.group("body")
            assert "benchmarks/results/" in body and re.search(r"\d{4}-\d{2}-\d{2}", body), (p, m.group("name"))
            if m.group("name") != "headline":
                assert "measured with `" in body, (p, m.group("name"))


def _tables_outside_blocks(text: str) -> list[str]:
    text = render.MARKER.sub("", text)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [line for line in text.splitlines() if line.startswith("|")]


# rows whose decimals are transformers versions, not measurements
VERSION_ROWS = ("| | 5.18+ (tested 5.25)", "| giving a page back |")


def test_no_table_of_measured_numbers_is_written_by_hand():
    """Outside generated blocks, no table row holds a decimal figure (a measurement); numbers in code spans and the
    version rows above are not figures."""
    bad = []
    for p in PAGES:
        for row in _tables_outside_blocks(p.read_text(encoding="utf-8")):
            cells = re.sub(r"`[^`]*`", "", row)
            if re.search(r"(?<![\w.])\d+\.\d+(?![\w.])", cells) and not row.startswith(VERSION_ROWS):
                bad.append(f"{p.relative_to(ROOT)}: {row[:100]}")
    assert not bad, "tables with figures outside a render block:\n" + "\n".join(bad)


def test_the_readme_stays_short_and_shows_its_figure():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert figures == ["docs/img/long-generation.png"] and (ROOT / figures[0]).is_file()
    # the set-up commands, exactly as .ci/run and the main job use them
    assert "bash scripts/install.sh --llamacpp && HF_HUB_OFFLINE=1 .venv/bin/python -m pytest" in text
    assert "bash scripts/install.sh --llamacpp && HF_HUB_OFFLINE=1 .venv/bin/python -m pytest" in \
        (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ('bash scripts/install.sh && .venv/bin/epikv generate --budget 96 --max-new-tokens 200 --prompt "Explain step '
            'by step why the sum of two odd numbers is even."') in text


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_readme_links_resolve():
    """The README is not part of the site, so mkdocs does not check its links: every relative link and anchor here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#([^)]*))?\)", text)
    assert len(links) > 10
    for target, anchor in links:
        assert (ROOT / target).exists(), target
        if anchor:
            heads = re.findall(r"^#+ (.*)$", (ROOT / target).read_text(encoding="utf-8"), flags=re.M)
            assert anchor in {_slug(h) for h in heads}, f"{target}#{anchor}"


def test_the_figure_is_drawn_from_its_raw_file(tmp_path):
    out = render.figure(tmp_path / "fig.png")
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize("args,message", [
    (["--no-such-option"], "unrecognized arguments"),
    (["no/such/page.md"], "no such page"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = run_render(*args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


@pytest.mark.parametrize("page,message", [
    ("<!-- render:no-such-table -->\n<!-- /render:no-such-table -->\n", "unknown block render:no-such-table"),
    ("<!-- render:soak -->\nunclosed\n", "unbalanced render markers"),
    ("<!-- render:cli:no-such-command -->\n<!-- /render:cli:no-such-command -->\n", "has no command"),
    ("\xff\xfe not utf-8", "not UTF-8"),
])
def test_bad_pages_are_one_line_and_exit_2(tmp_path, page, message):
    f = tmp_path / "page.md"
    f.write_bytes(page.encode("latin-1"))
    r = run_render("--check", str(f))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_a_missing_raw_file_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.setattr(render, "RESULTS", ROOT / "benchmarks" / "no-such-results")
    with pytest.raises(render.RenderError, match="raw file benchmarks/results/llamacpp/step.json is missing"):
        render.render_block("llamacpp-step")


def test_mkdocs_build_strict(tmp_path):
    """The site builds with no warning (strict): every nav page exists, every link and anchor resolves, and the API
    reference renders from the docstrings."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    api = (tmp_path / "site" / "python-api" / "index.html").read_text(encoding="utf-8")
    assert "EpiKVCache" in api and "doc-object" in api  # mkdocstrings ran
