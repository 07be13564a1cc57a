"""Which transformers versions serve with eviction: the two paged-cache layouts epikv knows are accepted (5.17's
group_cache_managers, 5.18+'s cache_allocators) and every other continuous batching is refused in one line, exit 2.
Runs on every version of the test matrix (scripts/test-matrix.sh), never skipped."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from epikv.serving import ServeSpec, ServingUnsupported, check_serving
from epikv.serving.checks import check_internals

SRC = str(Path(__file__).resolve().parents[1] / "src")
TF = Version(transformers.__version__)


def test_the_self_check_accepts_exactly_the_tested_layouts(tiny):
    from epikv.serving.layout import GroupLayout, LedgerLayout, layout_kind

    if TF < Version("5.17"):  # outside the tested range: refused, naming what is missing
        with pytest.raises(ServingUnsupported) as e:
            check_serving(tiny.model, ServeSpec(policy="epikv", budget=128, page=16, num_blocks=64))
        assert "\n" not in str(e.value) and e.value.missing
        return
    check_internals()
    assert layout_kind() is (GroupLayout if TF < Version("5.18") else LedgerLayout)
    assert check_serving(tiny.model, ServeSpec(policy="epikv", budget=128, page=16, num_blocks=64)).name == "epikv"


def test_other_versions_are_refused_in_one_line_exit_2():
    if TF >= Version("5.17"):  # a tested layout: make one internal disappear instead
        pre = ("import transformers.generation.continuous_batching.scheduler as s; del s.SCHEDULER_MAPPING\n")
        missing = "SCHEDULER_MAPPING"
    else:
        pre, missing = "", "lacks"
    code = pre + "import sys; from epikv.cli import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code, "serve", "--model", "random:tiny", "--page", "16",
                        "--num-blocks", "64", "--port", "0"], capture_output=True, text=True, env=env, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert missing in lines[0] and "5.17 or 5.25" in lines[0], lines[0]
