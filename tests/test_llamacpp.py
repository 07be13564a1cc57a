"""The llama.cpp engine (epikv.llamacpp) on the embedded GGUF: the cache holds exactly the kept set, keep sets are
the policy's own on the captured hidden states, the capture reads the block `--layers` names, prompts tokenise as
in the torch engine, the newest token is never evicted, and what llama.cpp cannot run is refused in one line.

llama-cpp-python is required here (the README's test command installs it: scripts/install.sh --llamacpp); these
tests fail, never skip, when it is missing."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from epikv.errors import EpiKVError
from epikv.policies import DEFAULT_POLICY

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Explain step by step why the sum of two odd numbers is even, then give two examples."


@pytest.fixture(scope="module")
def gm():
    from epikv.llamacpp import available, load_gguf

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    return load_gguf("smollm2")


@pytest.fixture(scope="module")
def prompt_ids(gm):
    from epikv.engine import encode_prompts

    return encode_prompts(gm.tokenizer, [PROMPT], chat=True)[0]


def _ll():
    from epikv.llamacpp import load

    return load().ll


def _run(dec, ids, n_steps, each=None):
    """Greedy decoding by hand; `each(step, token)` before each token is fed."""
    logits = dec.prefill(ids)
    for step in range(n_steps):
        tok = int(np.argmax(logits))
        if each is not None:
            each(step, tok)
        logits = dec.step(tok)
    return logits


def _decode_seq(dec, seq: int, token: int, pos: int) -> np.ndarray:
    """One token for sequence `seq` of the decoder's context at `pos`; its logits."""
    ll, b = _ll(), dec.batch
    b.n_tokens = 1
    b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = token, pos, 1, 1
    b.seq_id[0][0] = seq
    assert ll.llama_decode(dec.ctx, b) == 0
    return np.ctypeslib.as_array(ll.llama_get_logits_ith(dec.ctx, 0), shape=(dec.n_vocab,)).copy()


# -- the cache holds exactly the kept set ---------------------------------------------------------------------------

def test_cache_holds_exactly_the_kept_set(gm, prompt_ids):
    """At evictions of a real run, sequence 1 is built from exactly the kept positions (seq_cp of each kept
    position alone, just before the engine removes the rest) and sequence 2 from one position more or fewer: after
    the eviction the engine's sequence and sequence 1 give bit-equal next-token logits, sequence 2 does not.

    Flash attention off: llama.cpp's CPU flash-attention kernel sums over cells in cell order, so the same set of
    cells laid out differently (the oracle's new token lands in a freed hole, the engine's elsewhere) differs in
    rounding; the plain kernel is order-exact here."""
    from epikv.llamacpp import LlamaDecoder

    ll = _ll()
    dec = LlamaDecoder(gm, "epikv", 80, max_tokens=len(prompt_ids) + 120, n_ctx=1024, n_seq_max=3, threads=1,
                       flash_attn=False)
    mem = dec.mem
    pending = {}

    def copy(keep_pos, seq):
        ll.llama_memory_seq_rm(mem, seq, -1, -1)
        for p in keep_pos:
            ll.llama_memory_seq_cp(mem, 0, seq, p, p + 1)

    def on_evict(d, keep):
        if d.evictions % 7 or len(pending.get("checked", [])) >= 6:
            return
        pos = d.positions
        kept = pos[keep].tolist()
        gone = sorted(set(pos.tolist()) - set(kept))
        variant = len(pending.get("checked", [])) % 2
        # one more: an evicted position kept; one fewer: the oldest kept decode token (not protected, not newest)
        other = sorted(kept + [gone[0]]) if variant == 0 else [p for p in kept if p != kept[d.n_protect]]
        copy(kept, 1)
        copy(other, 2)
        pending["now"] = (d.seen, variant)

    def each(step, tok):
        if "now" not in pending:
            return
        pos, variant = pending.pop("now")
        exact = _decode_seq(dec, 1, tok, pos)
        off = _decode_seq(dec, 2, tok, pos)
        pending["cmp"] = (exact, off, variant)

    dec.on_evict = on_evict
    logits = dec.prefill(prompt_ids)
    for step in range(110):
        tok = int(np.argmax(logits))
        each(step, tok)
        logits = dec.step(tok)
        if "cmp" in pending:
            exact, off, variant = pending.pop("cmp")
            assert np.array_equal(logits, exact), f"max |dlogit| {np.abs(logits - exact).max()}"
            assert np.abs(logits - off).max() > 1e-3, f"a copy with one position {('more', 'fewer')[variant]}"
            pending.setdefault("checked", []).append(variant)
            for s in (1, 2):
                ll.llama_memory_seq_rm(mem, s, -1, -1)
    assert sorted(set(pending["checked"])) == [0, 1] and len(pending["checked"]) >= 4
    assert dec.evictions > 20


