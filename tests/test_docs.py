"""The documentation stays true to its sources: every generated block of README.md and docs/*.md (measured tables
from committed raw files, the CLI reference from the parsers, the policy table from the registry) is what
benchmarks/render.py renders now; no table of measured numbers is written by hand; the site builds with
`mkdocs build --strict` (no broken link, no missing page, no warning). mkdocs comes from the `docs` extra, which
scripts/install.sh installs: a missing mkdocs fails here, it is not skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RENDER = ROOT / "benchmarks" / "render.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _module(RENDER, "epikv_render")


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
    assert {"headline", "default-whole-traces"} <= found["README.md"]
    assert {"llamacpp-step", "llamacpp-capture", "llamacpp-long", "llamacpp-interleaved",
            "llamacpp-retention"} <= found["docs/llamacpp.md"]
    assert "serve-fields" in found["docs/serve.md"]  # the user page keeps its reference table; measurements below
    assert {"serve-streams", "serve-llama-server", "serve-h200", "serve-sampled", "soak", "serve-fuzz",
            "serve-load"} <= found["docs/benchmarks.md"]
    assert {"retention-vs-random", "whole-traces"} <= found["docs/choosing.md"]
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


def test_the_top_figure_shows_the_raw_file_its_caption_names(tmp_path, monkeypatch):
    """docs/img/long-generation.png carries the path and sha256 of the raw file it was drawn from, and they are the
    caption's file as committed. Mutants: a figure drawn from another raw file (a copy of it under another name), or from an older copy of
    the named file (one figure changed), is named by the check, and `render.py --check` then exits 1."""
    assert "drawn by `python benchmarks/render.py --figure` from `benchmarks/results/llamacpp/interleaved.json`" in \
        " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert render.FIGURE_SOURCE == "llamacpp/interleaved.json"
    assert render.figure_problem() is None
    old = tmp_path / "results" / "llamacpp"
    old.mkdir(parents=True)
    d = json.loads((render.RESULTS / render.FIGURE_SOURCE).read_text(encoding="utf-8"))
    # the same numbers under another name: the stamp names the file, not only the numbers
    (old / "copy.json").write_text(json.dumps(d), encoding="utf-8")
    # an older interleaved.json: one number differs
    first = next(iter(d["segments_tok_s"]))
    d["segments_tok_s"][first][-1] += 1.0
    (old / "interleaved.json").write_text(json.dumps(d), encoding="utf-8")
    monkeypatch.setattr(render, "RESULTS", tmp_path / "results")
    other, stale = render.figure(tmp_path / "other.png", "llamacpp/copy.json"), render.figure(tmp_path / "stale.png")
    monkeypatch.undo()
    assert "llamacpp/copy.json" in render.figure_problem(other)
    assert "sha256" in render.figure_problem(stale)
    assert render.figure_problem(tmp_path / "missing.png").endswith("is missing")


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


REPO_URL = "https://example.org/owner/epikv"


def test_repository_paths_become_links_only_when_a_repository_url_is_set():
    """A quoted path that exists becomes a link to its file (blob) or folder (tree); fenced code, a span already
    inside a link, a path that does not exist and prose in code are left alone; no URL, no change."""
    links = _module(ROOT / "scripts" / "mkdocs_repo_links.py", "epikv_repo_links").link_paths
    page = "\n".join(["See `src/epikv/cache.py` and `benchmarks/results/`, and `README.md`.",
                      "```bash", "cat `src/epikv/cache.py`", "```",
                      "Already [`src/epikv/cli.py`](cli.md); gone: `src/epikv/nope.py`; code: `--budget 96`."])
    assert links(page, None) == page and links(page, "") == page
    out = links(page, REPO_URL + "/").split("\n")
    assert out[0] == (f"See [`src/epikv/cache.py`]({REPO_URL}/blob/main/src/epikv/cache.py) and "
                      f"[`benchmarks/results/`]({REPO_URL}/tree/main/benchmarks/results), and "
                      f"[`README.md`]({REPO_URL}/blob/main/README.md).")
    assert out[1:4] == ["```bash", "cat `src/epikv/cache.py`", "```"]
    assert out[4] == "Already [`src/epikv/cli.py`](cli.md); gone: `src/epikv/nope.py`; code: `--budget 96`."
    assert links(page, REPO_URL, branch="dev").count("/blob/dev/") == 2


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    # built as a publisher would, with the repository's URL (mkdocs.yml reads it from EPIKV_REPO_URL)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NO_MKDOCS_2_WARNING": "1", "EPIKV_REPO_URL": REPO_URL}
    env.pop("EPIKV_REPO_BRANCH", None)
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    return r, out / "site"


def test_mkdocs_build_strict(site):
    """The site builds with no warning (strict): every nav page exists, every link and anchor resolves, and the API
    reference renders from the docstrings."""
    r, out = site
    assert r.returncode == 0, r.stderr[-4000:]
    api = (out / "python-api" / "index.html").read_text(encoding="utf-8")
    assert "EpiKVCache" in api and "doc-object" in api  # mkdocstrings ran
    # the header links to the repository and the quoted paths to their files
    home = (out / "index.html").read_text(encoding="utf-8")
    assert f'href="{REPO_URL}"' in home
    serve = (out / "serve" / "index.html").read_text(encoding="utf-8")
    assert f'href="{REPO_URL}/blob/main/src/epikv/serving/schema.py"' in serve, "no path link on serve.md"


# the serving names a user needs (epikv.serving.__all__ also lists the scheduler's class, plumbing)
SERVING_PUBLIC = ["ServeSpec", "start_manager", "check_serving", "serving_stats", "run_batch", "ServingUnsupported"]
# members each class's entry must show (its `members:` list), and plumbing it must not
MEMBERS = {"epikv.EpiKVCache": ["get_seq_length", "stored_length", "stats"], "epikv.Decoder": ["prefill", "step"],
           "epikv.Policy": ["tau", "recent", "observes", "scores", "keep"],
           "epikv.GenerationResult": ["texts", "token_ids", "finish_reasons", "stats"],
           "epikv.Sampling": ["temperature", "top_p", "seed"], "epikv.policies.Observes": ["hidden_layers", "queries"],
           "epikv.policies.StepObservation": ["hidden", "valid"], "epikv.policies.CacheView": ["length", "keys"]}
PLUMBING = ["epikv.EpiKVCache.begin", "epikv.EpiKVCache.prepare", "epikv.EpiKVCache.held_eviction",
            "epikv.EpiKVCache.update"]


def _reference_ids() -> dict[str, object]:
    """The identifiers of the reference's `::: X` entries, each with the object it names."""
    import importlib

    out = {}
    for ident in re.findall(r"^::: ([\w.]+)", (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8"), re.M):
        mod, _, attr = ident.rpartition(".")
        try:
            out[ident] = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            out[ident] = importlib.import_module(ident)
    return out


def _entry(html: str, ident: str) -> tuple[str, str]:
    """(signature html, description text) of the reference entry whose heading id is `ident`."""
    m = re.search(rf'<h3 id="{re.escape(ident)}".*?</h3>(.*?)(?=<div class="doc doc-children">|<h3 |\Z)', html, re.S)
    assert m, f"no reference entry for {ident}"
    body = m.group(1)
    sig = re.search(r'<div class="doc-signature highlight">(.*?)</div>', body, re.S)
    desc = re.search(r'<div class="doc doc-contents[^"]*">(.*)', body, re.S)
    text = re.sub(r"<[^>]+>", " ", desc.group(1)) if desc else ""
    return (sig.group(1) if sig else ""), " ".join(text.split())


def test_every_public_name_has_a_reference_entry_with_signature_and_description(site):
    """Every name in epikv.__all__, epikv.llamacpp.__all__ and the serving names has a `:::` entry that renders its
    signature (callables) and a description; each class shows its listed members and hides the engine's plumbing.
    Mutants: a public name without a docstring (GenerationResult's removed), a `members:` entry removed
    (EpiKVCache's stats), a name dropped from the page: each fails here."""
    import inspect

    import epikv
    import epikv.llamacpp
    import epikv.serving

    r, out = site
    assert r.returncode == 0, r.stderr[-4000:]
    html = (out / "python-api" / "index.html").read_text(encoding="utf-8")
    ids = _reference_ids()
    public = [(f"epikv.{n}", getattr(epikv, n)) for n in epikv.__all__]
    public += [(f"epikv.llamacpp.{n}", getattr(epikv.llamacpp, n)) for n in epikv.llamacpp.__all__]
    public += [(f"epikv.serving.{n}", getattr(epikv.serving, n)) for n in SERVING_PUBLIC]
    missing, empty, unsigned = [], [], []
    for name, obj in public:
        found = [i for i, o in ids.items() if o is obj]
        if not found:
            missing.append(name)
            continue
        sig, desc = _entry(html, found[0])
        if len(desc) < 20:
            empty.append(found[0])
        callable_ = inspect.isfunction(obj) or inspect.isclass(obj) and not (
            issubclass(obj, Exception) and "__init__" not in vars(obj))  # an exception with Exception's own init
        if callable_ and "(" not in re.sub(r"<[^>]+>", "", sig):
            unsigned.append(found[0])
    assert not missing, f"public names without a reference entry in docs/python-api.md: {missing}"
    assert not empty, f"reference entries with no description: {empty}"
    assert not unsigned, f"reference entries without a signature: {unsigned}"
    for cls, members in MEMBERS.items():
        for m in members:
            assert f'id="{cls}.{m}"' in html, f"{cls}.{m} is not in the reference"
    shown = [p for p in PLUMBING if f'id="{p}"' in html]
    assert not shown, f"engine plumbing shown in the reference: {shown}"


# Figures in the prose of the pages (outside render blocks, code and code spans): a decimal, a number with a
# thousands separator, a percentage or a ratio. Each must be rendered from its raw file or listed here. These were
# in the pages when this check came in (after issue 48 fixed the wrong ones: serve.md's peak cells, sequences a step,
# run time and logit gap; llamacpp.md's load note and tau-16 row); add a new one only with the raw file it comes from.
PROSE_FIGURES = {
    "README.md": {"2606.26472", "6,000"},
    "docs/SERVING.md": {"0.03", "0.04", "0.099", "0.121", "0.8", "49,152", "5.16", "5.17", "5.18", "5.25", "90 %",
        "95 %"},
    # with the serving rows moved here from serve.md (issue 48: measurement narrative off the user pages)
    "docs/benchmarks.md": {"6,000", "8,128", "8,192", "0.3", "0.6", "0.95", "1,024", "1,200", "1,280", "1.60x", "1.84x",
        "10 %", "10,070", "10,240", "16,400", "24,576", "2x", "3,072", "3x", "40 %", "8 x", "8,813",
        "4,096"},  # the long case's length (8 x 4,096), a setting
    "docs/evaluation.md": {"0.6", "0.95", "1.69x", "1.7x", "3,960", "95 %"},
    "docs/getting-started.md": {"0.3", "5.0", "5.17", "5.24"},
    "docs/index.md": {"1,000", "2606.26472", "6,000"},
    "docs/llamacpp.md": {"0.3", "0.96x", "0.979", "1,024", "1.0", "1.03x", "1.08x", "1.10x", "10 %", "11.6 %",
        "118 %", "15 %", "16.80", "17.42", "17.7", "2.4 %", "2.71x", "2.75x", "2.98x", "20 %", "3x", "4.0 %",
        "45.52", "47.98", "4x", "50 %", "6 %", "6,000", "61 %", "8.8"},
    "docs/method.md": {"0.003"},
    # the learned score's arXiv ids, and its calibration run: benchmarks/results/learned/calibrate-{kvzap,mean}.json;
    # the decay map's R^2: calibrate-decay.json
    "docs/policies.md": {"2510.01290", "2512.03324", "2601.07891", "9,541", "1,298", "0.668", "0.624", "0.323"},
    "docs/reasoning.md": {"2.4"},
    "docs/serve.md": {"10 %", "2 %", "2.5", "5.17", "5.25", "90 %"},
}
FIGURE = re.compile(r"(?<![\w.,/-])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+(?=\s?(?:%|x\b)))(?:\s?(?:%|x\b))?")


def prose_figures(text: str) -> set[str]:
    text = render.MARKER.sub("", text)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    return {m.group(0) for m in FIGURE.finditer(text)}


def test_no_unrendered_figure_in_the_prose():
    """Mutant: "up to 0.70 in the logits" (no raw file) typed back into docs/serve.md fails here."""
    bad = {}
    for p in PAGES:
        page = p.relative_to(ROOT).as_posix()
        extra = prose_figures(p.read_text(encoding="utf-8")) - PROSE_FIGURES.get(page, set())
        if extra:
            bad[page] = sorted(extra)
    assert not bad, f"figures in the prose that are neither rendered nor listed in PROSE_FIGURES: {bad}"
    assert prose_figures("measured: up to 0.70 in the logits, 2.3x, 12 %, 9,500 cells; `1.5` K = 512") == \
        {"0.70", "2.3x", "12 %", "9,500"}


def test_the_headline_reads_what_it_states_from_the_raw_files(monkeypatch):
    """The README headline takes its thread count and generation length from the raw file, computes the ratio from
    the two rates it prints, and the llama-server row's ratios from the interleaved run's rows. Mutants (raw values
    edited in memory): threads 1 -> 4, the whole cache's last rate 6.97 -> 9.97, llama-server's rates doubled: each
    changes the rendered row (before, a stored ratio and a literal "1 thread" hid them)."""
    import copy

    base = render.headline()
    real_json = render.load_json

    def edited_json(edit):
        def load(rel):
            d = copy.deepcopy(real_json(rel))
            return edit(d) or d if rel == "llamacpp/interleaved.json" else d
        return load

    def more_threads(d):
        d["threads"] = 4

    monkeypatch.setattr(render, "load_json", edited_json(more_threads))
    assert "CPU, 4 threads" in render.headline() and "CPU, 1 thread)" in base

    seg = real_json("llamacpp/interleaved.json")["segments_tok_s"]
    full = next(k for k in seg if not k.startswith("epikv"))
    epi = next(k for k in seg if k.startswith("epikv"))
    expected = f"({round(seg[epi][-1], 2) / round(seg[full][-1] + 3, 2):.2f}x;"

    def slower_full(d):
        d["segments_tok_s"][full][-1] += 3

    monkeypatch.setattr(render, "load_json", edited_json(slower_full))
    assert expected in render.headline() and expected not in base

    monkeypatch.setattr(render, "load_json", real_json)
    real_jsonl = render.load_jsonl

    def faster_llama_server(rel):  # every llama-server row of the interleaved run twice as fast
        rows = copy.deepcopy(real_jsonl(rel))
        if rel == render.FAIR:
            for r in rows:
                if r["row"] == "llama-server":
                    r["tokens_per_s"] *= 2
        return rows

    fair = render._fair().medians(real_jsonl(render.FAIR))
    full = statistics.median(fair[min(fair)]["full"]["ratios"])
    monkeypatch.setattr(render, "load_jsonl", faster_llama_server)
    assert f"full {full / 2:.2f}x" in render.headline() and f"full {full:.2f}x" in base


def test_the_headline_step_cost_is_the_default_policys(monkeypatch):
    """The README's step-cost row names the default policy and reads its own raw file; pointed at another policy's
    measurement (the flat epikv's step.json, which the row used to state) it refuses to render. Mutant: the policy
    check removed."""
    from epikv.policies import DEFAULT_POLICY

    assert f"evicting step of the default `{DEFAULT_POLICY}`" in render.headline()
    monkeypatch.setattr(render, "DEFAULT_STEP", "llamacpp/step.json")
    with pytest.raises(render.RenderError, match="not the default"):
        render.headline()
