"""The stop-string rule, one for the library (`epikv.generate`), `epikv generate --stop` and `epikv serve`'s "stop".

As in the OpenAI API: a sequence ends at the first token whose text completes a stop string, and the answer ends just
before the stop string (the stop string and whatever follows are not returned). Token ids are cut at the same place:
the ids returned are the tokens whose text lies wholly before the stop string (a token that straddles its start
gives its leading characters to the text, not its id to the ids). Streams hold back any tail that may begin a stop
string, so a streamed answer never shows a stop string either."""

from __future__ import annotations

from typing import Callable, Sequence


def stop_index(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string starts in `text`; -1 when none occurs."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found, default=-1)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of a growing `text` may be the start of a stop string (a stream keeps them)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def ids_within(decode: Callable[[list[int]], str], ids: list[int], n_chars: int) -> int:
    """The largest k whose ids[:k] decode to at most n_chars characters (binary search: decoded length grows
    with k)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(decode(ids[:mid])) <= n_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cut_at_stop(decode: Callable[[list[int]], str], ids: list[int],
                stops: Sequence[str]) -> tuple[str, list[int], bool]:
    """(text, ids, stopped) of a finished sequence under the rule above."""
    text = decode(ids)
    i = stop_index(text, stops)
    if i < 0:
        return text, list(ids), False
    return text[:i], list(ids[:ids_within(decode, ids, i)]), True


class StopStream:
    """The text of a growing token list, released as it becomes final: `step(ids, final)` returns the new text,
    holding back a trailing partial UTF-8 character (decoded as U+FFFD) and any tail that may begin a stop string,
    and cutting at a stop string (then `stopped`). `sent` is the text released so far.

    Decoding is incremental, so a long answer costs linear time, not quadratic: the text of ids[:anchor] is kept,
    and each step decodes only ids[anchor - CONTEXT:], dropping the text of its first CONTEXT tokens (the context
    lets a tokenizer that strips a leading space at the start of a decode, or joins bytes across tokens, decode the
    tail as it would inside the whole). Where that does not reproduce the whole decode's text (the tail's decode
    does not begin with the context's), the whole list is decoded instead."""

    CONTEXT = 6  # tokens decoded before the anchor
    ADVANCE = 32  # the anchor moves when this many tokens lie past it, keeping CONTEXT of them undecided

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self._longest = max((len(x) for x in self.stops), default=0)
        self.sent = ""
        self.stopped = False
        self._anchor = 0  # ids[:anchor] decode to self._fixed (ids[anchor - CONTEXT:anchor] are kept to check it)
        self._fixed = ""
        self._ctx: list[int] = []
        self.decoded_tokens = 0  # tokens passed to decode, in all (linear in the answer's length)
        self._released: tuple[int, bool] = (-1, False)  # (len(ids) of the last step, all its text released)

    def _decode(self, ids: list[int]) -> str:
        self.decoded_tokens += len(ids)
        return self.decode(ids)

    def text(self, ids: list[int]) -> str:
        """decode(ids), from the kept text of ids[:anchor] and a decode of the tail."""
        a, c = self._anchor, self.CONTEXT
        if a and (len(ids) < a or list(ids[max(0, a - c):a]) != self._ctx):  # not a continuation: start over
            a = self._anchor = 0
            self._fixed, self._ctx = "", []
        lo = max(0, a - c)
        head = self._decode(list(ids[lo:a])) if a else ""
        tail = self._decode(list(ids[lo:]))
        if not tail.startswith(head):
            self._anchor, self._fixed, self._ctx = 0, "", []
            return self._decode(list(ids))
        text = self._fixed + tail[len(head):]
        if len(ids) - a >= self.ADVANCE + c:
            na = len(ids) - c
            upto = self._decode(list(ids[lo:na]))
            if upto.startswith(head) and not upto.endswith("\ufffd") and tail.startswith(upto):
                self._anchor, self._fixed = na, self._fixed + upto[len(head):]
                self._ctx = list(ids[max(0, na - c):na])
        return text

    def step(self, ids: list[int], final: bool) -> str:
        text = self.text(ids)
        whole = len(text)
        start = max(0, len(self.sent) - self._longest + 1)  # the sent text held no stop, nor the start of one
        cut = stop_index(text[start:], self.stops)
        if cut >= 0:
            text, final, self.stopped = text[:start + cut], True, True
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - held_back(text, self.stops)]
        if not text.startswith(self.sent):  # a re-tokenisation changed earlier text: send only what follows
            common = 0
            while common < min(len(text), len(self.sent)) and text[common] == self.sent[common]:
                common += 1
            text = self.sent + text[common:] if common == len(self.sent) else self.sent
        delta = text[len(self.sent):]
        self.sent = text
        self._released = (len(ids), len(text) == whole and not self.stopped)
        return delta

    def ids(self, ids: list[int]) -> list[int]:
        """The prefix of `ids` whose text is what was released (the token ids that go with `sent`)."""
        if self._released == (len(ids), True):  # the last step released all its text
            return list(ids)
        n = len(self.sent)
        a, c = self._anchor, self.CONTEXT
        if a and len(ids) >= a and list(ids[max(0, a - c):a]) == self._ctx and len(self._fixed) <= n:
            lo = max(0, a - c)  # ids[:a] decode to the kept text, within what was released: search past a
            head = len(self._decode(list(ids[lo:a])))
            k, hi = a, len(ids)
            while k < hi:
                mid = (k + hi + 1) // 2
                if len(self._fixed) + len(self._decode(list(ids[lo:mid]))) - head <= n:
                    k = mid
                else:
                    hi = mid - 1
            return list(ids[:k])
        return list(ids[:ids_within(self._decode, ids, n)])