def test_no_eviction_differs_from_the_evicted_cache(gm, prompt_ids):
    """The oracle is sensitive: the evicting run's logits differ from a run that keeps everything."""
    from epikv.llamacpp import LlamaDecoder

    toks = []
    a = LlamaDecoder(gm, "epikv", 72, max_tokens=len(prompt_ids) + 40, threads=1)
    la = _run(a, prompt_ids, 30, lambda s, t: toks.append(t))
    b = LlamaDecoder(gm, "full", None, max_tokens=len(prompt_ids) + 40, threads=1)
    lb = b.prefill(prompt_ids)
    for t in toks:
        lb = b.step(t)
    assert a.evictions > 0 and b.evictions == 0
    assert np.abs(la - lb).max() > 0.1


def test_positions_mirror_matches_the_cache(gm, prompt_ids):
    """After every eviction the mirror's positions are what llama.cpp's cache reports (seq_pos_min / max), the
    newest position is the last one fed, the prompt is kept, and new tokens continue at true positions."""
    from epikv.llamacpp import LlamaDecoder

    dec = LlamaDecoder(gm, "epikv", 72, max_tokens=len(prompt_ids) + 100, threads=1)
    seen = []

    def each(step, tok):
        pos = dec.positions
        seen.append((dec.seen, dec.stored(), dec.cache_bounds(), int(pos[0]), int(pos[-1])))

    _run(dec, prompt_ids, 90, each)
    p = len(prompt_ids)
    for n_seen, stored, (lo, hi), first, last in seen[1:]:
        assert hi == n_seen - 1 == last and lo == first == 0
        assert stored <= 72
    assert dec.positions[:p].tolist() == list(range(p))  # the prompt is protected
    assert dec.seen == p + 90 and dec.stored() == 72 and dec.evictions == p + 90 - 72
    # removing a position behind the engine's back is caught by the check against the cache
    _ll().llama_memory_seq_rm(dec.mem, 0, 0, 1)
    with pytest.raises(EpiKVError, match="disagree"):
        dec._check_mirror()


def test_newest_token_is_never_evicted(gm, prompt_ids):
    from epikv.llamacpp import LlamaDecoder

    dec = LlamaDecoder(gm, "epikv", 72, max_tokens=len(prompt_ids) + 10, threads=1)
    _run(dec, prompt_ids, 3)
    before = dec.cache_bounds()
    n = dec.stored()
    with pytest.raises(EpiKVError, match="newest token"):
        dec.remove(torch.arange(n - 1))  # every token but the newest
    assert dec.cache_bounds() == before and dec.stored() == n  # llama.cpp never saw it
    assert dec._unscored >= 2  # scoring waits inside the recent window; its tokens cannot be evicted either
    with pytest.raises(EpiKVError, match="not scored yet"):
        dec.remove(torch.tensor([i for i in range(n) if i != n - 2]))
    assert dec.cache_bounds() == before and dec.stored() == n
    with pytest.raises(EpiKVError, match="recent window"):
        LlamaDecoder(gm, "streaming", 64, max_tokens=80, recent=0)


def test_a_prompt_fed_in_chunks_scores_as_one_feed(gm, prompt_ids):
    """A prompt longer than a micro-batch is fed in pieces (each a llama_decode); its captured states and so its
    scores match one feed of the whole prompt (to rounding), and decoding continues at true positions."""
    from epikv.llamacpp import LlamaDecoder

    ids = (prompt_ids * 8)[:300]
    out = {}
    for nb in (300, 64):
        dec = LlamaDecoder(gm, "epikv", 4096, max_tokens=320, n_batch=nb, threads=1, flash_attn=False,
                           window_over="all")
        dec.prefill(ids)
        dec.step(42)
        dec.flush()
        out[nb] = dec.token_data["score"][0]
        assert dec.positions.tolist() == list(range(301)) and dec.cache_bounds() == (0, 300)
    assert torch.allclose(out[300], out[64], atol=1e-4), (out[300] - out[64]).abs().max()  # measured 1.5e-6
    assert (out[300] != 0).sum() > 250


