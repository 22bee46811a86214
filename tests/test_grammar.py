"""Constrained output (issue 17): GBNF grammars, JSON schemas and response_format.

engine.grammar on its own (GBNF's language and errors as llama.cpp's, the JSON-schema conventions,
the token mask), the Sampler on random logits over the demo model's real BPE vocabulary (outputs
parse and validate), the HTTP layer's field parsing on a tiny in-process fake, and `ikcli server`
on the embedded demo model driven with httpx and the official openai client (a constrained and a
free request side by side)."""
from __future__ import annotations

import glob
import json
import os
import re
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import launch_server, stop_server

from engine import grammar as G  # noqa: E402
from engine.sampling import Sampler, SamplingParams  # noqa: E402

# the two checks of the 400 without llguidance run everywhere; the rest needs the package
needs_llg = pytest.mark.skipif(not G.available(), reason="llguidance is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "engine", "data", "demo-deepseek2.gguf")
GRAMMARS = "/work/ikbuild/src/grammars"

try:
    import jsonschema
except ImportError:  # a small validator for the keywords the schemas below use
    jsonschema = None


def validate(value, schema: dict) -> None:
    """Raise AssertionError unless value satisfies schema."""
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    t = schema.get("type")
    if t:
        assert isinstance(value, kinds[t]) and not (t in ("integer", "number") and isinstance(value, bool)), (value, t)
    if "enum" in schema:
        assert value in schema["enum"], value
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), value
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), value
        for k, v in value.items():
            if k in props:
                validate(v, props[k])
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value)), value
        for v in value:
            validate(v, schema.get("items", {}))
    if isinstance(value, str):
        assert len(value) <= schema.get("maxLength", len(value)), value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(DEMO)


def accepts(tok, gbnf: str, text: str) -> bool:
    m = G.GrammarMatcher(gbnf, G.TokenVocab.of(tok))
    return all(m.accept(t) for t in tok.encode(text, add_special=False)) and m.is_accepting()


def generate(tok, grammar: str, seed: int, n: int = 400, scale: float = 3.0, **kw) -> tuple[str, str]:
    """Sample on random logits (scale * N(0, 1)) under grammar: (text, how it ended)."""
    s = Sampler(SamplingParams(grammar=grammar, seed=seed, **kw), tok.n_vocab, None, tok.eog_ids, vocab=tok)
    rng = np.random.default_rng(seed + 1000)
    out: list[int] = []
    for _ in range(n):
        t = s.sample((rng.standard_normal(tok.n_vocab) * scale).astype(np.float32), out)
        if tok.is_eog(t):
            return G.token_texts(tok, out), "eos"
        out.append(t)
        if s.grammar.is_stopped():
            return G.token_texts(tok, out), "stopped"
    return G.token_texts(tok, out), "limit"


# ================================================================== GBNF: llama.cpp's language

LANGUAGE = [  # (grammar, text, in the language?) - a plain character-level CFG, as llama.cpp parses
    ('root ::= [a-z]* "x"', "abcx", True),
    ('root ::= a "x"\na ::= [a-z]*', "abx", True),          # a greedy lexer would eat the x
    ('root ::= ( "a" | "ab" ) "bc"', "abc", True),
    ('root ::= "ab"* "abc"', "ababc", True),
    ('root ::= "\\u00e9"+ "\\x41"', "ééA", True),
    ('root ::= .+', "a\nb", True),                           # . is any character, newline too
    ('root ::= x "-" x\nx ::= [0-9]{2,3}', "12-345", True),
    ('root ::= x "-" x\nx ::= [0-9]{2,3}', "1-345", False),
    ('root ::= "yes" | "no"', "ye", False),
    ('root ::= [^"]* "\\""', 'ab"', True),
    ('root ::= "a" |   # empty alternative\n', "", True),
    ('root ::= e\ne ::= e "+" t | t\nt ::= [0-9]', "1+2+3", True),   # left recursion: accepted here
    ('Root-1 ::= "q"{2}\nroot ::= (\n  Root-1\n)', "qq", True),
    ('root ::= "ab"{2,} "c"', "ababc", True),
    ('root ::= "ab"{2,} "c"', "abc", False),
]


