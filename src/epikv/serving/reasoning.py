"""Reasoning parsers: an answer's thinking part returned apart, as `reasoning_content` (DeepSeek's and vLLM's API
convention for R1-style models), in whole chat responses and in streamed deltas.

`deepseek-r1`: the text up to `</think>` is reasoning, the rest (leading whitespace dropped) is the answer. An
opening `<think>` at the start is dropped; R1 distills' chat templates end the prompt with it, so their output
usually starts inside the thinking part. Until `</think>` comes, everything is reasoning (an answer cut by
max_tokens mid-thought has no content).
"""

from __future__ import annotations

PARSERS = ("deepseek-r1",)


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that starts `tag` (a tag possibly split across chunks)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ReasoningSplit:
    """Split a growing answer text into (reasoning, content); `step` gives the new part of each, holding back a
    tail that could still become a tag, so a tag split across two chunks never leaks into either part."""

    START, END = "<think>", "</think>"

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if text.startswith(self.START):
            text = text[len(self.START):]
        elif not final and self.START.startswith(text):  # "<thi": could be the opening tag
            return "", ""
        i = text.find(self.END)
        if i >= 0:
            return text[:i], text[i + len(self.END):].lstrip()
        if not final:
            text = text[:len(text) - _partial(text, self.END)]
        return text, ""

    def step(self, text: str, final: bool) -> tuple[str, str]:
        """text: the answer so far (growing) -> (new reasoning, new content)."""
        r, c = self.split(text, final)
        dr, dc = r[len(self.reasoning):], c[len(self.content):]
        if r.startswith(self.reasoning):
            self.reasoning = r
        else:  # cannot happen for growing text; never send the same characters twice
            dr = ""
        if c.startswith(self.content):
            self.content = c
        else:
            dc = ""
        return dr, dc
