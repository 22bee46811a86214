"""tool_choice enforced by grammars, lazy grammars, the server's default grammar, id_slot, echo and
banned strings.

engine.tool_grammar on its own (each family's canonical call is in its grammar; random sampling
under the grammar always gives a call that parses and whose arguments validate; special-token
markers named by id), engine.grammar's lazy matcher (free until the trigger, rollback), then the real
ServingEngine on the embedded demo model in this process behind create_app (the generic JSON format
and Qwen2.5's Hermes template; temperature 1, several seeds), llama-server's raw grammar_lazy /
grammar_triggers on /completion, the server-wide default grammar, id_slot, echo and banned strings.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from test_server import ServerThread, assert_error, stream_post

from engine import grammar as G
from engine.sampling import Sampler, SamplingParams
from engine.tool_calls import FORMATS, normalize_tools, parse_message
from engine.tool_grammar import CONSTRAINED_FORMATS, tool_grammar

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not G.available(), reason="llguidance is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "engine", "data", "demo-deepseek2.gguf")
SHARED = os.path.join(os.path.dirname(ROOT), "shared")

# bounded values: a random model closes every string within its maxLength
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

DS = {k: v for k, v in zip(("calls", "call", "sep", "call_end", "calls_end"),
                           ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                            "<｜tool▁calls▁end｜>"))}
CANONICAL = {   # one call of get_weather in each family's own syntax
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                   "</parameter>\n</function>\n</tool_call>",
    "deepseek_r1": f'{DS["calls"]}{DS["call"]}function{DS["sep"]}get_weather\n```json\n{{"city": "Paris"}}\n```'
                   f'{DS["call_end"]}{DS["calls_end"]}',
    "deepseek_v3_1": f'{DS["calls"]}{DS["call"]}get_weather{DS["sep"]}{{"city": "Paris"}}{DS["call_end"]}{DS["calls_end"]}',
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
               '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "glm_4_5": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "gpt_oss": '<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    "mistral_nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]',
    "generic": '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
}


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(DEMO)


def matcher(tok, tg) -> G.GrammarMatcher:
    return G.GrammarMatcher(tg.grammar, G.TokenVocab.of(tok), tg.lazy, tg.triggers)


def check_calls(calls: list, name: str | None = None) -> None:
    """Every call names a tool (the given one) and its arguments validate against its schema."""
    assert calls
    for c in calls:
        assert c.name in SCHEMAS and (name is None or c.name == name), c
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


# ================================================================== the grammars, no server

def test_every_family_is_constrained():
    assert set(CONSTRAINED_FORMATS) == set(FORMATS)
    assert tool_grammar("hermes", normalize_tools(TOOLS), "none") is None
    assert tool_grammar("hermes", [], "required") is None


@pytest.mark.parametrize("fmt", sorted(CANONICAL))
def test_canonical_calls_are_in_the_grammars(tok, fmt):
    tools = normalize_tools(TOOLS)
    for mode in ("required", "function", "auto"):
        tg = tool_grammar(fmt, tools, mode, "get_weather", parallel=fmt != "generic")
        assert tg.lazy == (mode == "auto") and bool(tg.triggers) == tg.lazy
        G.check_grammar(tg.grammar, tok)
        # "auto": free text first, unless the format's call must open the answer
        text = ("Sure. " if mode == "auto" and fmt not in ("llama3", "generic") else "") + CANONICAL[fmt]
        m = matcher(tok, tg)
        assert all(m.accept(t) for t in tok.encode(text, add_special=False)), m.error
        assert m.is_accepting()
        check_calls(parse_message(text, fmt, tools=tools).tool_calls, "get_weather")
    # a named function is that function only
    m = matcher(tok, tool_grammar(fmt, tools, "function", "get_time", parallel=False))
    assert not all(m.accept(t) for t in tok.encode(CANONICAL[fmt], add_special=False))


def sample(tok, tg, seed: int, n: int = 700) -> str:
    """Random logits (3 * N(0, 1), temperature 1) under the grammar: the text until it ends."""
    s = Sampler(SamplingParams(grammar=tg.grammar, grammar_lazy=tg.lazy, grammar_triggers=tuple(tg.triggers),
                               seed=seed, temperature=1.0), tok.n_vocab, None, tok.eog_ids, vocab=tok)
    rng = np.random.default_rng(seed + 1000)
    out: list[int] = []
    for _ in range(n):
        t = s.sample((rng.standard_normal(tok.n_vocab) * 3).astype(np.float32), out)
        if tok.is_eog(t):
            break
        out.append(t)
        if s.grammar.is_stopped():
            break
    return G.token_texts(tok, out)


@pytest.mark.parametrize("fmt", sorted(CONSTRAINED_FORMATS))
def test_random_sampling_always_gives_valid_calls(tok, fmt):
    """tool_choice "required" and a named function: whatever the draws, one call (parallel off) of
    a tool (that tool) whose arguments validate; with parallel calls every call validates."""
    tools = normalize_tools(TOOLS)
    for seed in range(5):
        for mode, name in (("required", None), ("function", "get_time")):
            text = sample(tok, tool_grammar(fmt, tools, mode, name, parallel=False), seed)
            calls = parse_message(text, fmt, tools=tools).tool_calls
            assert len(calls) == 1, text
            check_calls(calls, name)
    if fmt not in ("llama3", "generic", "gpt_oss"):     # one call at most, or an unbounded id string
        text = sample(tok, tool_grammar(fmt, tools, "required", parallel=True), 0, n=1500)
        calls = parse_message(text, fmt, tools=tools).tool_calls
        check_calls(calls[:-1] or calls)        # the last may be cut by the token limit


def test_special_token_markers_are_named_by_id():
    """A marker that is one special token of the vocabulary is the token in the grammar (grammar
    text never matches a special token): the token trigger fires the lazy grammar on it."""
    path = os.path.join(SHARED, "vocab", "ggml-vocab-deepseek-llm.gguf")
    if not os.path.exists(path):
        pytest.skip("../shared/vocab is missing")
    from engine.tokenizer import Tokenizer
    tk = Tokenizer.from_gguf(path)
    vocab = G.TokenVocab.of(tk)
    marker = sorted(vocab.special_ids - set(tk.eog_ids))[0]        # stands in for <tool_call>
    special = {"<tool_call>": marker}.get
    tools = normalize_tools(TOOLS)
    body = tk.encode('\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', add_special=False)
    tg = tool_grammar("hermes", tools, "required", special_id=special)
    assert f"<[{marker}]>" in tg.grammar and '"<tool_call>"' not in tg.grammar
    m = G.GrammarMatcher(tg.grammar, vocab)
    assert not m.accept(tk.encode("<tool_call>", add_special=False)[0])     # the text is not the token
    m = G.GrammarMatcher(tg.grammar, vocab)
    assert all(m.accept(t) for t in [marker] + body) and m.is_accepting()
    tg = tool_grammar("hermes", tools, "auto", special_id=special)
    m = G.GrammarMatcher(tg.grammar, vocab, True, [{"type": G.TRIGGER_TOKEN, "value": "<tool_call>", "token": marker}])
    assert all(m.accept(t) for t in tk.encode("Let me see.", add_special=False)) and m.awaiting
    assert all(m.accept(t) for t in [marker] + body) and not m.awaiting and m.is_accepting()
    # a forced reasoning block ends at the special </think>
    tg = tool_grammar("hermes", tools, "required", special_id={"<tool_call>": None, "</think>": marker}.get,
                      think="forced")
    m = G.GrammarMatcher(tg.grammar, vocab)
    text = tk.encode("Hmm.", add_special=False) + [marker] + tk.encode(
        '\n\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', add_special=False)
    assert all(m.accept(t) for t in text) and m.is_accepting()


def test_lazy_matcher_waits_for_its_trigger(tok):
    """Free (every token allowed, nothing consumed) until the trigger; the grammar takes the text
    from the trigger's start (a group's, for a pattern), the token it starts inside re-encoded; a
    rollback past the trigger waits again."""
    g = 'root ::= "<call>" [0-9]+ "</call>"'
    m = G.GrammarMatcher(g, G.TokenVocab.of(tok), True, [{"type": G.TRIGGER_WORD, "value": "<call>"}])
    free = tok.encode("Some text, then: <call>", add_special=False)
    for t in free[:-1]:
        assert m.allowed_mask().all() and m.accept(t) and m.awaiting
    assert m.accept(free[-1]) and not m.awaiting
    assert not m.allowed_mask().all()
    assert all(m.accept(t) for t in tok.encode("42</call>", add_special=False)) and m.is_stopped()
    m.rollback(4)
    assert not m.awaiting and not m.is_stopped()
    m.rollback(100)
    assert m.awaiting and m.is_accepting()
    # a pattern fires from its first group; here inside the token "x:" (text before it is dropped)
    m = G.GrammarMatcher('root ::= ":" " " [a-z]+ "."', G.TokenVocab.of(tok), True,
                         [{"type": G.TRIGGER_PATTERN, "value": "[a-z](:)"}])
    assert all(m.accept(t) for t in tok.encode("Say x: yes.", add_special=False)), m.error
    assert m.is_stopped()
    # a full pattern must match all the text so far
    m = G.GrammarMatcher('root ::= "{" [a-z]* "}"', G.TokenVocab.of(tok), True,
                         [{"type": G.TRIGGER_PATTERN_FULL, "value": r"\s*(\{)[\s\S]*"}])
    assert all(m.accept(t) for t in tok.encode("no {", add_special=False)) and m.awaiting
    with pytest.raises(G.GrammarError, match="Unknown grammar trigger type"):
        G.normalize_triggers([{"type": 7, "value": "x"}])
    with pytest.raises(G.GrammarError, match="invalid grammar trigger pattern"):
        G.normalize_triggers([{"type": G.TRIGGER_PATTERN, "value": "("}])


# ================================================================== the real engine behind create_app

@pytest.fixture(scope="module")
def real():
    """The ServingEngine on the demo model (2 slots of 4096) with four apps over it: no template
    (ChatML, the generic JSON format), Qwen2.5's Hermes template, a server default grammar, and
    --banned-string-file's strings."""
    from engine.config import EngineConfig
    from engine.model import load_model, quiet_log
    from engine.serving import ServingEngine
    from ikcli.server_app import create_app
    m = load_model(DEMO, quiet_log)
    eng = ServingEngine(m, EngineConfig(DEMO, n_ctx=8192, n_threads=2), 2, quiet_log)
    eng.start()
    qwen = os.path.join(SHARED, "templates", "Qwen-Qwen2.5-7B-Instruct.jinja")
    apps = {"generic": {}, "default": {"default_sampling": {"grammar": 'root ::= "yes" | "no"'}},
            "banned": {"banned_strings": ["romeo"], "banned_n": -1}}
    if os.path.exists(qwen):
        apps["hermes"] = {"chat_template": open(qwen, encoding="utf-8").read()}
    servers = {k: ServerThread(create_app(eng, m, model_path=DEMO, alias="demo", log_requests=False, **kw))
               for k, kw in apps.items()}
    yield SimpleNamespace(engine=eng, **{k: s.base for k, s in servers.items()})
    for s in servers.values():
        s.stop()
    eng.shutdown()


