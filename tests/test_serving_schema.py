"""The OpenAPI contract of `epikv serve` (serving/schema.py): /openapi.json holds the request models exactly as
pydantic writes them, with every field, type and range; a value outside a field's range is refused with a 400 that
names the field; whole answers and streamed chunks validate against the response models. On the scripted engine of
test_serving_app (the contract is the app's, whatever the engine)."""

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from epikv.serving import schema  # noqa: E402
from test_serving_app import MSGS, Scripted  # noqa: E402

REF = "#/components/schemas/{model}"


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny.tokenizer


@pytest.fixture(scope="module")
def app(tok):
    from test_serving_app import App

    a = App(Scripted(tok, eos=tok.eos_token_id), tok)
    yield a
    a.close()


def _post(app, path, body):
    req = urllib.request.Request(app.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_openapi_holds_the_request_models(app):
    doc = json.loads(app.get("/openapi.json"))
    comp = doc["components"]["schemas"]
    for cls in (schema.CompletionRequest, schema.ChatCompletionRequest, schema.CompletionResponse,
                schema.ChatCompletionResponse, schema.CompletionChunk, schema.ChatCompletionChunk,
                schema.ErrorResponse):
        mode = "validation" if cls.__name__.endswith("Request") else "serialization"
        want = cls.model_json_schema(ref_template=REF, mode=mode)
        for name, sub in want.pop("$defs", {}).items():
            assert comp[name] == sub, name
        got = json.loads(json.dumps(comp[cls.__name__]))
        if mode == "validation":  # what this server adds: its one model name, token ids below its vocabulary
            assert got["properties"]["model"].pop("anyOf") == [{"type": "string", "enum": ["scripted"]},
                                                               {"type": "null"}]
            del want["properties"]["model"]["anyOf"]
            if "prompt" in got["properties"]:
                ids = got["properties"]["prompt"]["anyOf"][1]["items"]
                assert ids.pop("maximum") == len(app.server.tokenizer) - 1
                got["properties"]["prompt"]["anyOf"][2]["items"]["anyOf"][1]["items"].pop("maximum")
        assert got == want, cls.__name__
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": REF.format(model=name)}
        assert {"200", "400", "429", "503", "504"} <= set(post["responses"])
    # every accepted field is listed, the extras included, with its range
    comp_fields = set(comp["CompletionRequest"]["properties"])
    assert comp_fields == set(schema.CompletionRequest.model_fields)
    assert {"ignore_eos", "prompt", "max_tokens", "stop", "seed"} <= comp_fields
    assert {"messages", "max_completion_tokens", "ignore_eos"} <= set(comp["ChatCompletionRequest"]["properties"])
    assert "token_ids" in comp["CompletionChoice"]["properties"] and "token_ids" in comp["ChatChunkChoice"]["properties"]
    assert "reasoning_content" in comp["ChatMessage"]["properties"]
    assert "reasoning_content" in comp["ChatDelta"]["properties"]
    props = comp["CompletionRequest"]["properties"]

    def rng(name):
        return [s for s in props[name]["anyOf"] if s.get("type") != "null"][0]

    assert rng("max_tokens") == {"type": "integer", "minimum": 1}
    assert rng("top_p") == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert rng("temperature") == {"type": "number", "minimum": 0}
    assert rng("top_k") == {"type": "integer", "minimum": -1}
    assert rng("seed") == {"type": "integer", "minimum": 0, "exclusiveMaximum": 2**63}
    assert comp["CompletionRequest"]["additionalProperties"] is False
    assert set(comp["CompletionRequest"]["required"]) == {"prompt"}
    assert set(comp["ChatCompletionRequest"]["required"]) == {"messages"}


# one value outside each field's range (or of the wrong type): refused by a 400 whose param names the field
BAD = {"model": 5, "max_tokens": 0, "stream": "yes", "stream_options": {"include_usage": 1}, "temperature": -0.5,
       "top_p": 0, "top_k": -2, "min_p": 1.5, "seed": 2**63, "n": 2, "user": 7, "ignore_eos": 1,
       "frequency_penalty": 0.5, "presence_penalty": -1, "stop": ["a", "b", "c", "d", "e"], "prompt": [],
       "echo": True, "logprobs": 3, "best_of": 2, "suffix": "x", "messages": [{"role": "tool", "content": "x"}],
       "max_completion_tokens": -1, "top_logprobs": 2}
BAD_TYPE = {"max_tokens": True, "temperature": "0.5", "seed": 1.0, "top_k": 1.5, "prompt": [1, "a"],
            "stop": ["", "b"], "messages": "hi"}


@pytest.mark.parametrize("chat", [False, True])
def test_every_field_refused_out_of_range_by_name(app, chat):
    cls = schema.ChatCompletionRequest if chat else schema.CompletionRequest
    base = {"messages": MSGS} if chat else {"prompt": "x"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    assert set(cls.model_fields) <= set(BAD)  # a new field gets its out-of-range value here
    for table in (BAD, BAD_TYPE):
        for name, v in table.items():
            if name not in cls.model_fields:
                continue
            status, text = _post(app, path, {**base, name: v, "max_tokens": 4} if name != "max_tokens"
                                 else {**base, name: v})
            err = json.loads(text)["error"]
            assert status == 400 and err["param"] == name and name in err["message"], (name, v, text)
            assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
    status, text = _post(app, path, {**base, "logit_bias": {}, "tools": []})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "logit_bias" and "logit_bias, tools" in err["message"]
    del base["messages" if chat else "prompt"]
    status, text = _post(app, path, base)
    want = "messages" if chat else "prompt"
    assert status == 400 and json.loads(text)["error"]["param"] == want and "required" in text
    assert _post(app, path, [1, 2])[0] == 400


def test_answers_validate_against_the_response_models(app):
    r = _post(app, "/v1/completions", {"prompt": "x", "max_tokens": 5})
    schema.CompletionResponse.model_validate_json(r[1])
    r = _post(app, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 5})
    schema.ChatCompletionResponse.model_validate_json(r[1])
    for path, body, cls in (("/v1/completions", {"prompt": "x"}, schema.CompletionChunk),
                            ("/v1/chat/completions", {"messages": MSGS}, schema.ChatCompletionChunk)):
        status, raw = _post(app, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [e[len("data: "):] for e in raw.split("\n\n") if e.strip()]
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [cls.model_validate_json(e) for e in events[:-1]]
        assert chunks[-1].usage is not None and not chunks[-1].choices
    schema.ModelList.model_validate_json(app.get("/v1/models"))
    schema.Health.model_validate_json(app.get("/health"))
    status, text = _post(app, "/v1/completions", {"prompt": "x", "n": 3})
    schema.ErrorResponse.model_validate_json(text)
