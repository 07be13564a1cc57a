"""A user's own policy: a Policy dataclass, registered by name, used by generate, EpiKVCache, Decoder and the CLI;
a policy object handed over is the object used."""

import re
import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

import epikv
from epikv import EpiKVCache, EpiKVError, Policy, generate, get_policy, register_policy
from epikv.engine import Decoder
from epikv.policies import REGISTRY, Observes

PROMPT = "The quick brown fox jumps over the lazy dog and then"


@dataclass
class OldestFirst(Policy):
    """Keep the oldest evictable tokens (reads the true positions it stores itself)."""

    block: int | None = None  # a block whose output it observes, None = the last (exercises hidden-state capture)

    name = "test-oldest"

    def observes(self, n_layers):
        return Observes(hidden_layers=(n_layers - 1 if self.block is None else self.block,))

    def on_tokens(self, state, obs):
        (h,) = obs.hidden.values()  # [batch, T, dim]
        assert h.shape[:2] == obs.valid.shape
        return {"age": obs.positions.float()}  # [batch, T], kept aligned through evictions

    def scores(self, state, view):
        return -view.token_data["age"]  # older = higher = kept


@pytest.fixture
def registry():
    """Leave REGISTRY and the plugin record as they were."""
    from epikv import policies

    saved, loaded = dict(REGISTRY), set(policies._loaded_plugins)
    yield REGISTRY
    REGISTRY.clear()
    REGISTRY.update(saved)
    policies._loaded_plugins.clear()
    policies._loaded_plugins.update(loaded)


def test_registered_policy_is_used_by_name(tiny, registry):
    assert register_policy(OldestFirst) is OldestFirst and REGISTRY["test-oldest"] is OldestFirst
    assert "test-oldest" in epikv.policy_names()
    with torch.inference_mode():
        dec = Decoder(tiny.model, "test-oldest", budget=16, tau=1, recent=4)
        ids = torch.arange(100, 140)[None]
        dec.prefill(ids[:, :8], [0])
        for t in range(8, 40):
            dec.step(ids[:, t : t + 1])
    # prompt (8) + the 4 oldest decoded tokens + the 4 newest: the policy's scores decided
    assert dec.cache.token_data["pos"][0].tolist() == list(range(12)) + list(range(36, 40))
    res = generate(tiny.model, tiny.tokenizer, PROMPT, policy="test-oldest", budget=16, max_new_tokens=20,
                   eos_token_ids=[], block=0)
    assert res.stats["evictions"] > 0


def test_policy_object_is_the_object_used(tiny):
    pol = OldestFirst()
    pol.calls = 0  # state a user attaches to the object must survive

    def counting(state, view):
        pol.calls += 1
        return OldestFirst.scores(pol, state, view)

    pol.scores = counting
    assert get_policy(pol) is pol and get_policy(pol, tau=None, recent=None) is pol and get_policy(pol, tau=1) is pol
    assert EpiKVCache(tiny.model, pol, budget=16).policy is pol
    assert Decoder(tiny.model, pol, budget=16).policy is pol
    res = generate(tiny.model, tiny.tokenizer, PROMPT, policy=pol, budget=16, max_new_tokens=20, eos_token_ids=[])
    assert pol.calls == res.stats["evictions"] > 0
    with epikv.press(tiny.model, policy=pol, budget=16) as p:
        assert p.policy is pol


def test_policy_object_with_other_settings_is_refused():
    pol = OldestFirst(tau=2)
    with pytest.raises(EpiKVError, match="tau=2, but tau=4 was asked"):
        get_policy(pol, tau=4)
    with pytest.raises(EpiKVError, match="no setting window"):
        get_policy(pol, window=3)
    assert get_policy(dataclasses.replace(pol, tau=4)).tau == 4  # the documented way


def test_register_refusals(registry):
    class NotDataclass(Policy):
        name = "test-nd"

        def scores(self, state, view):
            return None

    @dataclass
    class NoName(Policy):
        def scores(self, state, view):
            return None

    @dataclass
    class NoScores(Policy):
        name = "test-noscores"

    @dataclass
    class Taken(Policy):
        name = "epikv"

        def scores(self, state, view):
            return None

    @dataclass
    class NeedsArg(Policy):
        width: int = None
        name = "test-needs"

        def __post_init__(self):
            super().__post_init__()
            if self.width is None:
                raise ValueError("width is required")

        def scores(self, state, view):
            return None

    for cls, match in [(NotDataclass, "must be a @dataclass"), (NoName, "needs a class attribute name"),
                       (NoScores, "does not implement scores"), (Taken, "'epikv' is taken"),
                       (NeedsArg, "cannot be built from its defaults"), (int, "subclass of epikv.policies.Policy")]:
        with pytest.raises(EpiKVError, match=match):
            register_policy(cls)
    assert REGISTRY["epikv"] is not Taken
    register_policy(Taken, replace=True)
    assert REGISTRY["epikv"] is Taken