# Room for the longest call the grammars allow: JSON's whitespace rule takes up to 22 characters at each
# of ~20 places, and a random model at temperature 1 often takes most of them one token at a time
# (250-400 tokens a call on the demo model), so 400 tokens cut some calls short.
CALL_TOKENS = 1024


def chat(base: str, **body) -> dict:
    r = httpx.post(base + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": CALL_TOKENS, **body},
        timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def calls_of(choice: dict) -> list:
    return [SimpleNamespace(name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []]


@pytest.mark.parametrize("app", ["generic", "hermes"])
def test_required_and_named_always_call(real, app):
    """temperature 1, several seeds: "required" always answers one valid call (finish_reason
    tool_calls, no content), a named function always that function."""
    base = getattr(real, app, None)
    if base is None:
        pytest.skip("../shared/templates is missing")
    for seed in range(4):
        ch = chat(base, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1, seed=seed)
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, ch
        check_calls(calls_of(ch))
        ch = chat(base, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                  parallel_tool_calls=False, temperature=1, seed=seed)
        assert len(calls_of(ch)) == 1
        check_calls(calls_of(ch), "get_time")
    # streamed: the same call as deltas
    events = stream_post(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": CALL_TOKENS, "tools": TOOLS,
        "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1, "seed": 0, "stream": True})
    args = "".join(t["function"].get("arguments", "") for e in events[:-1] if e["choices"]
                   for t in e["choices"][0]["delta"].get("tool_calls", []))
    assert args == calls_of(chat(base, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                 temperature=1, seed=0))[0].arguments
    # Anthropic's tool_choice "any" is "required"
    r = httpx.post(base + "/v1/messages", json={
        "model": "demo", "max_tokens": CALL_TOKENS, "temperature": 1, "seed": 0,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]},
        timeout=120).json()
    assert r["stop_reason"] == "tool_use" and [b["type"] for b in r["content"]][-1] == "tool_use"


def test_auto_stays_free_without_its_trigger(real):
    """"auto" is lazy: the demo model writes no JSON, so the answer is what it is without tools'
    grammar (the generic format's trigger is an answer opening with "{")."""
    ch = chat(real.generic, tools=TOOLS, max_tokens=16, seed=3, temperature=1)
    assert not calls_of(ch) and ch["finish_reason"] == "length" and not ch["message"]["content"].lstrip().startswith("{")


def completion(base: str, **body) -> dict:
    r = httpx.post(base + "/completion", json={"prompt": "ROMEO:", "n_predict": 40, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_raw_lazy_grammar_on_completion(real):
    """/completion's grammar_lazy + grammar_triggers (llama-server's raw form): the text up to the
    trigger is the free answer's, after it the grammar holds (and ends the answer)."""
    free = completion(real.generic, seed=7)["content"]
    k = free.index("e")
    lazy = completion(real.generic, seed=7, grammar='root ::= "e" [^!]{0,8} "!"', grammar_lazy=True,
                      grammar_triggers=[{"type": G.TRIGGER_PATTERN, "value": "(e)"}])
    text = lazy["content"]
    assert text[:k + 1] == free[:k + 1] and text.endswith("!") and len(text) <= k + 10, (free, text)
    assert lazy["stop_type"] == "eos" and lazy["generation_settings"]["grammar_lazy"] is True
    streamed = "".join(e["content"] for e in stream_post(real.generic, "/completion", {
        "prompt": "ROMEO:", "n_predict": 40, "seed": 7, "stream": True, "grammar": 'root ::= "e" [^!]{0,8} "!"',
        "grammar_lazy": True, "grammar_triggers": [{"type": G.TRIGGER_PATTERN, "value": "(e)"}]}))
    assert streamed == text
    # a trigger that never fires: the free answer
    never = completion(real.generic, seed=7, grammar='root ::= "x"', grammar_lazy=True,
                       grammar_triggers=[{"type": G.TRIGGER_WORD, "value": "QQQ@@"}])
    assert never["content"] == free
    # a word that is one token must be a preserved token, and becomes a token trigger
    one = httpx.post(real.generic + "/tokenize", json={"content": "the"}).json()["tokens"]
    assert len(one) == 1
    body = {"prompt": "ROMEO:", "n_predict": 4, "grammar": 'root ::= "x"', "grammar_lazy": True,
            "grammar_triggers": [{"type": G.TRIGGER_WORD, "value": "the"}]}
    assert_error(httpx.post(real.generic + "/completion", json=body), 400,
                 contains="Grammar trigger word should be marked as preserved token: the")
    d = completion(real.generic, **{**body, "preserved_tokens": ["the"]})
    assert d["generation_settings"]["grammar_triggers"] == [{"type": G.TRIGGER_TOKEN, "value": "the", "token": one[0]}]
    for bad, msg in (({"grammar_lazy": True}, "Error: no triggers set for lazy grammar!"),
                     ({"grammar_triggers": [{"type": 9, "value": "x"}]}, "Unknown grammar trigger type"),
                     ({"grammar_triggers": [{"type": G.TRIGGER_PATTERN, "value": "(x"}]}, "invalid grammar trigger"),
                     ({"grammar_triggers": "x"}, "'grammar_triggers' must be an array")):
        assert_error(httpx.post(real.generic + "/completion", json={"prompt": "x", "grammar": 'root ::= "a"', **bad}),
                     400, contains=msg)


def test_server_default_grammar(real):
    """--grammar (create_app's default_sampling) constrains what gives no constraint of its own; a
    request's grammar / json_schema / response_format, or tool_choice's grammar, replace it."""
    d = completion(real.default, seed=1)
    assert d["content"] in ("yes", "no") and d["generation_settings"]["grammar"] == 'root ::= "yes" | "no"'
    assert completion(real.default, seed=1, grammar="")["content"] in ("yes", "no")      # "" is no grammar
    assert completion(real.default, seed=1, grammar='root ::= "maybe"')["content"] == "maybe"
    js = completion(real.default, seed=1, n_predict=200, json_schema={"type": "integer", "minimum": 10, "maximum": 99})
    assert 10 <= int(js["content"]) <= 99
    assert chat(real.default, max_tokens=8, seed=2)["message"]["content"] in ("yes", "no")
    ch = chat(real.default, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1, seed=2)
    check_calls(calls_of(ch))


def test_cli_default_grammar_errors(capsys):
    """A bad --grammar / --grammar-file / -j fails at start, in one line naming the flag."""
    from ikcli.app import main
    for args, msg in ((["--grammar-file", "/no/such/file.gbnf"], "--grammar-file: failed to open file '/no/such/file.gbnf'"),
                      (["-j", "{not json"], "--json-schema: "),
                      (["--json-schema", "[1]"], "--json-schema: the JSON schema must be an object"),
                      (["--grammar", "root ::= x", "-j", "{}"], "give only one of --grammar, --json-schema"),
                      (["--banned-string-file", "/no/such/list"], "--banned-string-file: failed to open file"),
                      (["--port", "0", "--grammar", 'root ::= ("a"'], "--grammar: ")):
        with pytest.raises(SystemExit) as e:
            main(["server", *args])
        err = capsys.readouterr().err
        assert e.value.code == 1 and msg in err, err
        assert len([ln for ln in err.splitlines() if "error" in ln.lower()]) == 1


def test_id_slot(real):
    """id_slot runs the request in that slot (the answer and /slots say so); a busy slot makes it
    wait while other requests take the free slot; an id no slot has is a 400."""
    for slot in (1, 0, 1):
        d = completion(real.generic, seed=1, n_predict=4, id_slot=slot)
        assert d["id_slot"] == slot
        info = httpx.get(real.generic + "/slots").json()[slot]
        assert info["id_task"] == max(s["id_task"] for s in httpx.get(real.generic + "/slots").json())
    assert_error(httpx.post(real.generic + "/completion", json={"prompt": "x", "id_slot": 2}), 400,
                 contains="Invalid slot ID")
    assert_error(httpx.post(real.generic + "/completion", json={"prompt": "x", "id_slot": "a"}), 400)
    done: dict = {}

    def run(name: str, **body) -> None:
        done[name] = (completion(real.generic, seed=1, **body), time.perf_counter())

    long = threading.Thread(target=run, args=("long",), kwargs={"n_predict": 400, "id_slot": 0, "ignore_eos": True})
    long.start()
    time.sleep(0.2)
    others = [threading.Thread(target=run, args=("pinned",), kwargs={"n_predict": 2, "id_slot": 0}),
              threading.Thread(target=run, args=("free",), kwargs={"n_predict": 2})]
    for t in others:
        t.start()
    for t in [long, *others]:
        t.join(120)
    assert done["pinned"][0]["id_slot"] == 0 and done["free"][0]["id_slot"] == 1
    assert done["free"][1] < done["long"][1] < done["pinned"][1]


def test_echo(real):
    """/v1/completions echo: each choice's text starts with its prompt, streamed too."""
    url = real.generic + "/v1/completions"
    body = {"prompt": "ROMEO:", "max_tokens": 8, "seed": 4}
    plain = httpx.post(url, json=body).json()["choices"][0]["text"]
    echoed = httpx.post(url, json={**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "ROMEO:" + plain
    events = stream_post(real.generic, "/v1/completions", {**body, "echo": True, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == echoed
    ids = httpx.post(real.generic + "/tokenize", json={"content": "ROMEO:"}).json()["tokens"]
    two = httpx.post(url, json={**body, "prompt": ids, "echo": True, "n": 2}).json()["choices"]
    assert [c["text"][:6] for c in two] == ["ROMEO:", "ROMEO:"]
    assert_error(httpx.post(url, json={**body, "echo": True, "logprobs": 2}), 400, contains="echo")


def tokens_of(d: dict) -> list[str]:
    return [p["content"] for p in d["completion_probabilities"]]


def test_banned_strings(real):
    """banned_strings (ik's): the answer never holds them (any case); up to the token where the
    first one began it is the free answer, token for token; streamed as not; the server's
    --banned-string-file list applies unless the request gives its own; a bad regex is a 400."""
    body = {"seed": 7, "n_predict": 60, "n_probs": 1}
    free = completion(real.generic, **body)
    words = [w for w in re.findall(r"[A-Za-z]{4,}", free["content"])]
    word = words[1]
    ban = completion(real.generic, **body, banned_strings=[word.upper()])
    assert word.lower() not in ban["content"].lower()
    start = free["content"].lower().index(word.lower())
    pieces, n = tokens_of(free), 0
    while len("".join(pieces[:n + 1])) <= start:
        n += 1
    assert tokens_of(ban)[:n] == pieces[:n] and tokens_of(ban) != pieces
    assert "".join(tokens_of(ban)) == ban["content"]
    streamed = "".join(e["content"] for e in stream_post(real.generic, "/completion", {
        "prompt": "ROMEO:", **body, "banned_strings": [word], "stream": True}))
    assert streamed == ban["content"]
    # a regex, and every token of the phrase banned (banned_n -1)
    rx = completion(real.generic, **body, banned_regex=[word[:2] + "[a-z]"], banned_n=-1)
    assert not re.search(word[:2] + "[a-z]", rx["content"])
    # the server's list ("romeo", banned_n -1), unless the request gives banned_strings
    assert "romeo" not in completion(real.banned, seed=1, n_predict=60)["content"].lower()
    own = completion(real.banned, seed=1, n_predict=60, banned_strings=[])["content"]
    assert own == completion(real.generic, seed=1, n_predict=60)["content"]
    for bad, msg in (({"banned_regex": ["("]}, "Invalid regex in banned_regex: ("),
                     ({"banned_regex_case_insensitive": ["[a"]}, "Invalid regex in banned_regex_case_insensitive"),
                     ({"banned_strings": "x"}, "'banned_strings' must be an array")):
        assert_error(httpx.post(real.generic + "/completion", json={"prompt": "x", **bad}), 400, contains=msg)
