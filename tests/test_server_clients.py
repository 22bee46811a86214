"""Real clients, unchanged, against one real `ikcli server` on the embedded demo model (4 slots):

- the anthropic SDK: messages, streaming, count_tokens and a tool round trip (tool_use ->
  tool_result), each checked against the server's own OpenAI endpoint for the same conversation;
- load: eight different kinds of request (json_schema, tool_choice "required", logprobs, a GBNF
  grammar, n_probs, banned strings, an Anthropic stream, a plain stream) sent at once to 4 slots,
  so continuous batching mixes grammars, tools and logprobs in one batch: each answers what it
  answers alone (text and tokens identical, log-probabilities within float rounding), and the
  constrained ones parse and validate.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from conftest import launch_server, stop_server

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
from test_server import _serving_available  # noqa: E402

from engine import grammar as G  # noqa: E402

pytestmark = [pytest.mark.skipif(bool(_serving_available()), reason=_serving_available() or "n/a"),
              pytest.mark.skipif(not G.available(), reason="llguidance is not installed")]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    # a server-wide seed: llama-server passes no seed through /v1/messages, so an Anthropic request
    # samples reproducibly only with the server's own
    s = launch_server("-c", "4096", "-np", "4", "-t", "2", "--seed", "3", timeout=90)
    yield s
    rc = stop_server(s)
    assert rc == 0, "".join(s.err[-20:])


# the SDK (2.x) has no sampling arguments of its own any more: they go in the body as extra fields
GREEDY = {"temperature": 0}      # (and llama-server passes only temperature / top_p / top_k on)


def anthropic_client(base: str):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=base, api_key="sk-none", max_retries=0, timeout=120)


def oai_chat(base: str, body: dict) -> dict:
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_anthropic_sdk_messages_stream_and_count(server):
    client = anthropic_client(server.base)
    msgs = [{"role": "user", "content": "Say hi"}]
    msg = client.messages.create(model="demo", max_tokens=12, system="Go.", messages=msgs, extra_body=GREEDY)
    oai = oai_chat(server.base, {"messages": [{"role": "system", "content": "Go."}, *msgs],
                                 "max_tokens": 12, "temperature": 0})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == oai["choices"][0]["message"]["content"]
    assert msg.stop_reason in ("end_turn", "max_tokens") and 0 < msg.usage.output_tokens <= 12
    with client.messages.stream(model="demo", max_tokens=12, system="Go.", messages=msgs, extra_body=GREEDY) as st:
        streamed = "".join(st.text_stream)
        final = st.get_final_message()
    assert streamed == msg.content[0].text == final.content[0].text
    assert final.usage.output_tokens == msg.usage.output_tokens
    n = client.messages.count_tokens(model="demo", system="Go.", messages=msgs).input_tokens
    assert n == oai["usage"]["prompt_tokens"]


def test_anthropic_sdk_tool_round_trip(server):
    """tool_choice any: the model must call, the same call streamed or not (temperature 1 and the
    server's seed: greedy, a random model's JSON runs to the token limit in whitespace); the SDK's
    tool_use block goes back as a tool_result and the conversation goes on."""
    client = anthropic_client(server.base)
    tools = [{"name": "get_weather", "description": "Current weather",
              "input_schema": WEATHER["function"]["parameters"]}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model="demo", max_tokens=400, messages=msgs, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 1})
    assert first.stop_reason == "tool_use", first
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER["function"]["parameters"])
    with client.messages.stream(model="demo", max_tokens=400, messages=msgs, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 1}) as st:
        again = st.get_final_message()
    assert [(b.name, b.input) for b in again.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    follow = client.messages.create(model="demo", max_tokens=8, tools=tools, extra_body=GREEDY, messages=[
        *msgs, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use") and follow.content


# ============================================================================ mixed load

def _jobs(base: str) -> dict:
    """name -> a function that sends one request and returns what must not change under load."""
    def chat_json():
        d = oai_chat(base, {"messages": [{"role": "user", "content": "Describe a person as JSON."}],
                            "max_tokens": 200, "seed": 5,
                            "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}})
        text = d["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), PERSON)
        return text

    def chat_tools():
        d = oai_chat(base, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 400,
                            "seed": 2, "temperature": 1, "tools": [WEATHER], "tool_choice": "required",
                            "parallel_tool_calls": False})
        calls = d["choices"][0]["message"]["tool_calls"]
        assert d["choices"][0]["finish_reason"] == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])
        return calls[0]["function"]["name"], calls[0]["function"]["arguments"]

    def chat_logprobs():
        d = oai_chat(base, {"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 16, "seed": 4,
                            "logprobs": True, "top_logprobs": 3})
        content = d["choices"][0]["logprobs"]["content"]
        return (d["choices"][0]["message"]["content"], [c["token"] for c in content],
                [[t["token"] for t in c["top_logprobs"]] for c in content],
                np.array([[c["logprob"], *(t["logprob"] for t in c["top_logprobs"])] for c in content]))

    def gbnf():
        r = httpx.post(base + "/completion", json={"prompt": "ROMEO:", "n_predict": 40, "seed": 6,
                                                   "grammar": 'root ::= [a-z ]{3,30} "."'}, timeout=120).json()
        assert r["content"].endswith(".")
        return r["content"]

    def n_probs():
        r = httpx.post(base + "/completion", json={"prompt": "JULIET:", "n_predict": 24, "seed": 8, "n_probs": 2},
                       timeout=120).json()
        probs = r["completion_probabilities"]
        return (r["content"], [[p["tok_str"] for p in c["probs"]] for c in probs],
                np.array([[p["prob"] for p in c["probs"]] for c in probs]))

    def banned():
        r = httpx.post(base + "/completion", json={"prompt": "ROMEO:", "n_predict": 40, "seed": 7,
                                                   "banned_strings": ["the"]}, timeout=120).json()
        assert "the" not in r["content"].lower()
        return r["content"]

    def anthropic_stream():
        with anthropic_client(base).messages.stream(model="demo", max_tokens=24, extra_body=GREEDY,
                                                    messages=[{"role": "user", "content": "Tell a tale."}]) as st:
            return "".join(st.text_stream)

    def plain_stream():
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Sing."}], "max_tokens": 32, "seed": 10, "stream": True}) as r:
            parts = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        return "".join(p["choices"][0]["delta"].get("content") or "" for p in parts if p["choices"])

    return {f.__name__: f for f in (chat_json, chat_tools, chat_logprobs, gbnf, n_probs, banned, anthropic_stream,
                                    plain_stream)}


def _same(a, b) -> None:
    """Equal, with log-probability arrays within float rounding (a batch's row count changes the
    products' rounding, not the tokens)."""
    if isinstance(a, np.ndarray):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_mixed_requests_under_load_answer_as_alone(server):
    jobs = _jobs(server.base)
    alone = {name: f() for name, f in jobs.items()}
    together: dict = {}
    errors: list = []

    def run(name: str) -> None:
        try:
            together[name] = jobs[name]()
        except BaseException as e:  # noqa: BLE001
            errors.append((name, repr(e)))

    threads = [threading.Thread(target=run, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert set(together) == set(alone)
    for name in jobs:
        _same(together[name], alone[name])
    # the server took them in batches of several slots (its /slots shows every slot used)
    slots = httpx.get(server.base + "/slots").json()
    assert len(slots) == 4 and all(s["n_ctx"] == 1024 for s in slots)
    assert all(s["prompt"] for s in slots), [s["prompt"][:30] for s in slots]
