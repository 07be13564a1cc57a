import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every test (and the CLI subprocesses it starts) reads the data shipped in the package, never a developer's override
os.environ.pop("EPIKV_DATA_DIR", None)
# and no developer's learned weights: the weights cache folder is one of this run's, holding only random weights for
# random:tiny (below; tests that need another set their own)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["EPIKV_WEIGHTS_DIR"] = tempfile.mkdtemp(prefix="epikv-test-weights-")
atexit.register(shutil.rmtree, os.environ["EPIKV_WEIGHTS_DIR"], True)

import pytest
import torch


def _weights_for_random_tiny(folder: str) -> None:
    """The default policy (epikv-learned-decay) reads weights fitted per model and falls back, with a warning line,
    where none fit: random weights recorded for random:tiny's fingerprint in this run's weights folder let the tests
    that run the default on random:tiny run it as a user with fitted weights would (the fallback has tests of its own,
    each with an empty folder of its own)."""
    from epikv import load_model
    from epikv.fingerprint import model_fingerprint
    from epikv.policies.learned import LearnedWeights

    m = load_model("random:tiny").model
    n, kv, hidden = 4, 2, 64
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, kv, hidden, generator=g)
    dw = torch.randn(n, kv, hidden, generator=g) * 0.05
    db = -0.05 - 0.1 * torch.rand(n, kv, generator=g)
    LearnedWeights(w, torch.zeros(n, kv), torch.zeros(n, hidden), torch.ones(n, hidden),
                   {"model": "random:tiny", "fingerprint": model_fingerprint(m, m.model.layers)}, dw, db).save(
        os.path.join(folder, "random-tiny.safetensors"))


_weights_for_random_tiny(os.environ["EPIKV_WEIGHTS_DIR"])

# One intra-op thread: the test models are tiny, where OpenMP's thread hand-off costs ~10x the work itself
# (measured: 50 decode steps of random:tiny took 2.0 s of CPU with 2 threads, 0.19 s with 1).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny():
    from epikv import load_model

    return load_model("random:tiny")


@pytest.fixture(scope="session")
def smollm2():
    from epikv import load_model

    return load_model("smollm2")


def write_random_weights(path, n_layers: int, kv_heads: int, hidden: int, seed: int = 0) -> str:
    """A learned-score weights file of the given model shape, random (written in `epikv calibrate`'s format): the
    shipped weights fit SmolLM2 only, and a learned policy refuses any other shape in one line. With a random
    decay map (epikv-learned-decay's per-token rates: log beta of a few hundredths per step, varying by token),
    drawn after the score so the score is that of files written before the map."""
    from epikv.policies.learned import LearnedWeights

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_layers, kv_heads, hidden, generator=g)
    dw = torch.randn(n_layers, kv_heads, hidden, generator=g) * 0.05
    db = -0.05 - 0.1 * torch.rand(n_layers, kv_heads, generator=g)
    LearnedWeights(w, torch.zeros(n_layers, kv_heads), torch.zeros(n_layers, hidden), torch.ones(n_layers, hidden),
                   {"model": "tiny"}, dw, db).save(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_settings(tmp_path_factory):
    """settings(name) -> the policy settings a test passes to run `name` on random:tiny: random weights of its shape
    for a learned score (and a quarter-K window for epikv-learned-window, whose half of K does not fit beside the
    tests' prompts in their small budgets), nothing for any other policy."""
    import dataclasses

    from epikv.policies import REGISTRY

    folder = tmp_path_factory.mktemp("tiny-weights")

    def settings(name: str) -> dict:
        fields = {f.name for f in dataclasses.fields(REGISTRY[name])}
        if "weights" not in fields:
            return {}
        extra = {"recent_frac": 0.25} if name == "epikv-learned-window" else {}  # half of a tiny K leaves no room
        return {"weights": write_random_weights(folder / f"{name}.safetensors", 4, 2, 64), **extra}

    return settings


def record_keeps(monkeypatch, take) -> dict:
    """Spy on PolicyState.keep: {n: [take(keep, kwargs) for each keep set]} for the n-th PolicyState that evicted
    (one per generation or served request). Each log lives on its PolicyState, never keyed by id(): an id is reused
    once a finished request's state is freed, which merged two requests' logs."""
    from epikv.policy_state import PolicyState

    seen: dict[int, list] = {}
    orig = PolicyState.keep

    def spy(self, *a, **kw):
        keep = orig(self, *a, **kw)
        log = getattr(self, "_test_keep_log", None)
        if log is None:
            log = self._test_keep_log = []
            seen[len(seen)] = log
        log.append(take(keep, kw))
        return keep

    monkeypatch.setattr(PolicyState, "keep", spy)
    return seen


def bench_module(name: str, as_name: str | None = None):
    """benchmarks/<name>.py as a module, so a benchmark script's tests run the script's own code."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(as_name or name,
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