@needs_llg
@pytest.mark.parametrize("gbnf,text,want", LANGUAGE)
def test_gbnf_language_is_llama_cpps(tok, gbnf, text, want):
    assert accepts(tok, gbnf, text) is want


BAD_GBNF = [
    ('foo ::= "a"', 'grammar does not contain a "root" symbol'),
    ('root ::= "a', "unexpected end of input"),
    ('root ::= x', "Undefined rule identifier 'x'"),
    ('root := "a"', "expecting ::="),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\u12"', "expecting 4 hex chars"),
    ('root ::= *', "expecting preceding item"),
    ('root ::= ("a"', "expecting ')'"),
    ('my_rule ::= "a"', "expecting ::="),                  # llama.cpp's names have no underscore
    ('root ::= "a"{3001}', "number of repetitions exceeds sane defaults"),
    ('root ::= "a" "b" ]', "expecting newline or end"),
    ('root ::= <not-a-token>', "invalid token"),
]


@needs_llg
@pytest.mark.parametrize("gbnf,message", BAD_GBNF)
def test_bad_gbnf_is_refused_with_llama_cpps_words(tok, gbnf, message):
    with pytest.raises(G.GrammarError, match=re.escape(message)):
        G.check_grammar(gbnf, tok)


@needs_llg
def test_llama_cpp_grammar_files_compile(tok):
    files = sorted(glob.glob(os.path.join(GRAMMARS, "*.gbnf")))
    if not files:
        pytest.skip("ik_llama.cpp's grammars/ folder is not here")
    for f in files:
        with open(f, encoding="utf-8") as fh:
            G.check_grammar(fh.read(), tok)


@needs_llg
def test_lark_passes_through_and_token_references(tok):
    assert accepts(tok, "%llguidance {}\nstart: \"a\" /[0-9]+/", "a42")
    eos = sorted(tok.eog_ids)[0]
    # <[id]> is that token whatever its text; a special token's text is not ordinary text
    m = G.GrammarMatcher(f'root ::= "x" <[{eos}]>', G.TokenVocab.of(tok))
    assert m.accept(tok.encode("x", add_special=False)[0])
    assert np.flatnonzero(m.allowed_mask()).tolist() == [eos]


# ================================================================== the mask and the sampler

@needs_llg
def test_yes_no_grammar_forces_the_output(tok):
    answers = set()
    for seed in range(6):
        for kw in ({}, {"temperature": 0.0}, {"mirostat": 2}, {"top_k": 0, "top_p": 1.0, "min_p": 0.0}):
            text, how = generate(tok, 'root ::= "yes" | "no"', seed, **kw)
            assert text in ("yes", "no") and how == "stopped", (text, how, kw)
            answers.add(text)
    assert answers == {"yes", "no"}


@needs_llg
def test_finished_grammar_allows_only_eog_and_stops(tok):
    vocab = G.TokenVocab.of(tok)
    m = G.GrammarMatcher('root ::= "no"', vocab)
    for t in tok.encode("no", add_special=False):
        assert m.allowed_mask()[t]
        assert m.accept(t)
    assert m.is_stopped() and m.is_accepting()
    assert set(np.flatnonzero(m.allowed_mask()).tolist()) == set(tok.eog_ids)
    # a grammar that may go on allows EOG beside the continuations once it is complete
    m = G.GrammarMatcher('root ::= "a"+', vocab)
    m.accept(tok.encode("a", add_special=False)[0])
    mask = m.allowed_mask()
    assert not m.is_stopped() and all(mask[list(tok.eog_ids)]) and mask.sum() > len(tok.eog_ids)


