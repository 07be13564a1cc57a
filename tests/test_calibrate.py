"""`epikv calibrate`'s resume file (issue 55 item 11): an interrupt anywhere in a text, its layer loop or the adding
of its sums, resumes to exactly the weights of an uninterrupted run; the file is loaded with weights_only=True and
checked, so a crafted pickle runs no code and a foreign or reshaped file is refused in one line (exit 2)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import epikv.calibrate as cal
from epikv.policies.learned import load_weights
from test_learned import _cli

N_LAYERS = 4  # random:tiny


@pytest.fixture
def run(tmp_path, capsys):
    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"id": f"x{i}", "text": f"Step {i}: add {i} and {i + 1} to get {2 * i + 1}."
                                         " Then multiply by two."}) + "\n" for i in range(4)))

    def go(name):
        out = tmp_path / f"{name}.safetensors"
        code, stdout, err = _cli(["calibrate", "--model", "random:tiny", "--texts", str(texts), "--max-tokens", "32",
                                  "--out", str(out)], capsys)
        return code, out, err

    return go


def _uninterrupted(run):
    code, out, _ = run("once")
    assert code == 0
    return load_weights(out)


def _resumed_equals(run, once, name):
    """Whether rerunning `name` (resuming its checkpoint) ends with exactly the weights `once`."""
    code, out, _ = run(name)
    assert code == 0
    got = load_weights(out)
    return (torch.equal(got.weight, once.weight) and torch.equal(got.bias, once.bias)
            and torch.equal(got.decay_weight, once.decay_weight) and torch.equal(got.decay_bias, once.decay_bias))


def test_an_interrupt_inside_a_texts_layer_loop_resumes_to_the_same_weights(run, monkeypatch):
    """KeyboardInterrupt raised while the second text's third layer is read: the checkpoint holds the first text
    alone, whole, and the resumed run ends with exactly the uninterrupted run's weights."""
    once = _uninterrupted(run)
    real, calls = cal.attention_targets, []

    def flaky(*a):
        calls.append(1)
        if len(calls) == N_LAYERS + 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(cal, "attention_targets", flaky)
    code, out, _ = run("twice")
    assert code == 130 and not out.exists()
    part = torch.load(str(out) + ".partial.pt", weights_only=True)
    assert part["done"] == ["x0"] and int(part["sums"]["n"][0]) == part["tokens"]
    monkeypatch.setattr(cal, "attention_targets", real)
    assert _resumed_equals(run, once, "twice")


def test_ctrl_c_while_a_texts_sums_are_added_is_held_until_the_text_is_whole(run, monkeypatch):
    """A real SIGINT sent while the second text's sums are added (after its second layer): it is raised once the
    text is added whole, the checkpoint counts it, and the resume gives exactly the uninterrupted weights."""
    once = _uninterrupted(run)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real, calls = cal.RidgeSums.add, []

    def add(self, layer, x, ys):
        real(self, layer, x, ys)
        calls.append(layer)
        if len(calls) == 2 * N_LAYERS + 4:  # two sums a layer: the score's, the decay map's
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cal.RidgeSums, "add", add)
    code, out, _ = run("twice")
    assert code == 130 and not out.exists()
    part = torch.load(str(out) + ".partial.pt", weights_only=True)
    assert part["done"] == ["x0", "x1"] and calls == [l for l in range(N_LAYERS) for _ in "sd"] * 2
    assert int(part["sums"]["n"][-1]) == part["tokens"]
    monkeypatch.setattr(cal.RidgeSums, "add", real)
    assert _resumed_equals(run, once, "twice")


class _Evil:
    """Unpickled without weights_only, it creates the file `marker` (any code could run instead)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_or_foreign_resume_file_is_refused_in_one_line(run, tmp_path, monkeypatch):
    out = tmp_path / "r.safetensors"
    partial = tmp_path / "r.safetensors.partial.pt"
    marker = tmp_path / "ran"
    torch.save({"config": {}, "sums": _Evil(str(marker)), "done": [], "tokens": 0}, partial)
    code, _, err = run("r")
    assert not marker.exists(), "the crafted checkpoint ran code"
    assert code == 2 and len(err) == 1 and "is not a checkpoint of epikv calibrate" in err[0], err
    assert not out.exists()
    partial.write_bytes(b"not a torch file")
    code, _, err = run("r")
    assert code == 2 and len(err) == 1 and "is not a checkpoint of epikv calibrate" in err[0], err
    # a checkpoint of this calibration, reshaped or retyped: refused before any of it is used
    real, calls = cal.attention_targets, []

    def flaky(*a):
        calls.append(1)
        if len(calls) == N_LAYERS + 1:
            raise KeyboardInterrupt
        return real(*a)

    partial.unlink()
    monkeypatch.setattr(cal, "attention_targets", flaky)
    assert run("r")[0] == 130
    monkeypatch.setattr(cal, "attention_targets", real)
    for name, edit in (("sxx shape", lambda s: s["sums"].__setitem__("sxx", s["sums"]["sxx"][:, :-1])),
                       ("sy dtype", lambda s: s["sums"]["sy"].__setitem__("kvzap", s["sums"]["sy"]["kvzap"].float())),
                       ("done ids", lambda s: s.__setitem__("done", [0])),
                       ("tokens", lambda s: s.__setitem__("tokens", -1.5)),
                       ("decay sxy shape", lambda s: s["decay"]["sxy"].__setitem__(
                           "decay", s["decay"]["sxy"]["decay"][:, :, :1])),
                       ("extra key", lambda s: s.__setitem__("x", 1))):
        st = torch.load(partial, weights_only=True)
        edit(st)
        bad = tmp_path / "b.safetensors.partial.pt"
        torch.save(st, bad)
        code, _, err = run("b")
        assert code == 2 and len(err) == 1 and "is not a checkpoint of epikv calibrate" in err[0], (name, err)
        assert not (tmp_path / "b.safetensors").exists()
    # a checkpoint written before the decay map (no decay sums): refused, saying why
    st = torch.load(partial, weights_only=True)
    del st["decay"]
    st["config"].pop("horizon")
    torch.save(st, tmp_path / "o.safetensors.partial.pt")
    code, _, err = run("o")
    assert code == 2 and len(err) == 1 and "before the decay map" in err[0], err
    assert run("r")[0] == 0  # the untouched checkpoint resumes


def test_the_cli_names_calibrates_own_horizon_defaults():
    """`calibrate --help` and docs/cli.md state the horizon's default without importing torch: the numbers named in
    the command are the ones calibrate fits with. Mutant: either constant changed on one side."""
    from epikv import calibrate
    from epikv.commands import calibrate as command

    assert (command.HORIZON, command.MIN_LAGS) == (calibrate.HORIZON, calibrate.MIN_LAGS)
