"""MkDocs hook: repository paths quoted in the docs (`src/epikv/cache.py`, `benchmarks/results/...`) become links
to the repository when the site is built with a repository URL.

The project has no public URL of its own yet, so `mkdocs.yml` reads `repo_url` from the environment
(`EPIKV_REPO_URL`, a GitHub-style URL such as https://github.com/OWNER/epikv): whoever publishes the site sets it, and
then the header links to the repository and every quoted path that exists in this checkout links to its file
(`/blob/<branch>/`) or folder (`/tree/<branch>/`). Unset, the pages are left as they are (paths as code).
`EPIKV_REPO_BRANCH` names the branch (default main).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a quoted path: a top-level folder of the repository and at least one more part, or a top-level file
PATH = re.compile(r"(?:(?:src|benchmarks|tests|scripts|docs|\.ci)/[\w.@+-]+(?:/[\w.@+-]+)*/?"
                  r"|README\.md|pyproject\.toml|mkdocs\.yml)")
# an inline code span that is not already a link's text: not preceded by `[`, not followed by `](`
SPAN = re.compile(r"(?<!\[)`([^`\n]+)`(?!\]\()")
FENCE = re.compile(r"^\s*(```|~~~)")


def link_paths(markdown: str, repo_url: str | None, branch: str = "main", root: Path = ROOT) -> str:
    """`markdown` with each code span that is exactly an existing repository path turned into a link under
    `repo_url`; fenced blocks, spans already inside a link and paths that do not exist are left alone."""
    if not repo_url:
        return markdown
    base = repo_url.rstrip("/")

    def one(m: re.Match) -> str:
        path = m.group(1)
        if not PATH.fullmatch(path):
            return m.group(0)
        target = root / path.rstrip("/")
        if not target.exists():
            return m.group(0)
        kind = "tree" if target.is_dir() else "blob"
        return f"[`{path}`]({base}/{kind}/{branch}/{path.rstrip('/')})"

    out, fenced = [], None
    for line in markdown.split("\n"):
        f = FENCE.match(line)
        if f and (fenced is None or f.group(1) == fenced):
            fenced = None if fenced else f.group(1)
            out.append(line)
        elif fenced:
            out.append(line)
        else:
            out.append(SPAN.sub(one, line))
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (MkDocs' hook signature)
    return link_paths(markdown, config.get("repo_url"), os.environ.get("EPIKV_REPO_BRANCH", "main"))