# -- keep sets are the policy's own ---------------------------------------------------------------------------------

def test_keep_sets_equal_the_policy_fed_the_captured_states(gm, prompt_ids):
    """A 500-token run: the captured block outputs are recorded, fed afresh to the policy's on_tokens, and the
    keep set written out here (protected prompt, recent window, top scores, ties to the newer token) must equal the
    engine's at every eviction."""
    from epikv.llamacpp import LlamaDecoder

    K = 128
    dec = LlamaDecoder(gm, "epikv", K, max_tokens=len(prompt_ids) + 500, threads=1)
    feeds, keeps = recording_decoder(dec)
    _run(dec, prompt_ids, 500)
    assert len(keeps) > 400
    assert_epikv_keeps(feeds, keeps, len(prompt_ids), K, gm.depth)


def recording_decoder(dec):
    """Record a decoder's captured rows per feed and its keep sets (tokens seen, kept positions) per eviction;
    returns (feeds, keeps), filled as it runs."""
    feeds, keeps = [], []
    rows = dec.capture.rows

    def recording(n):
        r = rows(n)
        feeds.append({b: v.copy() for b, v in r.items()})
        return r

    dec.capture.rows = recording
    dec.on_evict = lambda d, keep: keeps.append((d.seen, d.positions[keep].tolist()))
    return feeds, keeps


