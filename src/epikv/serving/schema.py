"""The request and response contract of `epikv serve` (pydantic), published at /openapi.json.

Every field a request may send is declared here with its type and range; any other field is refused by name (a
silently ignored option would be a wrong answer). Requests are validated strictly (no "5" for 5, no true for 1, no
NaN), so what the schema says is what the server accepts. What depends on the served model (the model's name, the
vocabulary's size, the cache's capacity, which sampling settings the engine honours) is checked after validation by
`app.parse_request`, whose 400s name their field the same way.

Extras beyond OpenAI's fields: `ignore_eos` (request), `token_ids` (every choice and chunk: the ids of the text
sent), `reasoning_content` (chat, with --reasoning-parser: the thinking part).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

PosInt = Annotated[int, Field(ge=1)]
Finite = dict(allow_inf_nan=False)
# Bounds on what one request may hold, so that no field can grow without limit whatever --max-request-bytes
# allows: a prompt's characters or token ids (far beyond any model's positions), messages, text parts, short strings
MAX_CHARS = 2**22
MAX_IDS = 2**20
MAX_MESSAGES = 2**14
MAX_PARTS = 2**10
MAX_SHORT = 1024  # model, user, a stop string


def _exactly(*values):
    """Literal[*values] that also keeps JSON's types apart: Python's True == 1 and 0 == False, so a Literal alone
    takes `n: true` or `echo: 0`; the contract (/openapi.json's const / enum) does not."""

    def check(v):
        if not any(type(v) is type(x) and v == x for x in values):
            raise ValueError("not one of the allowed values")
        return v

    return Annotated[Literal[values], BeforeValidator(check)]


ShortStr = Annotated[str, Field(max_length=MAX_SHORT)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = Field(None, description="send a last chunk with the usage (no choices)")


class TextPart(_Strict):
    """An OpenAI content part; this text-only server takes text parts only."""

    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_CHARS)]


