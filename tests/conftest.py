import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny():
    from epikv import load_model

    return load_model("random:tiny")


@pytest.fixture(scope="session")
def smollm2():
    from epikv import load_model

    return load_model("smollm2")
