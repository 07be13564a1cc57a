"""`epikv serve`'s options reach the server as a typed ServeConfig built by the CLI: nothing below `commands/`
imports `epikv.commands` (the serving modules never read an argparse.Namespace), and the config the CLI builds holds
the resolved options and survives pickling (Ray hands it to each replica)."""

import ast
import pickle
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "epikv"


def _imports_commands(text: str, pkg: tuple) -> list[int]:
    """Lines of a module of package `pkg` (("epikv", "serving") for epikv/serving/x.py) that import epikv.commands,
    absolutely or relatively, at any depth of the file."""
    tree = ast.parse(text)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "epikv.commands" or n.startswith("epikv.commands.") for n in names):
            hits.append(node.lineno)
    return sorted(hits)


def test_no_module_below_commands_imports_commands():
    """Mutant: `from ..commands.serve import prepare` put back in serving/ray_serve.py fails this."""
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "commands" or rel == Path("cli.py"):
            continue
        lines = _imports_commands(path.read_text(encoding="utf-8"), ("epikv", *rel.parent.parts))
        if lines:
            offenders[str(rel)] = lines
    assert not offenders, f"modules below commands/ that import epikv.commands: {offenders}"


def test_the_scan_sees_each_form_of_the_import():
    """The scan itself: a relative import inside a function, `from .. import commands`, an absolute import."""
    text = ("def f():\n    from ..commands.serve import prepare\n\nimport epikv.commands.common\n"
            "from .. import commands\nfrom ..serving import app\nfrom . import build\n")
    assert _imports_commands(text, ("epikv", "serving")) == [2, 4, 5]
    assert _imports_commands("from .commands import x\n", ("epikv",)) == [1]


def _config(*argv):
    from epikv.cli import build_parser
    from epikv.commands.serve import config

    return config(build_parser().parse_args(["serve", *argv]))


def test_the_cli_builds_a_resolved_picklable_config():
    from epikv.serving.config import ServeConfig

    cfg = _config("--model", "random:tiny", "--policy", "epikv", "--budget", "64", "--num-blocks", "32",
                  "--layers", "0,1", "--ray", "--replicas", "2")
    assert isinstance(cfg, ServeConfig)
    assert (cfg.policy, cfg.budget, cfg.page, cfg.num_blocks, cfg.replicas) == ("epikv", 64, 16, 32, 2)
    assert cfg.settings["layers"] == (0, 1) and cfg.evicts
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    full = _config("--model", "random:tiny", "--policy", "full", "--num-blocks", "32")
    assert full.budget is None and not full.evicts  # a policy that never evicts has no budget


@pytest.mark.parametrize("argv, needle", [
    (["--num-blocks", "8", "--ctx", "64"], "--ctx: options of --engine llama.cpp"),
    (["--policy", "epikv"], "--num-blocks is required"),
    (["--engine", "llama.cpp", "--num-blocks", "8", "--sequences", "2"], "--num-blocks: options of the torch"),
    (["--engine", "llama.cpp", "--policy", "full", "--sequences", "2"], "needs --ctx"),
    (["--engine", "llama.cpp", "--ctx", "64", "--sequences", "2", "--dtype", "float16"], "--dtype"),
])
def test_bad_options_are_refused_before_anything_loads(argv, needle):
    from epikv.errors import EpiKVError

    with pytest.raises(EpiKVError, match=needle.replace(".", r"\.")):
        _config(*argv)