class Message(BaseModel):
    # other keys of a message (name, tool_calls: null, ...) are left unread, as the server always did
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_CHARS)] | Annotated[
        list[TextPart], Field(min_length=1, max_length=MAX_PARTS)] = Field(
        description="the text, or a non-empty list of text parts (joined with newlines)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        # a part of another kind is refused by name before the union's generic message
        if isinstance(v, list):
            if not v:
                raise PydanticCustomError("epikv", "content is an empty list of parts")
            for j, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    what = (f"part type {kind!r}" if isinstance(kind, str)
                            else "a part that is not {type: text, text: <text>}")
                    raise PydanticCustomError("epikv", "content[{j}]: {what} is not supported by this text-only "
                                              "server (only text parts)", {"j": j, "what": what})
                if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                    raise PydanticCustomError("epikv", "content[{j}] must be {form}",
                                              {"j": j, "form": "{type: text, text: <text>}"})
        return v


class _Common(_Strict):
    """Fields of both endpoints. Greedy when temperature is 0 or left out, whatever top_p / top_k / min_p / seed."""

    model: ShortStr | None = Field(None, description="the served model's name (GET /v1/models); left out: that one")
    max_tokens: PosInt | None = Field(None, description="new tokens at most (default: the server's --max-tokens)")
    stream: bool = Field(False, description="answer as server-sent events, one chunk per new text")
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, **Finite)] | None = Field(None, description="0 or left out: greedy")
    top_p: Annotated[float, Field(gt=0, le=1, **Finite)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="-1 or 0: off")
    min_p: Annotated[float, Field(ge=0, le=1, **Finite)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = Field(
        None, description="the sampled answer's seed (the same seed, the same answer, whatever its batch-mates)")
    n: _exactly(1) | None = Field(None, description="one answer per request")
    user: ShortStr | None = None
    ignore_eos: bool = Field(False, description="extra: generate max_tokens tokens whatever the end-of-sequence "
                                                "tokens (needs an engine with a per-request EOS)")
    frequency_penalty: Annotated[float, Field(ge=0, le=0, **Finite)] | None = Field(None, description="0 only")
    presence_penalty: Annotated[float, Field(ge=0, le=0, **Finite)] | None = Field(None, description="0 only")
    stop: Annotated[str, Field(min_length=1, max_length=MAX_SHORT)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_SHORT)]], Field(max_length=4)] | None = Field(
        None, description="a string, or up to 4, at which the answer ends (not included)")


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_IDS)]


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Annotated[str, Field(min_length=1, max_length=MAX_CHARS)] | TokenIds | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_CHARS)] | TokenIds],
        Field(min_length=1, max_length=1)] = Field(
        description="a non-empty string, a non-empty list of token ids (each below the vocabulary's size), or a list "
                    "of one of these (one prompt per request)")
    echo: _exactly(False) | None = Field(None, description="false only")
    logprobs: _exactly(False, 0) | None = Field(None, description="not supported: 0 or left out")
    best_of: _exactly(1) | None = None
    suffix: None = Field(None, description="not supported: left out")


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions (the model's chat template builds the prompt)."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PosInt | None = Field(None, description="as max_tokens (max_tokens wins when both)")
    logprobs: _exactly(False, 0) | None = Field(None, description="not supported: false or left out")
    top_logprobs: _exactly(0) | None = Field(None, description="not supported: 0 or left out")


# what each field must be, in the 400 that refuses it
WANT = {"model": f"a string of at most {MAX_SHORT} characters", "max_tokens": "an integer >= 1",
        "max_completion_tokens": "an integer >= 1",
        "stream": "true or false", "ignore_eos": "true or false", "stream_options": "{include_usage: true|false}",
        "temperature": "a number >= 0", "top_p": "a number in (0, 1]",
        "top_k": "an integer >= -1 (-1 or 0: off)", "min_p": "a number in [0, 1]",
        "seed": "an integer in [0, 2^63)", "n": "1 (one answer per request)",
        "user": f"a string of at most {MAX_SHORT} characters",
        "frequency_penalty": "0 (penalties are not supported by this server)",
        "presence_penalty": "0 (penalties are not supported by this server)",
        "stop": f"a non-empty string of at most {MAX_SHORT} characters or a list of at most 4 of them",
        "prompt": f"a non-empty string (at most {MAX_CHARS} characters), a non-empty list of token ids >= 0 (at most "
                  f"{MAX_IDS}), or a list of one of these (one prompt per request)",
        "echo": "false (echo is not supported by this server)", "logprobs": "0 or false (not supported)",
        "top_logprobs": "0 (not supported)", "best_of": "1", "suffix": "left out (not supported by this server)",
        "messages": f"a non-empty list of at most {MAX_MESSAGES} {{role: system|user|assistant, content: <text or "
                    "text parts>}"}


class Refused(ValueError):
    """A body the contract refuses: `message` (one line) and the field it names (`param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def refusal(errors: list[dict]) -> Refused:
    """The 400 for pydantic's errors of a request body (locations relative to the body): the first error, naming its
    field; unsupported fields all named."""
    extra = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1)
    if extra:
        return Refused(f"unsupported field(s): {', '.join(extra)}", extra[0])
    e = errors[0]
    loc = e["loc"]
    if not loc:
        return Refused("the request body must be a JSON object")
    name = str(loc[0])
    if e["type"] == "missing" and len(loc) == 1:
        return Refused(f"{name} is required: {WANT.get(name, '')}".rstrip(": "), name)
    if name == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        i = loc[1]
        if e["type"] == "epikv":
            return Refused(f"messages[{i}].{e['msg']}", "messages")
        if len(loc) > 2 and loc[2] == "content":
            return Refused(f"messages[{i}].content must be a string of at most {MAX_CHARS} characters or a list of "
                           f"1 to {MAX_PARTS} text parts", "messages")
        return Refused(f"messages[{i}] must be {{role: system|user|assistant, content: <text>}}", "messages")
    if name == "stream_options" and len(loc) > 1 and e["type"] == "extra_forbidden":
        return Refused(f"stream_options.{loc[1]} is not supported (only include_usage)", "stream_options")
    return Refused(f"{name} must be {WANT.get(name, 'as /openapi.json says')}, got {_as_json(e.get('input'))}"[:300],
                   name)


def _as_json(value) -> str:
    """A refused value as the client wrote it (JSON's true, null, "text"), cut short."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return "a value nested too deeply"
    return text if len(text) <= 80 else text[:77] + "..."


def validate(body, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """The body as its request model, or Refused (one line, naming the field)."""
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    cls = ChatCompletionRequest if chat else CompletionRequest
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise refusal(e.errors(include_url=False)) from None


# ---------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None
    token_ids: list[int] = Field(description="extra: the ids of the text (cut with it at a stop string; no final EOS)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="extra (--reasoning-parser): the thinking part; the "
                                                              "key is absent without a parser")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: None = None
    token_ids: list[int]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None
    token_ids: list[int]


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (`data: <json>`; the stream ends with `data: [DONE]`; the last
    chunk before it has `usage` and no choices when stream_options.include_usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: None = None
    token_ids: list[int]


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (as CompletionChunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorBody(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error or timeout")
    param: str | None = Field(description="the refused field, where one is to blame")
    code: str | None = Field(None, description="invalid_api_key (401), else null")


class ErrorResponse(BaseModel):
    """Every error (400, 401, 404, 405, 413, 429, 503, 504, 500); a streamed request that fails after its first chunk
    gets this object as its last event instead, then `data: [DONE]`."""

    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


STREAM_CHUNKS = (CompletionChunk, ChatCompletionChunk)