@needs_llg
def test_nothing_allowed_ends_with_eog(tok):
    """logit_bias banning every token the grammar allows: an end-of-generation token, not garbage."""
    ids = tok.encode("no", add_special=False)
    p = SamplingParams(grammar='root ::= "no"', logit_bias=[(ids[0], -np.inf)], seed=1)
    s = Sampler(p, tok.n_vocab, None, tok.eog_ids, vocab=tok)
    assert tok.is_eog(s.sample(np.zeros(tok.n_vocab, np.float32), []))


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "mood": {"enum": ["happy", "sad", "calm"]},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "address": {"type": "object", "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 6},
                                       "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "mood", "tags", "address", "ok"],
    },
    "list": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
                                        "required": ["id"]}, "maxItems": 4},
}


@needs_llg
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(tok, name):
    schema = SCHEMAS[name]
    grammar = G.schema_grammar(schema)
    for seed in range(4):
        text, how = generate(tok, grammar, seed)
        assert how == "stopped", (how, text)
        value = json.loads(text)
        validate(value, schema)
        validate(value, G._closed_objects(schema))     # llama.cpp's convention: no unlisted properties


@needs_llg
def test_json_object_is_any_object_and_whitespace_is_llama_cpps(tok):
    grammar = G.schema_grammar({})                    # response_format {"type": "json_object"}
    done = 0
    for seed in range(6):
        text, how = generate(tok, grammar, seed, n=300, scale=1.0, temperature=0.0)
        if how == "stopped":
            assert isinstance(json.loads(text), dict)
            done += 1
        else:
            assert text.startswith("{")
    assert done >= 1
    # llama.cpp's `space`: nothing, one space, or 1-2 newlines then up to 20 spaces/tabs
    g = G.schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    for text, ok in (('{"a":1}', True), ('{ "a" : 1 }', True), ('{\n\n\t\t"a":1}', True),
                     ('{\n\n\n"a":1}', False), ('{  "a":1}', False), ('{"a":1,"b":2}', False)):
        assert accepts(tok, g, text) is ok, text


@needs_llg
def test_schema_errors_and_conventions(tok):
    with pytest.raises(G.GrammarError):
        G.check_grammar(G.schema_grammar({"type": "strnig"}), tok)
    with pytest.raises(G.GrammarError):
        G.schema_grammar([1, 2])
    closed = G._closed_objects({"properties": {"a": {"properties": {"b": {}}}}, "allOf": [{"properties": {"c": {}}}]})
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]
    assert G._closed_objects({"properties": {}, "additionalProperties": True})["additionalProperties"] is True


def test_without_llguidance_a_clear_error(tok, monkeypatch):
    monkeypatch.setattr(G, "_llg", None)
    with pytest.raises(G.GrammarUnavailable, match="llguidance"):
        G.check_grammar('root ::= "a"', tok)


@needs_llg
def test_mixed_batch_matchers_are_independent(tok):
    """Two constrained samplers interleaved token by token (as the engine's slots are) and a free one:
    each constrained one produces exactly what it produces alone."""
    grammars = ['root ::= "yes" | "no" | "maybe"', G.schema_grammar(SCHEMAS["list"])]
    alone = [generate(tok, g, 3)[0] for g in grammars]
    samplers = [Sampler(SamplingParams(grammar=g, seed=3), tok.n_vocab, None, tok.eog_ids, vocab=tok) for g in grammars]
    free = Sampler(SamplingParams(seed=3), tok.n_vocab, None, tok.eog_ids)
    rngs = [np.random.default_rng(1003) for _ in grammars]
    outs: list[list[int]] = [[] for _ in grammars]
    live = [True] * len(grammars)
    free_rng, free_out = np.random.default_rng(7), []
    while any(live):
        for i, s in enumerate(samplers):
            if live[i]:
                t = s.sample((rngs[i].standard_normal(tok.n_vocab) * 3).astype(np.float32), outs[i])
                if tok.is_eog(t):
                    live[i] = False
                    continue
                outs[i].append(t)
                live[i] = not s.grammar.is_stopped()
        free_out.append(free.sample(free_rng.standard_normal(tok.n_vocab).astype(np.float32), free_out))
    assert [G.token_texts(tok, o) for o in outs] == alone
    assert free.grammar is None


# ================================================================== HTTP: request fields on a fake engine

class _Job:
    def __init__(self) -> None:
        self.id_slot = 0

    def cancel(self) -> None:
        pass