def assert_epikv_keeps(feeds, keeps, p, K, depth, tau=1):
    """The captured block outputs fed afresh, token by token, to epikv's on_tokens, and its keep set written out
    here (protected prompt of p, recent window, top scores, ties to the newer token; evicting once the cache holds
    more than K + tau - 1) must equal every keep set the engine applied."""
    from epikv.policies import StepObservation, get_policy

    pol = get_policy("epikv")
    state = pol.init_state(1, depth, torch.device("cpu"))
    pos, score, seen, i = [], [], 0, 0
    recent = min(128, K // 4)
    for hidden in feeds:
        t = next(iter(hidden.values())).shape[0]
        for j in range(t):  # token by token, whatever chunks the engine scored in
            ps = torch.tensor([[seen]])
            obs = StepObservation(hidden={b: torch.from_numpy(v[j : j + 1])[None] for b, v in hidden.items()},
                                  attentions={}, valid=torch.ones(1, 1, dtype=torch.bool), positions=ps,
                                  in_prompt=ps < p, n_protect=torch.tensor([p]))
            score += pol.on_tokens(state, obs)["score"][0].tolist()
            pos.append(seen)
            seen += 1
        if len(pos) > K + tau - 1:
            middle = sorted(range(p, len(pos) - recent), key=lambda j: (score[j], j), reverse=True)
            kept = sorted(list(range(p)) + middle[: K - p - recent] + list(range(len(pos) - recent, len(pos))))
            assert keeps[i] == (seen, [pos[j] for j in kept]), f"eviction {i} at {seen} tokens"
            pos, score = [pos[j] for j in kept], [score[j] for j in kept]
            i += 1
    assert i == len(keeps)


# -- the capture reads the block --layers names ---------------------------------------------------------------------

def test_capture_is_the_torch_engines_block_output(gm, smollm2, prompt_ids):
    """l_out-<b> is transformers' hidden_states[b + 1], the block `--layers b` means: on the same tokens every
    token's captured state is within 10 % (relative L2; llama.cpp quantizes activations to Q8 for the Q4 weights,
    measured <= 6.3 %) of the torch engine's, and a block one off is not (>= 27 % median)."""
    from epikv.llamacpp import LlamaDecoder

    blocks = (8, 9, 10, 19, 20, 21)
    dec = LlamaDecoder(gm, "epikv-band", 4096, max_tokens=256, bands=(blocks[:3], blocks[3:]), type_kv="f32",
                       flash_attn=False, threads=1)
    got = {}
    rows = dec.capture.rows
    dec.capture.rows = lambda n: got.update({b: v.copy() for b, v in rows(n).items()}) or rows(n)
    dec.prefill(prompt_ids)
    with torch.no_grad():
        hs = smollm2.model(torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states
    for b in (9, 20):
        for off in (-1, 0, 1):
            h = hs[b + 1 + off][0].numpy()
            rel = np.linalg.norm(got[b] - h, axis=1) / np.linalg.norm(h, axis=1)
            if off == 0:
                assert rel.max() < 0.10, (b, rel.max())
            else:
                assert np.median(rel) > 0.2, (b, off, np.median(rel))


def test_default_blocks_match_the_torch_engine(gm, smollm2):
    """The policies resolve the same blocks on the GGUF as on the converted model (same depth and signature)."""
    from epikv.policies import get_policy
    from epikv.signals import model_depth

    torch_depth = model_depth(smollm2.model.config, len(smollm2.model.model.layers))
    assert gm.depth == torch_depth and gm.depth.arch == torch_depth.arch
    for name in ("epikv", "epikv-band", "epikv-a"):
        pol = get_policy(name)
        assert pol.observes(gm.depth) == pol.observes(torch_depth)


def test_same_prompt_tokens_as_the_torch_engine(gm, smollm2):
    """llama.cpp's own vocabulary and the GGUF's own template give the torch engine's prompt ids."""
    from epikv.engine import encode_prompts

    for prompt, kw in ((PROMPT, dict(chat=True)), (PROMPT, dict(chat=True, system="Be brief.")),
                       ("The café's naïve 3.14 résumé  \n\tends", dict(chat=False)), ("<|im_start|>x", dict(chat=True))):
        want = encode_prompts(smollm2.tokenizer, [prompt], **kw)[0]
        got = encode_prompts(gm.tokenizer, [prompt], **kw)[0]
        assert got == want, (prompt, kw)
    text = "Odd plus odd: 3 + 5 = 8, which is even."
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert gm.tokenizer.decode(ids) == smollm2.tokenizer.decode(ids, skip_special_tokens=True)


# -- every allowed policy runs, every other is refused ---------------------------------------------------------------

def _policy_names():
    from epikv.policies import REGISTRY

    return list(REGISTRY)


@pytest.mark.parametrize("name", _policy_names())
def test_policy_matrix(gm, prompt_ids, name):
    """As kvpress tests every press: each supported policy keeps the cache within the budget with the mirror in
    step with llama.cpp; each other policy is refused by name, with its reason, before anything runs."""
    from epikv.llamacpp import SUPPORTED, generate

    if name not in SUPPORTED:
        with pytest.raises(EpiKVError, match=rf"policy {name} is not supported by --engine llama.cpp: it (reads|keeps)"):
            generate(gm, PROMPT, policy=name, budget=72, max_new_tokens=4, chat=True)
        return
    # epikv-learned-window's default half of K does not fit beside this 49-token prompt in 72
    extra = {"recent_frac": 0.25} if name == "epikv-learned-window" else {}
    res = generate(gm, PROMPT, policy=name, budget=72, tau=2 if name == "random" else 8 if "seg" in name else None,
                   max_new_tokens=40, chat=True, threads=1, **extra)
    st = res.stats
    assert st["new_tokens"] == [40] or res.finish_reasons == ["eos"]
    if name == "full":
        assert st["evictions"] == 0 and st["final_cache_tokens"] == st["prompt_tokens"][0] + st["new_tokens"][0] - 1
    else:
        assert st["evictions"] > 0 and st["max_cache_tokens"] <= 72 + st["tau"] - 1
        assert st["kv_cells"] < 1024  # sized from the budget


def test_supported_list_is_exactly_what_check_policy_lets_through(gm):
    from epikv.llamacpp import SUPPORTED, check_policy
    from epikv.policies import get_policy

    ok = []
    for name in _policy_names():
        try:
            check_policy(get_policy(name), gm.depth)
            ok.append(name)
        except EpiKVError:
            pass
    assert sorted(ok) == sorted(SUPPORTED)
    check_policy(get_policy("epikv", reserve=16), gm.depth)  # values read on arrival (issue 39)


def test_generate_matches_the_decoder_and_streams(gm):
    from epikv.llamacpp import generate

    steps = []
    res = generate(gm, PROMPT, policy="epikv", budget=72, max_new_tokens=30, chat=True, threads=1,
                   on_step=steps.append)
    assert [s.new_token_ids[0] for s in steps] == res.token_ids[0]
    assert steps[-1].cache_tokens == res.stats["final_cache_tokens"] == 72
    assert res.stats["engine"] == "llama.cpp" and res.stats["capture"] in ("c", "python")


def test_sampling_is_the_torch_engines_sampler(gm):
    """Temperature, top-p and the seed go through epikv.engine's Sampler: a seed reproduces its tokens, another seed
    draws others, and greedy is the argmax of llama.cpp's logits."""
    from epikv.engine import Sampling
    from epikv.llamacpp import LlamaDecoder, generate

    kw = dict(policy="epikv", budget=72, max_new_tokens=24, chat=True, threads=1)
    a = generate(gm, PROMPT, sampling=Sampling(temperature=1.0, top_p=0.95, seed=1), **kw).token_ids[0]
    b = generate(gm, PROMPT, sampling=Sampling(temperature=1.0, top_p=0.95, seed=1), **kw).token_ids[0]
    c = generate(gm, PROMPT, sampling=Sampling(temperature=1.0, top_p=0.95, seed=2), **kw).token_ids[0]
    assert a == b and a != c
    greedy = generate(gm, PROMPT, **kw).token_ids[0]
    from epikv.engine import encode_prompts

    dec = LlamaDecoder(gm, "epikv", 72, max_tokens=100, threads=1, n_batch=64)
    toks = []
    _run(dec, encode_prompts(gm.tokenizer, [PROMPT], chat=True)[0], len(greedy) - 1, lambda s, t: toks.append(t))
    assert toks == greedy[: len(toks)]


# -- refusals of models and builders ---------------------------------------------------------------------------------

def test_refuses_recurrent_hybrid_and_sliding_window_models(gm):
    import dataclasses

    for kw, needle in ((dict(recurrent=True), "recurrent"), (dict(hybrid=True), "hybrid"),
                       (dict(n_swa=4096), "sliding-window")):
        fake = dataclasses.replace(gm, **kw)  # shares gm's model handle, which frees the model once
        with pytest.raises(EpiKVError, match=needle):
            fake.check_evictable()
        from epikv.llamacpp import LlamaDecoder

        with pytest.raises(EpiKVError, match=needle):
            LlamaDecoder(fake, "epikv", 72, max_tokens=64)


def test_a_builder_without_block_outputs_is_refused(gm, prompt_ids):
    """A graph with no node of the wanted name (as a builder that names no l_out) is refused, not scored from zeros."""
    from epikv.llamacpp import LlamaDecoder

    dec = LlamaDecoder(gm, "epikv", 72, max_tokens=80, threads=1)
    dec.capture.struct.names[0].value = b"l_out-nowhere"
    with pytest.raises(EpiKVError, match="does not name block outputs"):
        dec.prefill(prompt_ids)


def test_python_callback_captures_the_same_rows(gm, prompt_ids):
    from epikv.llamacpp import LlamaDecoder

    out = {}
    for method in ("c", "python"):
        dec = LlamaDecoder(gm, "epikv", 4096, max_tokens=128, capture=method, threads=1)
        assert dec.capture.method == method
        dec.prefill(prompt_ids)
        dec.step(42)
        dec.flush()
        out[method] = (dec.token_data["score"].clone(), dec.capture.asks)
        dec.close()
    assert torch.equal(out["c"][0], out["python"][0])
    assert out["c"][1] == out["python"][1] > 0


# -- tiny GGUF files made here (random weights, the embedded model's vocabulary) ------------------------------------

def _copy_tokenizer(w) -> int:
    """The embedded GGUF's tokenizer fields into writer w; returns the vocabulary size."""
    import gguf

    from epikv.llamacpp.model import gguf_path

    src = gguf.GGUFReader(str(gguf_path("smollm2")))
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            vt = field.types[0]
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1])
            else:
                w.add_key_value(key, field.contents(), vt)
    return len(src.fields["tokenizer.ggml.tokens"].contents())


