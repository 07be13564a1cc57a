"""Which decoder blocks the EPIKV family reads: the authors' published layers for their two models (Qwen2-7B: 20, 24;
Llama-8B: 10, 21), the paper's 10, 21 of 32 scaled by depth elsewhere, an explicit `layers` always winning, and the
CLI saying which it chose (METHOD.md section 1 and the Qwen row of its results table)."""

import json

import pytest
from transformers import LlamaConfig, Qwen2Config

import epikv.signals as signals
from epikv.cache import EpiKVCache
from epikv.cli import main
from epikv.policies import get_policy
from epikv.signals import model_depth

QWEN7B = Qwen2Config(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                     num_key_value_heads=4)
QWEN1_5B = Qwen2Config(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                       num_key_value_heads=2)
LLAMA8B = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8)
# a Llama with Qwen-7B's depth and width: the published pair is keyed by architecture, not by shape alone
LLAMA_28 = LlamaConfig(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4)


def hidden_blocks(policy, config):
    return get_policy(policy).observes(model_depth(config, config.num_hidden_layers)).hidden_layers


@pytest.mark.parametrize("config, pair", [
    (QWEN7B, (20, 24)),  # the authors' Qwen-7B scripts
    (LLAMA8B, (10, 21)),  # the paper's Llama-8B layers
    (QWEN1_5B, (9, 18)),  # no published pair: round(10 * 28 / 32), round(21 * 28 / 32)
    (LLAMA_28, (9, 18)),
])
def test_default_pair_follows_the_published_layers_else_scales(config, pair):
    for name in ("epikv", "epikv-raw", "epikv-seg"):
        assert hidden_blocks(name, config) == pair, name
    assert hidden_blocks("epikv-a", config) == pair[:1]


def test_seg_q_recomputes_queries_after_block_a():
    # layer A + 1's input layernorm and q_proj (METHOD.md section 6): 21 on Qwen-7B, 11 on Llama-8B
    for config, qa in ((QWEN7B, 21), (LLAMA8B, 11)):
        obs = get_policy("epikv-seg-q").observes(model_depth(config, config.num_hidden_layers))
        assert obs.query_layers == (qa,)


def test_set_layers_win_over_the_published_pair():
    depth = model_depth(QWEN7B, 28)
    assert get_policy("epikv", layers=(3, 5)).observes(depth).hidden_layers == (3, 5)


def test_plain_int_depth_scales():
    # a bare int (no architecture) never matches a published pair
    assert get_policy("epikv").observes(28).hidden_layers == (9, 18)


def test_cache_reads_the_published_pair_of_its_model(tiny, monkeypatch):
    # give the tiny model's signature a published pair and check the cache hooks exactly those blocks
    sig = (tiny.model.config.model_type, tiny.model.config.num_hidden_layers, tiny.model.config.hidden_size)
    monkeypatch.setitem(signals.PUBLISHED_PAIRS, sig, ((0, 2), "a test pair"))
    cache = EpiKVCache(tiny.model, "epikv", budget=16)
    assert cache._capture_hidden == frozenset({0, 2})


def test_generate_json_names_the_blocks(capsys, tiny, monkeypatch):
    argv = ["generate", "--model", "random:tiny", "--prompt", "Hello there", "--max-new-tokens", "2", "--json",
            "--policy", "epikv"]  # the default (epikv-seg-q) reads one block: the flat score's pair is named here
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # 4 blocks: round(10 * 4 / 32) = 1, round(21 * 4 / 32) = 3
    assert out["layers"] == "blocks 1, 3 (from the paper's 10, 21 of 32, scaled to 1, 3 for 4 blocks)"
    assert main(argv + ["--policy", "epikv-seg-q"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"].startswith("blocks 2 (")  # queries at A + 1 only
    assert main(argv + ["--layers", "0,2"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == "blocks 0, 2 (set)"
    assert main(argv + ["--policy", "h2o"]) == 0
    assert "layers" not in json.loads(capsys.readouterr().out)
    sig = ("llama", 4, 64)
    monkeypatch.setitem(signals.PUBLISHED_PAIRS, sig, ((0, 2), "a test pair"))
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == "blocks 0, 2 (from a test pair: 0, 2)"


def test_generate_live_names_the_blocks_once_the_run_starts(capsys, tiny):
    # the note comes once, on stderr, when the run has passed its checks (a refused run prints one error line only:
    # test_cli.test_generate_bad_input)
    argv = ["generate", "--model", "random:tiny", "--prompt", "Hello there", "--max-new-tokens", "3", "--policy", "epikv"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("[epikv reads blocks 1, 3 (from the paper's 10, 21 of 32, scaled to 1, 3 for 4 blocks)]") == 1