class _Engine:
    """Just enough of ServingEngine: answers every job with `answer` and records the params."""

    n_ctx_slot, n_parallel = 512, 2

    def __init__(self, tok) -> None:
        self.model = SimpleNamespace(tokenizer=tok, n_vocab=tok.n_vocab, file=SimpleNamespace(meta={}))
        self.params: list = []

    def tokenize(self, text, add_special):
        return self.model.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def detokenize(self, tokens):
        return self.model.tokenizer.decode(tokens)

    def slots_info(self):
        return [{"id": 0, "is_processing": False}, {"id": 1, "is_processing": False}]

    def submit(self, prompt, params, n_predict, stop, on_event, cache_prompt=True):
        from engine.serving import Event, Timings
        self.params.append(params)
        on_event(Event('{"a": 1}', None, False, None, "", len(prompt), 1))
        on_event(Event("", None, True, "stop", "", len(prompt), 1, Timings(len(prompt), 1.0, 1, 1.0)))
        return _Job()


@pytest.fixture(scope="module")
def fake(tok):
    from fastapi.testclient import TestClient
    from ikcli.server_app import create_app
    eng = _Engine(tok)
    render = lambda messages, template, bos, eos, agp, extra_vars=None: ("".join(m["content"] for m in messages), "x")
    with TestClient(create_app(eng, model_path="/m/demo.gguf", render_chat=render, log_requests=False)) as client:
        yield SimpleNamespace(client=client, engine=eng)


MSGS = [{"role": "user", "content": "hi"}]
GOOD_FIELDS = [  # (path, extra fields, what the sampler's grammar must be)
    ("/completion", {"grammar": 'root ::= "yes" | "no"'}, 'root ::= "yes" | "no"'),
    ("/completion", {"json_schema": {"type": "integer"}}, "%json"),
    ("/completion", {"json_schema": {}}, '"type": "object"'),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, '"type": "object"'),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "schema": {"type": "array"}}}, '"array"'),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {"q": {"type": "string"}}}}}},
     '"additionalProperties": false'),
    ("/v1/chat/completions", {"grammar": 'root ::= "a"'}, 'root ::= "a"'),
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "grammar": ""}, ""),
    ("/completion", {"grammar": None, "json_schema": None, "response_format": None}, ""),
]


@needs_llg
@pytest.mark.parametrize("path,extra,want", GOOD_FIELDS)
def test_fields_reach_the_sampler(fake, path, extra, want):
    body = {"messages": MSGS} if "chat" in path else {"prompt": "x"}
    r = fake.client.post(path, json={**body, **extra, "max_tokens": 4})
    assert r.status_code == 200, r.text
    got = fake.engine.params[-1].grammar
    assert (want in got) if want else got == ""
    if path == "/completion":
        assert r.json()["generation_settings"]["grammar"] == got


BAD_FIELDS = [
    ({"grammar": 'root ::= "a'}, "Failed to parse grammar: unexpected end of input"),
    ({"grammar": "foo ::= [a-z]"}, 'Failed to parse grammar: grammar does not contain a "root" symbol'),
    ({"grammar": 42}, "'grammar' must be a string"),
    ({"json_schema": {"type": "strnig"}}, '"json_schema":'),
    ({"json_schema": [1]}, '"json_schema"'),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "Cannot use both json_schema and grammar"),
    ({"response_format": {"type": "json_object"}, "json_schema": {}}, "Cannot use both json_schema and response_format"),
    ({"response_format": {"type": "yaml"}}, 'response_format type must be one of "text" or "json_object", but got: yaml'),
    ({"response_format": "json"}, "'response_format' must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, '"json_schema"'),
]


