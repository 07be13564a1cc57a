"""The stop-string rule (epikv.stops), on a character-per-token decoder with one multi-character token."""

from epikv.stops import StopStream, cut_at_stop

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
