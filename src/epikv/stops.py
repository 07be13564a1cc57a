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
    and cutting at a stop string (then `stopped`). `sent` is the text released so far."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.sent = ""
        self.stopped = False

    def step(self, ids: list[int], final: bool) -> str:
        text = self.decode(ids)
        cut = stop_index(text, self.stops)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
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
        return delta

    def ids(self, ids: list[int]) -> list[int]:
        """The prefix of `ids` whose text is what was released (the token ids that go with `sent`)."""
        return list(ids[:ids_within(self.decode, ids, len(self.sent))])