def _tiny_mamba(path, n_layer=2, n_embd=32, d_state=8, d_conv=4, dt_rank=4):
    """A tiny Mamba GGUF (a recurrent model: llama.cpp keeps a state per sequence, not per token)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "mamba")
    vocab = _copy_tokenizer(w)
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(2 * n_embd)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    rng = np.random.default_rng(0)
    r = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    di = 2 * n_embd
    w.add_tensor("token_embd.weight", r(vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, x in (("attn_norm.weight", np.ones(n_embd, np.float32)), ("ssm_in.weight", r(2 * di, n_embd)),
                        ("ssm_conv1d.weight", r(di, d_conv)), ("ssm_conv1d.bias", r(di)),
                        ("ssm_x.weight", r(dt_rank + 2 * d_state, di)), ("ssm_dt.weight", r(di, dt_rank)),
                        ("ssm_dt.bias", r(di)), ("ssm_a", -np.ones((di, d_state), np.float32)),
                        ("ssm_d", np.ones(di, np.float32)), ("ssm_out.weight", r(n_embd, di))):
            w.add_tensor(p + name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_gguf(path, arch="llama", swa=0, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=0,
               head_dim=None):
    """A tiny GGUF of a llama.cpp architecture, written with the `gguf` package: `llama`, `olmo2` with a sliding
    window when swa > 0 (its builder then makes llama.cpp's sliding-window cache), or `qwen3`, whose key / value
    length (head_dim) is set explicitly and may differ from n_embd / n_head."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    vocab = _copy_tokenizer(w)
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if swa:
        w.add_sliding_window(swa)
    rng = np.random.default_rng(seed)
    r = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    one = lambda n: np.ones(n, np.float32)  # noqa: E731
    hd = head_dim or n_embd // n_head
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_tensor("token_embd.weight", r(vocab, n_embd))
    w.add_tensor("output_norm.weight", one(n_embd))
    w.add_tensor("output.weight", r(vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (n_head * hd, n_embd)), ("attn_k", (n_head_kv * hd, n_embd)),
                            ("attn_v", (n_head_kv * hd, n_embd)), ("attn_output", (n_embd, n_head * hd)),
                            ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            w.add_tensor(p + name + ".weight", r(*shape))
        norms = (("attn_q_norm", n_embd), ("attn_k_norm", n_head_kv * hd), ("post_attention_norm", n_embd),
                 ("post_ffw_norm", n_embd)) if arch == "olmo2" else (("attn_norm", n_embd), ("ffn_norm", n_embd))
        if arch == "qwen3":
            norms += (("attn_q_norm", hd), ("attn_k_norm", hd))
        for name, n in norms:
            w.add_tensor(p + name + ".weight", one(n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_tiny_gguf_runs_with_the_last_block_captured(tmp_path):
    """Any local .gguf: on a 4-block model epikv's B is block 3, the last, whose l_out llama.cpp cuts to the output
    rows unless every token is an output (the engine asks for all of them then)."""
    from epikv.llamacpp import LlamaDecoder, load_gguf

    gm = load_gguf(str(_tiny_gguf(tmp_path / "tiny.gguf")))
    dec = LlamaDecoder(gm, "epikv", 24, max_tokens=64, threads=1)
    assert dec.blocks == [1, 3] and dec.all_outputs
    _run(dec, list(range(100, 112)), 40)
    assert dec.stored() == 24 and dec.evictions == 12 + 40 - 24
    p = _cli("generate", "--engine", "llama.cpp", "--model", str(tmp_path / "tiny.gguf"), "--raw", "--prompt",
             "Hello there", "--budget", "16", "--max-new-tokens", "20", "--threads", "1", "--json", "--policy", "epikv")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["final_cache_tokens"] <= 16


def test_a_recurrent_gguf_is_refused_for_eviction(tmp_path):
    """llama.cpp says the model is recurrent (llama_model_is_recurrent): its state has absorbed every token, so
    removing positions would evict nothing; `full` still runs."""
    from epikv.llamacpp import generate, load_gguf

    path = _tiny_mamba(tmp_path / "mamba.gguf")
    gm = load_gguf(str(path))
    assert gm.recurrent
    assert generate(gm, "Hello", policy="full", budget=None, max_new_tokens=3, threads=1).stats["kv_bytes"] is None
    p = _cli("generate", "--engine", "llama.cpp", "--model", str(path), "--raw", "--prompt", "Hello there",
             "--budget", "16", "--max-new-tokens", "4")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "is a recurrent model (mamba)" in p.stderr


def test_a_sliding_window_gguf_is_refused_for_eviction(tmp_path):
    """llama.cpp reports the model's window (llama_model_n_swa) and the engine refuses to evict from that cache."""
    from epikv.llamacpp import generate, load_gguf

    path = _tiny_gguf(tmp_path / "swa.gguf", arch="olmo2", swa=16)
    gm = load_gguf(str(path))
    assert gm.n_swa == 16
    res = generate(gm, "Hello there", policy="full", budget=None, max_new_tokens=5, threads=1)
    assert res.stats["evictions"] == 0
    p = _cli("generate", "--engine", "llama.cpp", "--model", str(path), "--raw", "--prompt", "Hello there",
             "--budget", "16", "--max-new-tokens", "4")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "sliding-window attention (16 tokens)" in p.stderr


# -- the command line --------------------------------------------------------------------------------------------------

def _cli(*argv, env=None):
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "epikv.cli", *argv], capture_output=True, text=True, env=e,
                          timeout=300)


def test_cli_generate_json():
    p = _cli("generate", "--engine", "llama.cpp", "--policy", "epikv", "--budget", "72", "--max-new-tokens", "40",
             "--threads", "1", "--prompt", PROMPT, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["engine"] == "llama.cpp" and out["policy"] == "epikv" and out["budget"] == 72
    assert out["flash_attn"] == "auto"
    assert out["final_cache_tokens"] <= 72 and out["evictions"] > 0 and out["new_tokens"] >= 1
    assert out["layers"].startswith("blocks 9, 20")


def test_cli_flash_attn_reaches_llama_cpp():
    """--flash-attn off is the context's setting (mutant: the engine not passing it on leaves "auto"); the default
    policy runs in llama.cpp."""
    p = _cli("generate", "--engine", "llama.cpp", "--flash-attn", "off", "--budget", "72", "--max-new-tokens", "4",
             "--threads", "1", "--prompt", PROMPT, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["flash_attn"] == "off" and out["policy"] == DEFAULT_POLICY


@pytest.mark.parametrize("argv, needle", [
    (["--policy", "h2o"], "policy h2o is not supported by --engine llama.cpp: it reads attention weights"),
    (["--policy", "snapkv"], "policy snapkv is not supported by --engine llama.cpp"),
    (["--model", "/nowhere/x.gguf"], "does not exist"),
    (["--model", str(ROOT / "README.md")], "not a GGUF file"),
    (["--dtype", "bfloat16"], "--dtype: torch engine options"),
    (["--recent", "0"], "recent window must be >= 1"),
    (["--policy", "epikv-seg-q", "--layers", "9,30"], "out of range"),
])
def test_cli_refusals_exit_2_in_one_line(argv, needle):
    p = _cli("generate", "--engine", "llama.cpp", "--prompt", "hi", "--max-new-tokens", "2", *argv)
    assert p.returncode == 2, p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


def test_without_llama_cpp_the_engine_says_so_and_the_rest_works(tmp_path):
    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libllama.so: cannot open shared object file')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}"}
    p = _cli("generate", "--engine", "llama.cpp", "--prompt", "hi", env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "needs llama-cpp-python" in p.stderr and "install.sh --llamacpp" in p.stderr
    p = _cli("generate", "--model", "random:tiny", "--raw", "--prompt", "hi", "--max-new-tokens", "3", "--json",
             "--threads", "1", env=env)
    assert p.returncode == 0 and json.loads(p.stdout)["engine"] == "torch"


def test_extra_buffer_types_switch(monkeypatch):
    """EPIKV_LLAMA_EXTRA_BUFTS=0 loads the model without llama.cpp's extra weight buffer types (AMX / repacked
    weights, whose AMX kernels crash on batches where AMX tiles are not granted); unset, llama.cpp's default; a bad
    value is refused in one line. The model loaded without them decodes a batch as before."""
    from epikv.errors import EpiKVError
    from epikv.llamacpp import lib, load_gguf
    from epikv.llamacpp.engine import LlamaDecoder

    ll = lib.load().ll
    seen = []
    real = ll.llama_model_load_from_file

    def spy(path, mp):
        seen.append(bool(mp.use_extra_bufts))
        return real(path, mp)

    monkeypatch.setattr(ll, "llama_model_load_from_file", spy)
    monkeypatch.delenv("EPIKV_LLAMA_EXTRA_BUFTS", raising=False)
    load_gguf("smollm2").close()
    monkeypatch.setenv("EPIKV_LLAMA_EXTRA_BUFTS", "0")
    gm = load_gguf("smollm2")
    assert seen == [True, False]
    dec = LlamaDecoder(gm, max_tokens=32, policy="full", budget=None, threads=1)
    lg = dec.prefill([1, 2, 3, 4, 5, 6, 7, 8])
    assert lg.shape == (gm.tokenizer.n_vocab,) and np.isfinite(lg).all()
    dec.close()
    gm.close()
    monkeypatch.setenv("EPIKV_LLAMA_EXTRA_BUFTS", "maybe")
    with pytest.raises(EpiKVError, match="EPIKV_LLAMA_EXTRA_BUFTS must be 0 or 1"):
        load_gguf("smollm2")
