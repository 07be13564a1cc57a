"""Apply mutants one at a time to src/, run the test that guards each, restore the file; print each mutant with
pytest's exit code (1: the test caught it). A mutant: (name, file, old text, new text, test file, -k expression)."""
import os
import pathlib
import subprocess
import sys

root = pathlib.Path(__file__).resolve().parents[2]


def run(mutants, only=()):
    for name, f, a, b, test, k in mutants:
        if only and name not in only:
            continue
        p = root / f
        s = p.read_text()
        assert a in s, name
        p.write_text(s.replace(a, b, 1))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", test, "-k", k], cwd=root,
                               capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
            last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
            print(f"{name}: rc={r.returncode} {last}", flush=True)
        finally:
            p.write_text(s)
