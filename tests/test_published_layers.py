"""Every policy on every model the authors published layers for: the layers a policy reads when it scores
(`on_tokens`) and when it evicts (`keep`) are among those it declared in `observes()` for the engine's Depth.

The engines capture exactly what `observes()` declares (hidden states, queries and attention weights of the declared
blocks only), so a policy that recomputes a layer elsewhere (from a plain count, which carries no architecture and
falls back to the depth-scaled block) reads a block nobody captured. A tiny random model gets each published entry's
architecture and depth, and the entry's signature is given its tiny hidden size, so the published blocks apply.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from epikv import signals
from epikv.policies import REGISTRY, get_policy

from conftest import write_random_weights

ENTRIES = sorted(signals.PUBLISHED_PAIRS)  # (model_type, blocks, hidden size)
EVICTING = sorted(n for n, cls in REGISTRY.items() if cls.evicts)  # `full` reads nothing at an eviction it never makes
TINY_HIDDEN = 32
PROMPT = list(range(40, 56))  # 16 tokens
STEPS = 40
BUDGET = 40


class _Reads(list):
    """A per-layer list that records which layers are read (an index, or all of them by iteration)."""

    def __init__(self, items, log: set, n_layers: int):
        super().__init__(items)
        self._log, self._n = log, n_layers

    def __getitem__(self, i):
        if isinstance(i, slice):
            self._log.update(range(self._n)[i])
        else:
            self._log.add(range(self._n)[i])  # a negative index is the same block
        return super().__getitem__(i)

    def __iter__(self):
        self._log.update(range(len(self)))
        return super().__iter__()


class _ReadsDict(dict):
    def __init__(self, items, log: set):
        super().__init__(items)
        self._log = log

    def __getitem__(self, k):
        self._log.add(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self._log.add(k)
        return super().get(k, default)

    def __iter__(self):
        self._log.update(super().keys())
        return super().__iter__()

    def items(self):
        self._log.update(super().keys())
        return super().items()

    def values(self):
        self._log.update(super().keys())
        return super().values()


def _recorded(policy, n_layers: int) -> dict[str, set]:
    """Wrap the policy instance's on_tokens and keep so they read through recording views; returns the log."""
    log = {"hidden": set(), "attentions": set(), "queries": set(), "keys": set(), "values": set(), "keeps": set()}
    on_tokens, keep = policy.on_tokens, policy.keep

    def rec_on_tokens(state, obs):
        obs = dataclasses.replace(obs, hidden=_ReadsDict(obs.hidden, log["hidden"]),
                                  attentions=_ReadsDict(obs.attentions, log["attentions"]),
                                  keys=_Reads(obs.keys, log["keys"], n_layers),
                                  values=_Reads(obs.values, log["values"], n_layers))
        return on_tokens(state, obs)

    def rec_keep(state, view):
        log["keeps"].add(view.length)
        view = dataclasses.replace(view, keys=_Reads(view.keys, log["keys"], len(view.keys)),
                                   values=_Reads(view.values, log["values"], len(view.values)),
                                   queries=_Reads(view.queries, log["queries"], len(view.queries)))
        return keep(state, view)

    policy.on_tokens, policy.keep = rec_on_tokens, rec_keep
    return log


def _check(policy, obs, log, kv_read_ok: bool, n_layers: int) -> None:
    name = policy.name
    assert log["keeps"], f"{name}: no eviction ran"
    assert log["hidden"] <= set(obs.hidden_layers), \
        f"{name} read hidden states of blocks {sorted(log['hidden'] - set(obs.hidden_layers))} it did not declare"
    assert log["attentions"] <= set(obs.attention_layers), \
        f"{name} read attention weights of layers {sorted(log['attentions'] - set(obs.attention_layers))}"
    declared_q = (set(obs.query_layers or range(n_layers))) if obs.queries else set()  # () = every layer
    assert log["queries"] <= declared_q, \
        f"{name} read the queries of blocks {sorted(log['queries'] - declared_q)}, declared {sorted(declared_q)}"
    if not kv_read_ok:
        assert not (log["keys"] or log["values"]), f"{name} read cached keys/values it did not declare"


def _settings(name: str, n_layers: int, hidden: int, folder) -> dict:
    """Small enough schedules that a 56-token run evicts several times under every policy; a learned score gets
    random weights of the tiny model's shape (written with the calibrate command's file format)."""
    s = {"tau": 2}
    cls = REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    if "weights" in fields:
        s["weights"] = write_random_weights(folder / f"{name}-{n_layers}-{hidden}.safetensors", n_layers, 2, hidden)
    if "segment" in fields:
        s["segment"] = 8
    if "window" in fields and name.startswith("epikv"):
        s["window"] = 8
    return s


