"""The stop-string rule (epikv.stops), on a character-per-token decoder with one multi-character token."""

from epikv.stops import StopStream, cut_at_stop, ids_within

VOCAB = {0: "a", 1: "b", 2: "3", 3: "x3", 4: "c", 5: ""}  # 3 straddles a stop "3"; 5 decodes to nothing (EOS)


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def test_text_and_ids_end_before_the_stop():
    assert cut_at_stop(decode, [0, 1, 2, 4, 0], ["3"]) == ("ab", [0, 1], True)
    assert cut_at_stop(decode, [0, 1, 4], ["3"]) == ("abc", [0, 1, 4], False)
    # the earliest of several stops wins; a token straddling the stop's start keeps its text, not its id
    assert cut_at_stop(decode, [0, 3, 4], ["c", "3"]) == ("ax", [0], True)


def test_a_stream_holds_back_what_may_begin_a_stop():
    st = StopStream(decode, ["bc"])
    assert st.step([0], False) == "a"
    assert st.step([0, 1], False) == ""  # "b" may begin "bc"
    assert st.ids([0, 1]) == [0]
    assert st.step([0, 1, 2], False) == "b3"  # it did not
    assert st.step([0, 1, 2, 1, 4, 0], False) == "" and st.stopped and st.sent == "ab3"
    assert st.ids([0, 1, 2, 1, 4, 0]) == [0, 1, 2]
    st = StopStream(decode, ["bc"])
    assert st.step([0, 1], True) == "ab"  # the end releases what was held
    assert st.ids([0, 1, 5]) == [0, 1, 5]


def _stream_all(decode_fn, ids, stops=()):
    """Feed a StopStream every prefix of ids, as a server streams them: each step's text must equal the whole
    decode's, the released deltas must add up to the final text, and the ids of the released text must be those
    found by whole decodes. -> the stream (its decoded_tokens: what the steps and ids() decoded)."""
    st = StopStream(decode_fn, list(stops))
    out = []
    for n in range(1, len(ids) + 1):
        spent = st.decoded_tokens
        assert st.text(ids[:n]) == decode_fn(ids[:n]), n
        st.decoded_tokens = spent  # count the steps' decoding only
        st2_delta = st.step(ids[:n], n == len(ids))
        out.append(st2_delta)
        spent = st.decoded_tokens
        ref = ids_within(decode_fn, ids[:n], len(st.sent))  # the ids of the released text, by whole decodes
        st.decoded_tokens = spent
        assert st.ids(ids[:n]) == ids[:ref], n
        if st.stopped:
            break
    assert "".join(out) == st.sent
    return st


def test_incremental_text_equals_the_whole_decode_and_costs_linear_time():
    """A long answer is decoded in linear time (tokens passed to decode grow with the answer, not its square),
    and every step's text equals decoding the whole list: a real byte-level BPE tokenizer (SmolLM2's) on text with
    multi-byte characters split across tokens, a SentencePiece-like decoder that drops the leading space of a
    decode's first word, and a byte decoder whose characters straddle tokens."""
    import random

    from transformers import AutoTokenizer

    from epikv.models import smollm2_folder

    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    words = ["Let", "me", "think", "step", "by", "step:", "17", "×", "23", "=", "391.", "Größe", "日本語", "🙂🙂",
             "naïve", "\n\n", "So", "the", "answer", "is", "\\boxed{391}", "…", "wait,", "résumé"]
    r = random.Random(0)
    text = " ".join(r.choice(words) for _ in range(700))
    text = text[:3000] + " so the answer is \\boxed{391} … and " + text[3000:]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1500
    hf = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    st = _stream_all(hf, ids)
    assert st.sent == hf(ids) and st.decoded_tokens <= 48 * len(ids), st.decoded_tokens
    # with a stop string late in the answer: cut where the whole text says
    stop = "answer is \\boxed{391} …"
    st = _stream_all(hf, ids, [stop])
    assert st.stopped and st.sent == hf(ids)[:hf(ids).index(stop)] and st.decoded_tokens <= 48 * len(ids)

    pieces = ["▁the", "▁answer", "▁is", "▁391", ".", "▁so", "▁wait", ",", "▁hmm"]

    def sp(x):  # SentencePiece-like: "▁" is a space, dropped at the start of a decode
        return "".join(pieces[i] for i in x).replace("▁", " ").lstrip(" ")

    sp_ids = [r.randrange(len(pieces)) for _ in range(400)]
    assert _stream_all(sp, sp_ids).sent == sp(sp_ids)

    raw = "".join(r.choice(["a", "é", "日", "🙂", " "]) for _ in range(300)).encode()

    def by(x):  # one byte a token: characters straddle tokens (U+FFFD until whole)
        return bytes(x).decode("utf-8", "replace")

    st = _stream_all(by, list(raw))
    assert st.sent == raw.decode() and "\ufffd" not in st.sent
