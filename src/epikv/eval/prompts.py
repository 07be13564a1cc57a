"""Prompt construction per protocol (token ids, with the model's chat template).

- paper: system prompt with the instruction, greedy, one sample.
- r1: no system prompt, the instruction in the user turn, the response forced to start with "<think>\\n",
  temperature 0.6, top-p 0.95, n samples (pass@1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EpiKVError

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Protocol:
    name: str
    temperature: float
    top_p: float
    system: str | None
    think_prefix: str


PROTOCOLS = {
    "paper": Protocol("paper", 0.0, 1.0, INSTRUCTION, ""),
    "r1": Protocol("r1", 0.6, 0.95, None, "<think>\n"),
}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise EpiKVError(f"unknown protocol {name!r}; known: {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def build_prompt(tokenizer, problem: str, protocol: Protocol) -> list[int]:
    """Token ids of one problem's prompt under `protocol` (the generation prompt of the chat template included)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise EpiKVError("the evaluation protocols need a model with a chat template")
    if protocol.system is not None:
        msgs = [{"role": "system", "content": protocol.system}, {"role": "user", "content": problem}]
    else:
        msgs = [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if protocol.think_prefix and not text.rstrip().endswith("<think>"):
        text += protocol.think_prefix
    # The template already holds the BOS token where the model wants one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
