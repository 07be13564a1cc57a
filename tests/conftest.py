import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

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