def _tiny_model(arch: str, n_layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, hidden_size=TINY_HIDDEN, intermediate_size=64, num_hidden_layers=n_layers,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               max_position_embeddings=512)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=ENTRIES, ids=lambda e: f"{e[0]}-{e[1]}")
def published_tiny(request):
    """A tiny model of a published entry's architecture and depth whose signature maps to the entry's layers."""
    arch, n_layers, hidden = request.param
    mp = pytest.MonkeyPatch()
    mp.setitem(signals.PUBLISHED_PAIRS, (arch, n_layers, TINY_HIDDEN), signals.PUBLISHED_PAIRS[request.param])
    yield request.param, _tiny_model(arch, n_layers)
    mp.undo()


def test_the_published_blocks_differ_from_the_scaled_ones():
    """The guard below means something only where the published blocks are not the depth-scaled ones."""
    from epikv.policies.hidden import default_pair

    for arch, n_layers, hidden in ENTRIES:
        scaled = (signals.scale_layer(10, n_layers), signals.scale_layer(21, n_layers))
        if signals.PUBLISHED_PAIRS[(arch, n_layers, hidden)][0] != scaled:
            break
    else:
        pytest.fail("every published pair equals the scaled one: the torch guard cannot tell them apart")
    depth = signals.Depth(n_layers, (arch, n_layers, hidden))
    assert default_pair(depth) != default_pair(n_layers)


def _torch_runs(name: str) -> bool:
    """Whether the torch engine runs the policy at all (context-shift renumbers positions: llama.cpp only)."""
    from epikv.support import torch_refusal

    return torch_refusal(REGISTRY[name]()) is None


@pytest.mark.parametrize("name", [n for n in EVICTING if _torch_runs(n)])
def test_torch_engine_reads_only_declared_layers(published_tiny, name, tmp_path):
    from epikv.engine import Decoder, attention_for
    from epikv.signals import model_depth

    (arch, n_layers, _), model = published_tiny
    pol = get_policy(name, **_settings(name, n_layers, TINY_HIDDEN, tmp_path))
    depth = model_depth(model.config, n_layers)
    assert depth.arch == (arch, n_layers, TINY_HIDDEN) and signals.published_pair(depth) is not None
    obs = pol.observes(depth)
    log = _recorded(pol, n_layers)
    with attention_for(model, pol):
        dec = Decoder(model, pol, BUDGET)
        logits = dec.prefill(torch.tensor([PROMPT]), [0])
        for _ in range(STEPS):
            logits = dec.step(logits.argmax(-1, keepdim=True))
    _check(pol, obs, log, obs.keys_values or obs.arriving_kv, n_layers)
    assert dec.cache_stats()["evictions"] > 0


# -- the same through llama.cpp, on a tiny GGUF of each published architecture and depth ----------------------------

GGUF_HIDDEN = 64


def _llamacpp_runs(name: str) -> bool:
    """Whether llama.cpp runs the policy at all (it refuses attention weights and per-head keep sets by name)."""
    from epikv.errors import EpiKVError
    from epikv.llamacpp.engine import check_policy

    try:
        check_policy(get_policy(name), 32)
    except EpiKVError:
        return False
    return True


@pytest.fixture(scope="module", params=ENTRIES, ids=lambda e: f"{e[0]}-{e[1]}")
def published_gguf(request, tmp_path_factory):
    from test_llamacpp import _tiny_gguf  # tests/ is on sys.path (pytest's default import mode)

    from epikv.llamacpp import available, load_gguf

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    arch, n_layers, hidden = request.param
    mp = pytest.MonkeyPatch()
    mp.setitem(signals.PUBLISHED_PAIRS, (arch, n_layers, GGUF_HIDDEN), signals.PUBLISHED_PAIRS[request.param])
    path = _tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{arch}-{n_layers}.gguf", arch=arch, n_layer=n_layers,
                      n_embd=GGUF_HIDDEN)
    yield request.param, load_gguf(str(path))
    mp.undo()


@pytest.mark.parametrize("name", [n for n in EVICTING if _llamacpp_runs(n)])
def test_llamacpp_engine_reads_only_declared_layers(published_gguf, name, tmp_path):
    from epikv.llamacpp import LlamaDecoder

    (arch, n_layers, _), gm = published_gguf
    assert gm.depth.arch == (arch, n_layers, GGUF_HIDDEN) and signals.published_pair(gm.depth) is not None
    pol = get_policy(name, **_settings(name, n_layers, GGUF_HIDDEN, tmp_path))
    obs = pol.observes(gm.depth)
    log = _recorded(pol, n_layers)
    dec = LlamaDecoder(gm, pol, BUDGET, max_tokens=len(PROMPT) + STEPS + 1, threads=1)
    logits = dec.prefill(PROMPT)
    for _ in range(STEPS):
        logits = dec.step(int(logits.argmax()))
    _check(pol, obs, log, obs.keys_values or obs.arriving_kv, n_layers)
    assert dec.evictions > 0