@needs_llg
@pytest.mark.parametrize("extra,message", BAD_FIELDS)
def test_bad_constraints_are_400(fake, extra, message):
    for path, body in (("/completion", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSGS})):
        r = fake.client.post(path, json={**body, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and message in err["message"], err


@needs_llg
def test_constraint_with_tools_is_400(fake):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = fake.client.post("/completion", json={"prompt": "x", "tools": tools, "grammar": 'root ::= "a"'})
    assert r.status_code == 400 and "Cannot use custom grammar constraints with tools." in r.text


def test_fields_without_llguidance_are_400(fake, monkeypatch):
    monkeypatch.setattr(G, "_llg", None)
    r = fake.client.post("/completion", json={"prompt": "x", "grammar": 'root ::= "a"'})
    assert r.status_code == 400 and "llguidance" in r.json()["error"]["message"]
    assert fake.client.post("/completion", json={"prompt": "x"}).status_code == 200


# ================================================================== the real server on the demo model

@pytest.fixture(scope="module")
def server():
    from ikcli.defaults import demo_model
    if not os.path.exists(demo_model()):
        pytest.skip("the embedded demo model is missing")
    s = launch_server("-c", "1024", "-np", "2", "-t", "2")
    yield s.base
    assert stop_server(s) == 0


PERSON = SCHEMAS["person"]
# the demo model loves llama.cpp's allowed whitespace (newlines and 20 spaces between lexemes): the
# long schema asks for compact JSON through llguidance's own option, the short one keeps the default
COMPACT = {**PERSON, "x-guidance": {"whitespace_flexible": False}}
MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
        "required": ["mood", "n"]}


@needs_llg
def test_real_grammar_completion(server):
    httpx = pytest.importorskip("httpx")
    r = httpx.post(server + "/completion", json={"prompt": "ROMEO:", "grammar": 'root ::= "yes" | "no"',
                                                  "n_predict": 20, "seed": 3}, timeout=60)
    d = r.json()
    assert r.status_code == 200 and d["content"] in ("yes", "no"), d
    assert d["stop_type"] == "eos" and d["stopped_eos"] and d["tokens_predicted"] <= 2
    assert d["generation_settings"]["grammar"] == 'root ::= "yes" | "no"'
    bad = httpx.post(server + "/completion", json={"prompt": "x", "grammar": "root ::= (\"a\""}, timeout=60)
    assert bad.status_code == 400 and "Failed to parse grammar" in bad.json()["error"]["message"]


@needs_llg
def test_real_openai_response_format_json_schema(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="sk-none", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": COMPACT}}
    chat = client.chat.completions.create(model="demo", messages=msgs, max_tokens=400, seed=5,
                                          response_format=rf)
    assert chat.choices[0].finish_reason == "stop"
    validate(json.loads(chat.choices[0].message.content), PERSON)
    mood = client.chat.completions.create(model="demo", messages=msgs, max_tokens=400, seed=6, response_format={
        "type": "json_schema", "json_schema": {"name": "mood", "schema": MOOD}})
    assert mood.choices[0].finish_reason == "stop"
    validate(json.loads(mood.choices[0].message.content), G._closed_objects(MOOD))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="demo", messages=msgs, max_tokens=400, seed=5, response_format=rf, stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content
    obj = client.chat.completions.create(model="demo", messages=msgs, max_tokens=400, seed=2, temperature=0.0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")
    cmpl = client.completions.create(model="demo", prompt="JULIET:", max_tokens=400, seed=4,
                                     extra_body={"response_format": rf})
    validate(json.loads(cmpl.choices[0].text), PERSON)


@needs_llg
def test_real_constrained_and_free_side_by_side(server):
    """Two slots in one batch, one constrained and one free: each answers what it answers alone."""
    httpx = pytest.importorskip("httpx")
    reqs = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 300,
                                      "seed": 9, "response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": COMPACT}}}),
            ("/completion", {"prompt": "First Citizen:", "n_predict": 60, "seed": 9})]

    def text(r: dict) -> str:
        return r["choices"][0]["message"]["content"] if "choices" in r else r["content"]

    alone = [text(httpx.post(server + p, json=b, timeout=120).json()) for p, b in reqs]
    together: list = [None, None]

    def run(i: int) -> None:
        together[i] = text(httpx.post(server + reqs[i][0], json=reqs[i][1], timeout=120).json())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    validate(json.loads(together[0]), PERSON)
    assert together[1] and not together[1].lstrip().startswith("{")