def test_decorator_and_redefinition(registry):
    def define():
        @register_policy
        @dataclass
        class Mine(Policy):
            name = "test-mine"

            def scores(self, state, view):
                return -view.token_data["pos"].float()

        return Mine

    first, again = define(), define()  # a notebook cell run twice: the same qualified name replaces
    assert first is not again and REGISTRY["test-mine"] is again


PLUGIN = '''
from dataclasses import dataclass
from epikv.policies import Policy, register_policy

@register_policy
@dataclass
class Newest(Policy):
    """Keep the newest evictable tokens."""
    name = "test-plugin-newest"
    weight: float = 1.0

    def scores(self, state, view):
        return self.weight * view.token_data["pos"].float()
'''


def test_cli_finds_a_plugin_policy(tmp_path, monkeypatch, capsys, registry):
    from epikv.cli import main

    path = tmp_path / "my_policies.py"
    path.write_text(PLUGIN)
    monkeypatch.setenv("EPIKV_POLICIES", str(path))
    rc = main(["generate", "--model", "random:tiny", "--prompt", PROMPT, "--raw", "--policy", "test-plugin-newest",
               "--budget", "16", "--max-new-tokens", "20", "--set", "test-plugin-newest.weight=2.0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["policy"] == "test-plugin-newest" and out["evictions"] > 0
    assert main(["policies", "--json"]) == 0
    assert "test-plugin-newest" in capsys.readouterr().out


def test_broken_plugin_is_one_line_error(tmp_path, monkeypatch, capsys, registry):
    from epikv.cli import main

    monkeypatch.setenv("EPIKV_POLICIES", str(tmp_path / "missing.py"))
    with pytest.raises(EpiKVError, match="could not load policy plugin"):
        get_policy("test-nowhere")
    rc = main(["generate", "--model", "random:tiny", "--prompt", PROMPT, "--policy", "test-nowhere",
               "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "test-nowhere" in err


def test_readme_example_runs(tiny, registry):
    """docs/python-api.md's "Your own policy" example, as written, registers a policy that evicts."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "python-api.md").read_text()
    code = text.split("## Your own policy", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=24, eos_token_ids=[]", re.sub(r"budget=\d+", "budget=16", code))
    code = code.replace("chat=True, ", "")  # the tiny model: no template, so the prompt fits budget 16
    env = {"lm": tiny, "generate": generate}
    exec(compile(code, "docs/python-api.md", "exec"), env)
    assert REGISTRY["loud"] is env["Loud"] and env["res"].stats["evictions"] > 0


@pytest.mark.parametrize("kind", ["missing file", "import error", "syntax error", "missing module"])
@pytest.mark.parametrize("argv", [
    ["generate", "--model", "random:tiny", "--prompt", PROMPT, "--policy", "test-mine", "--max-new-tokens", "2"],
    ["generate", "--model", "random:tiny", "--prompt", PROMPT, "--max-new-tokens", "2", "--set", "test-mine.w=1"],
    ["bench", "speed", "--model", "random:tiny", "--policies", "test-mine", "--out", "OUT"],
    ["policies"],
], ids=["generate", "set", "bench", "policies"])
def test_plugin_that_fails_to_load_says_so(tmp_path, monkeypatch, capsys, registry, kind, argv):
    """EPIKV_POLICIES naming a plugin that cannot load: one line naming the plugin and its error, exit 2, never
    'unknown policy' (which would send the user looking for a typo in the name)."""
    from epikv.cli import main

    src = {"import error": "import epikv_no_such_module_xyz\n", "syntax error": "def broken(:\n"}.get(kind)
    entry = str(tmp_path / "mine.py") if kind != "missing module" else "epikv_no_such_plugin_xyz"
    if src:
        (tmp_path / "mine.py").write_text(src)
    monkeypatch.setenv("EPIKV_POLICIES", entry)
    try:
        rc = main([tmp_path.joinpath("o.json").as_posix() if a == "OUT" else a for a in argv])
    except SystemExit as e:  # argparse (--set)
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"could not load policy plugin (EPIKV_POLICIES entry '{entry}')" in lines[0] and "unknown policy" not in err
    why = {"missing file": "FileNotFoundError: no such file", "import error": "No module named "
           "'epikv_no_such_module_xyz'", "syntax error": "SyntaxError", "missing module": "No module named "
           "'epikv_no_such_plugin_xyz'"}[kind]
    assert why in lines[0], lines[0]
    if argv[0] != "policies":
        assert "so policy 'test-mine' is not registered" in lines[0]
