"""OpenAI tool calls: engine.tool_calls' parsers, the chat templates given tools, and the server.

* parsers, per family, on answers written the way the models write them (single, parallel, content
  before, reasoning, malformed -> content, cut off), whole and streamed (every cut of the text gives
  the same content, reasoning and calls; a fuzz over random mixtures of markers and text);
* the real templates of ../shared/templates rendering a tools request and a round trip (call ->
  result), each checked for the text its model was trained on;
* the HTTP layer on a fake engine that answers in a family's native syntax: message.tool_calls,
  finish_reason "tool_calls", streamed tool_calls deltas, tool_choice / parallel_tool_calls, errors,
  with httpx and with the official openai client (a round trip: call -> tool result -> next prompt),
  and Anthropic's /v1/messages (tool_use / tool_result blocks);
* `ikcli server` on the demo model (no template: the generic JSON format) taking tools requests.
"""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import launch_server, stop_server

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

from engine.chat_template import GENERIC_INSTRUCTION, builtin_renderer, render_chat, tool_caps  # noqa: E402
from engine.tool_calls import (FORMATS, ToolCallStream, detect_format, normalize_tools,  # noqa: E402
                               parse_message, parse_tool_choice, preserved_tokens)
from ikcli.server_app import ReasoningSplit, create_app, split_reasoning  # noqa: E402
from test_server import FakeEngine, ServerThread, assert_error, sse_events, stream_post  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT.parent / "shared" / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


# ============================================================================ parsers, per family

def _calls(msg) -> list[tuple]:
    return [(c.name, c.arguments) for c in msg.tool_calls]


# (family, model output, content, reasoning, [(name, arguments)], ids the model gave)
CASES = [
    # Qwen2.5 / Qwen3 / Hermes
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "San José", "days": 2}}\n'
               '</tool_call>', "Let me check.", "", [("get_weather", '{"city":"San José","days":2}')], None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>', "", "",
     [("get_weather", '{"city":"Paris"}'), ("get_time", '{"tz":"Europe/Paris"}')], None),
    ("hermes", '<tool_call>\n{"arguments": {"tz": "CET"}, "name": "get_time"}\n</tool_call>', "", "",
     [("get_time", '{"tz":"CET"}')], None),                                     # keys in the other order
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>', "", "",
     [("get_time", '{"tz":"CET"}')], None),                                     # arguments as a JSON string
    ("hermes", 'Use <tool_call>not json</tool_call> or <tools>.', 'Use <tool_call>not json</tool_call> or <tools>.',
     "", [], None),                                                            # malformed: content
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>', '<tool_call>{"arguments": {"a": 1}}</tool_call>',
     "", [], None),                                                            # no name: content
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "", "",
     [("get_weather", '{"city":"Par')], None),                                 # cut off: what was generated
    ("hermes", 'x <tool_call>{"name": "f", "arguments": {"s": "a\nb"}}</tool_call> y', "x y", "",
     [("f", '{"s":"a\\nb"}')], None),                                          # raw newline in a string: escaped
    # DeepSeek R1
    ("deepseek_r1", f"Sure.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```"
                    f"{DS_CALL_END}\n{DS_CALL}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}",
     "Sure.", "", [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")], None),
    ("deepseek_r1", f"{DS_CALLS}oops{DS_CALLS_END}", f"{DS_CALLS}oops{DS_CALLS_END}", "", [], None),
    # DeepSeek V3.1
    ("deepseek_v3_1", f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"Paris\"}}{DS_CALL_END}"
                      f"{DS_CALL}get_time{DS_SEP}{{\"tz\": \"CET\"}}{DS_CALL_END}{DS_CALLS_END}",
     "", "", [("get_weather", '{"city":"Paris"}'), ("get_time", '{"tz":"CET"}')], None),
    ("deepseek_v3_1", f"I'll look.{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"New York\"}}{DS_CALL_END}"
                      f"{DS_CALLS_END}", "I'll look.", "", [("get_weather", '{"city":"New York"}')], None),
    # Kimi-K2 (ids are the model's)
    ("kimi_k2", 'Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>'
                '<|tool_calls_section_end|>', "Checking.", "",
     [("get_weather", '{"city":"Paris"}'), ("get_time", '{"tz":"CET"}')],
     ["functions.get_weather:0", "functions.get_time:1"]),
    ("kimi_k2", '<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>', "", "",
     [("get_time", "{}")], ["functions.get_time:0"]),                        # without the section markers
    # GLM-4.5/4.6 (values typed by the tool's schema)
    ("glm_4_5", 'Looking it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
                '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>', "Looking it up.", "",
     [("get_weather", '{"city":"Paris","days":3}')], None),
    ("glm_4_5", '<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>123</arg_value>\n</tool_call>'
                '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>', "", "",
     [("get_time", '{"tz":"123"}'), ("get_weather", '{"city":"Rome"}')], None),
    ("glm_4_5", '<tool_call>\n</tool_call> hi', '<tool_call>\n</tool_call> hi', "", [], None),
    # Qwen3-Coder
    ("qwen3_coder", 'Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n'
                    '<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>', "Let me see.", "",
     [("get_weather", '{"city":"San Francisco","days":2}')], None),
    # Llama 3.x
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", "",
     [("get_weather", '{"city":"Paris"}')], None),
    ("llama3", '{"type": "function", "name": "get_time", "parameters": {}}', "", "", [("get_time", "{}")], None),
    ("llama3", '<|python_tag|>brave_search.call(query="weather Paris", count=3)', "", "",
     [("brave_search", '{"query":"weather Paris","count":3}')], None),
    ("llama3", '{"answer": 42} is not a call', '{"answer": 42} is not a call', "", [], None),
    # gpt-oss (harmony)
    ("gpt_oss", '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>', "",
     "Need the weather.", [("get_weather", '{"city":"Paris"}')], None),
    ("gpt_oss", '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.', "Sunny.",
     "Easy.", [], None),
    # Mistral Nemo
    ("mistral_nemo", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]', "", "",
     [("get_weather", '{"city":"Paris"}')], ["abcDEF123"]),
    # generic (templates without tool calls)
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]}', "", "",
     [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")], None),
    ("generic", '{"tool_call": {"name": "get_time", "arguments": {"tz": "CET"}}}', "", "", [("get_time", '{"tz":"CET"}')],
     None),
    ("generic", '{"response": "Hello!"}', "Hello!", "", [], None),
    ("generic", 'Plain words.', "Plain words.", "", [], None),
    ("generic", '{"tool_calls": [{"name": "f"', '{"tool_calls": [{"name": "f"', "", [], None),   # cut off: content
]


@pytest.mark.parametrize("fmt,text,content,reasoning,calls,ids", CASES)
def test_parse_whole_answers(fmt, text, content, reasoning, calls, ids):
    msg = parse_message(text, fmt, tools=TOOLS)
    assert (msg.content, msg.reasoning, _calls(msg)) == (content, reasoning, calls)
    assert [c.id for c in msg.tool_calls] == (ids or [""] * len(calls))
    for c in msg.tool_calls:
        if not text.endswith('"Par'):        # the cut-off case has no complete JSON
            json.loads(c.arguments)


def _run_stream(text: str, fmt: str, cuts: list[int], **kw):
    """Feed `text` cut at `cuts` -> (content, reasoning, [(name, arguments)], [ids], deltas)."""
    n = iter(range(1000))
    st = ToolCallStream(fmt, new_id=lambda: f"id{next(n)}", **kw)
    deltas, last = [], 0
    for c in cuts + [len(text)]:
        deltas += st.feed(text[last:c])
        last = c
    deltas += st.finish()
    calls: dict[int, list] = {}
    for d in deltas:
        if d[0] == "tool_call":
            _, i, id_, name, frag = d
            if name is not None:
                assert i not in calls and i == len(calls) and frag == ""   # a new call: index in order, no args
                calls[i] = [name, "", id_]
            else:
                assert i in calls                                          # fragments follow their header
                calls[i][1] += frag
    return ("".join(d[1] for d in deltas if d[0] == "content"), "".join(d[1] for d in deltas if d[0] == "reasoning"),
            [(c[0], c[1]) for c in calls.values()], [c[2] for c in calls.values()], deltas)


@pytest.mark.parametrize("fmt,text,content,reasoning,calls,ids", CASES)
def test_stream_equals_whole_parse(fmt, text, content, reasoning, calls, ids):
    """Char by char, in tokens of 2-5 characters and at every single cut: the deltas add up to the
    whole parse; ids are the model's or new ones."""
    schedules = [list(range(1, len(text))), list(range(3, len(text), 3))]
    rng = random.Random(len(text))
    cuts, p = [], 0
    while p < len(text):
        p += rng.randint(2, 5)
        cuts.append(min(p, len(text)))
    schedules.append(cuts)
    schedules += [[k] for k in range(0, len(text), max(1, len(text) // 40))]
    for sched in schedules:
        got = _run_stream(text, fmt, sched, tools=TOOLS)
        assert got[:3] == (content, reasoning, calls), sched
        assert got[3] == (ids or [f"id{k}" for k in range(len(calls))])


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', '{"a": [1, "x"]}', "}", "\n", "hi ",
               "<tool", '"s"', '{"arguments": {}, "name": "g"}', "]", "{", "\\"],
    "deepseek_r1": [DS_CALLS, f"{DS_CALL}function{DS_SEP}f\n```json\n", '{"a": [1, "b"]}', "\n```", DS_CALL_END,
                    DS_CALLS_END, "text ", "\n", "<｜tool"],
    "deepseek_v3_1": [DS_CALLS, DS_CALL, f"f{DS_SEP}", '{"a": 1}', DS_CALL_END, DS_CALLS_END, "x", "\n"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0", "<|tool_call_argument_begin|>",
                '{"a":1}', "<|tool_call_end|>", "<|tool_calls_section_end|>", "hey ", " "],
    "glm_4_5": ["<tool_call>", "f\n", "<arg_key>", "k", "</arg_key>", "<arg_value>", "v", "12", "</arg_value>",
                "</tool_call>", "txt", "\n", " "],
    "qwen3_coder": ["<tool_call>", "<function=f>", "<parameter=k>", "\nv\n", "</parameter>", "</function>",
                    "</tool_call>", "t", "\n"],
    "llama3": ['{"name": "f", "parameters": ', '{"a": 1}', "}", "<|python_tag|>", "f.call(", 'q="x"', ")", "text", " ",
               "{", ","],
    "gpt_oss": ["<|channel|>", "analysis", "final", "commentary to=functions.f", " <|constrain|>json", "<|message|>",
                '{"a": 1}', "<|end|>", "<|call|>", "<|start|>assistant", "words ", " "],
    "mistral_nemo": ["[TOOL_CALLS]", '[{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}]', "[", "x", " "],
    "generic": ['{"tool_calls": [{"name": "f", "arguments": {}}]}', '{"response": "r"}', "{", "}", "x", " ", '"'],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_fuzz(fmt):
    """Random mixtures of markers, JSON pieces and text, cut at random: never an exception, and the
    stream always adds up to the whole parse."""
    rng = random.Random(sum(map(ord, fmt)))
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS[fmt]) for _ in range(rng.randint(1, 9)))
        whole = parse_message(text, fmt)
        cuts = sorted(rng.sample(range(1, max(2, len(text))), min(len(text) - 1, rng.randint(0, 12)))) \
            if len(text) > 1 else []
        got = _run_stream(text, fmt, cuts)
        assert got[:3] == (whole.content, whole.reasoning, _calls(whole)), text


def test_marker_starts_are_held_back():
    """While the text may still become a call marker nothing of it goes out; once it cannot, it does."""
    st = ToolCallStream("hermes")
    assert st.feed("Sure ") == [("content", "Sure")]          # trailing whitespace waits too
    assert st.feed("<tool") == []
    assert st.feed("s are") == [("content", " <tools are")]
    st = ToolCallStream("hermes", new_id=lambda: "X")
    out = []
    for ch in '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>':
        out += st.feed(ch)
        if ch == "{" and not out:
            continue
    assert out[0] == ("tool_call", 0, "X", "get_time", "")
    assert "".join(d[4] for d in out[1:]) == '{"tz":"CET"}'
    assert not any(d[0] == "content" for d in out)
    # DeepSeek: content before the section streams, the section waits for a call header
    st = ToolCallStream("deepseek_r1")
    assert st.feed("Hi" + DS_CALLS[:4]) == [("content", "Hi")]
    assert st.feed(DS_CALLS[4:] + DS_CALL + "funct") == []


def test_reasoning_then_calls():
    """<think> goes through the server's ReasoningSplit first; the calls come from the content."""
    answer = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning, content = split_reasoning(answer)
    msg = parse_message(content, "hermes")
    assert reasoning == "The user wants the weather." and msg.content == "" \
        and _calls(msg) == [("get_weather", '{"city":"Paris"}')]
    # streamed, one character at a time through both
    sp, st, parts = ReasoningSplit(), ToolCallStream("hermes"), []
    for ch in answer:
        for kind, t in sp.feed(ch):
            parts += st.feed(t) if kind == "content" else [(kind, t)]
    for kind, t in sp.finish():
        parts += st.feed(t) if kind == "content" else [(kind, t)]
    parts += st.finish()
    assert "".join(p[1] for p in parts if p[0] == "reasoning") == "The user wants the weather."
    assert not [p for p in parts if p[0] == "content"]
    assert "".join(p[4] for p in parts if p[0] == "tool_call") == '{"city":"Paris"}'
    # DeepSeek-R1 with a forced-open <think>
    answer = (f"Need a call.\n</think>\n\nChecking.{DS_CALLS}{DS_CALL}function{DS_SEP}get_time\n```json\n"
              f"{{\"tz\": \"CET\"}}\n```{DS_CALL_END}{DS_CALLS_END}")
    reasoning, content = split_reasoning(answer, forced_open=True)
    msg = parse_message(content, "deepseek_r1")
    assert (reasoning, msg.content, _calls(msg)) == ("Need a call.", "Checking.", [("get_time", '{"tz":"CET"}')])
    # gpt-oss keeps its analysis in the content when reasoning is not extracted
    text = '<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Ok.'
    assert parse_message(text, "gpt_oss", extract_reasoning=False).content == \
        "<|channel|>analysis<|message|>Hmm.<|end|>Ok."


def test_max_calls_and_checks():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
            '</tool_call>')
    assert _calls(parse_message(text, "hermes", max_calls=1)) == [("a", "{}")]
    assert _run_stream(text, "hermes", list(range(1, len(text))), max_calls=1)[2] == [("a", "{}")]
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_message("x", "bogus")
    assert normalize_tools([{"type": "function", "function": {"name": "f"}}]) == \
        [{"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}]
    for bad, msg in [({"a": 1}, "must be an array"), ([{"type": "code"}], "unsupported tool type"),
                     ([{"type": "function"}], "missing 'function'"),
                     ([{"type": "function", "function": {"name": ""}}], "'name'"),
                     ([{"type": "function", "function": {"name": "f", "parameters": []}}], "'parameters'")]:
        with pytest.raises(ValueError, match=msg):
            normalize_tools(bad)
    tools = normalize_tools(TOOLS)
    assert parse_tool_choice(None, tools) == ("auto", None)
    assert parse_tool_choice("required", tools) == ("required", None)
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools) == ("function", "get_time")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 3):
        with pytest.raises(ValueError):
            parse_tool_choice(bad, tools)
    assert preserved_tokens("kimi_k2")[0] == "<|tool_calls_section_begin|>" and preserved_tokens(None) == []


# ============================================================================ the real templates

EXPECTED_FORMAT = {
    "GLM-4.6.jinja": "glm_4_5", "Kimi-K2-Instruct.jinja": "kimi_k2", "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "Qwen-Qwen3-0.6B.jinja": "hermes", "Qwen3-Coder.jinja": "qwen3_coder",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek_r1", "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_v3_1",
    "google-gemma-2-2b-it.jinja": None, "llama-cpp-deepseek-r1.jinja": "deepseek_r1",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3", "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral_nemo",
    "openai-gpt-oss-120b.jinja": "gpt_oss",
}

ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "sunny, 21C"},
]

# what each template must show: the tools (its own way or the polyfill's), the call, the result
EXPECTED_TEXT = {
    "GLM-4.6.jinja": ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
                      "<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                      "<arg_value>Paris</arg_value>\n</tool_call>",
                      "<|observation|>\n<tool_response>\nsunny, 21C\n</tool_response><|assistant|>"],
    "Kimi-K2-Instruct.jinja": ['<|im_system|>tool_declare<|im_middle|>[{"type": "function"',
                               "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                               '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
                               "## Return of functions.get_weather:0\nsunny, 21C<|im_end|>"],
    "Qwen-Qwen2.5-7B-Instruct.jinja": ["<tools>\n" + json.dumps(WEATHER), '<|im_start|>assistant\n<tool_call>\n'
                                       '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                                       "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>"],
    "Qwen-Qwen3-0.6B.jinja": ["<tools>\n" + json.dumps(WEATHER), '<|im_start|>assistant\n<tool_call>\n'
                              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                              "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>"],
    "Qwen3-Coder.jinja": ["<function>\n<name>get_weather</name>",
                          "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                          "</tool_call><|im_end|>", "<tool_response>\nsunny, 21C\n</tool_response>"],
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": [
        "Be brief.\n\nYou can call any of the following tools to satisfy the user's requests: [",
        f"Example tool call syntax:\n\n{DS_CALLS}{DS_CALL}function{DS_SEP}tool_name\n```json\n"
        '{"arg1": "some_value"}\n```' + DS_CALL_END + DS_CALLS_END,
        f"<｜Assistant｜>{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{DS_CALL_END}",
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 21C<｜tool▁output▁end｜>"],
    "deepseek-ai-DeepSeek-V3.1.jinja": [
        "You can call any of the following tools to satisfy the user's requests: [",
        f"{DS_CALLS}{DS_CALL}tool_name{DS_SEP}{{\"arg1\": \"some_value\"}}{DS_CALL_END}",
        f"<think></think>{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"Paris\"}}{DS_CALL_END}{DS_CALLS_END}",
        "<｜tool▁output▁begin｜>sunny, 21C<｜tool▁output▁end｜>"],
    "google-gemma-2-2b-it.jinja": [
        "<start_of_turn>user\nBe brief.\n\n" + GENERIC_INSTRUCTION,
        '<start_of_turn>model\n{\n  "tool_calls": [\n    {\n      "name": "get_weather",\n      "arguments": {\n'
        '        "city": "Paris"\n      },\n      "id": "call12345"\n    }\n  ]\n}<end_of_turn>',
        '<start_of_turn>user\n{\n  "tool_response": {\n    "tool": "get_weather",\n    "content": "sunny, 21C",',
        "<start_of_turn>model\n"],
    "llama-cpp-deepseek-r1.jinja": [
        "You can call any of the following function tools to satisfy the user's requests: [\n  {\n    \"name\": "
        "\"get_weather\"",
        f"<｜Assistant｜>{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```",
        "<｜tool▁output▁begin｜>sunny, 21C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"],
    "meta-llama-Llama-3.3-70B-Instruct.jinja": [
        "Environment: ipython\n", 'Given the following functions, please respond with a JSON for a function call',
        '"name": "get_weather"',
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21C"<|eot_id|>'],
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": [
        '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]',
        '[TOOL_RESULTS]{"content": sunny, 21C, "call_id": "call12345"}[/TOOL_RESULTS]'],
    "openai-gpt-oss-120b.jinja": [
        "// Current weather of a city\ntype get_weather = (_: {\ncity: string,\ndays?: number,\n}) => any;",
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny, 21C"<|end|><|start|>assistant'],
}


def _template(name: str) -> str:
    p = TEMPLATES / name
    if not p.is_file():
        pytest.skip(f"template {name} not in {TEMPLATES}")
    return p.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(EXPECTED_FORMAT))
def test_real_templates_render_tools_requests(name):
    tmpl = _template(name)
    assert detect_format(tmpl) == EXPECTED_FORMAT[name]
    text, used = render_chat(ROUND_TRIP, tmpl, "<BOS>", "<EOS>", True, tools=normalize_tools(TOOLS))
    assert used == "gguf"
    for needle in EXPECTED_TEXT[name]:
        assert needle in text, (needle, text[-1500:])
    assert "None" not in text          # a null content never comes out as text
    # no tools: no tools in the prompt (and the Qwen/GLM/Kimi templates then drop their tool section)
    plain, _ = render_chat(ROUND_TRIP[:2], tmpl, "<BOS>", "<EOS>", True)
    assert "get_weather" not in plain


def test_template_capabilities_and_argument_objects():
    caps = {n: tool_caps(_template(n)) for n in EXPECTED_FORMAT}
    assert caps["openai-gpt-oss-120b.jinja"].object_arguments and caps["GLM-4.6.jinja"].object_arguments
    assert not caps["Kimi-K2-Instruct.jinja"].object_arguments       # it writes the string as it is
    assert not caps["deepseek-ai-DeepSeek-V3.1.jinja"].tools and caps["deepseek-ai-DeepSeek-V3.1.jinja"].tool_calls
    assert tuple(caps["google-gemma-2-2b-it.jinja"])[:4] == (False, False, False, False)
    # arguments that are no JSON, where the template needs an object: a clear error
    bad = [ROUND_TRIP[1], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\]: 'arguments' is not valid JSON"):
        render_chat(bad, _template("GLM-4.6.jinja"), tools=normalize_tools(TOOLS))
    # an object given where the template concatenates a string: written as JSON text
    obj = [ROUND_TRIP[1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    text, _ = render_chat(obj, _template("Kimi-K2-Instruct.jinja"))
    assert '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>' in text


def test_chatml_fallback_uses_the_generic_format():
    text, used = render_chat(ROUND_TRIP, None, tools=normalize_tools([WEATHER]))
    assert used == "chatml"
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + GENERIC_INSTRUCTION + "\n\nYou can call any of")
    assert '"tool_calls": [\n    {\n      "name": "get_weather"' in text
    assert '<|im_start|>user\n{\n  "tool_response": {' in text and text.endswith("<|im_start|>assistant\n")


# ============================================================================ HTTP, fake engine

QWEN_ANSWER = ('<think>\nI need the weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
               '{"tz": "Europe/Paris"}}\n</tool_call>')
CALLS_ONLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ID = re.compile(r"[A-Za-z0-9]{32}")


class ToolFake(FakeEngine):
    """The fake engine answering `answer`, with a context that fits real templates' prompts."""

    def __init__(self, answer: str, **kw) -> None:
        super().__init__(n_parallel=2, n_ctx_slot=8192, delay=0.0002, answer=answer, **kw)

    def last_prompt(self) -> str:
        return self.detokenize(self.submitted[-1][0])


@pytest.fixture(scope="module")
def qwen():
    eng = ToolFake(QWEN_ANSWER)
    srv = ServerThread(create_app(eng, model_path="/m/qwen.gguf", log_requests=False,
                                  chat_template=_template("Qwen-Qwen3-0.6B.jinja")))
    yield SimpleNamespace(engine=eng, base=srv.base)
    srv.stop()


def _chat(base: str, **body) -> dict:
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Weather?"}], **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_http_non_streamed_tool_calls(qwen):
    d = _chat(qwen.base, tools=TOOLS)
    choice = d["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check." and msg["reasoning_content"] == "I need the weather."
    calls = msg["tool_calls"]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city":"Paris"}'},
                                              {"name": "get_time", "arguments": '{"tz":"Europe/Paris"}'}]
    assert all(c["type"] == "function" and ID.fullmatch(c["id"]) for c in calls) and calls[0]["id"] != calls[1]["id"]
    # the template got the tools
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in qwen.engine.last_prompt()
    # only calls: content null; parallel_tool_calls false: the first call only
    qwen.engine.answer = CALLS_ONLY + "\n" + CALLS_ONLY.replace("Paris", "Oslo")
    try:
        msg = _chat(qwen.base, tools=TOOLS)["choices"][0]["message"]
        assert msg["content"] is None and len(msg["tool_calls"]) == 2
        msg = _chat(qwen.base, tools=TOOLS, parallel_tool_calls=False)["choices"][0]["message"]
        assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"city":"Paris"}']
        # tool_choice "none": no tools in the prompt, no parsing
        d = _chat(qwen.base, tools=TOOLS, tool_choice="none")
        assert "<tools>" not in qwen.engine.last_prompt()
        assert d["choices"][0]["message"]["content"].startswith("<tool_call>") and d["choices"][0]["finish_reason"] == "stop"
        # required / a named function: accepted (not enforced)
        for tc in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            assert _chat(qwen.base, tools=TOOLS, tool_choice=tc)["choices"][0]["finish_reason"] == "tool_calls"
        # no tools: the answer is text, as before
        d = _chat(qwen.base)
        assert "tool_calls" not in d["choices"][0]["message"] and d["choices"][0]["finish_reason"] == "stop"
        # max_tokens cuts the call: it keeps what was generated, finish_reason length
        d = _chat(qwen.base, tools=TOOLS, max_tokens=60)
        assert d["choices"][0]["finish_reason"] == "length"
        assert d["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"P'   # 60 characters in
    finally:
        qwen.engine.answer = QWEN_ANSWER


def test_http_streamed_tool_calls(qwen):
    events = stream_post(qwen.base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "stream": True})
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finish[-1] == "tool_calls" and set(finish[:-1]) == {None}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need the weather."
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(content) == "Let me check." and not any("<" in c for c in content)
    tc = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    heads = [t for t in tc if "id" in t]
    assert [(h["index"], h["type"], h["function"]) for h in heads] == [
        (0, "function", {"name": "get_weather", "arguments": ""}), (1, "function", {"name": "get_time", "arguments": ""})]
    assert all(ID.fullmatch(h["id"]) for h in heads)
    args = {0: "", 1: ""}
    for t in tc:
        if "id" not in t:
            assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
            args[t["index"]] += t["function"]["arguments"]
    assert args == {0: '{"city":"Paris"}', 1: '{"tz":"Europe/Paris"}'}
    assert len([t for t in tc if "id" not in t]) > 4          # the arguments came in pieces


def test_http_tool_request_errors(qwen):
    url = qwen.base + "/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for body, contains in [
        ({"tools": {"type": "function"}}, "'tools' must be an array"),
        ({"tools": [{"type": "retrieval"}]}, "unsupported tool type"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "'name'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "Invalid tool_choice: always"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "grammar": 'root ::= "a"'}, "Cannot use custom grammar constraints with tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "Cannot use custom grammar constraints with tools"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"arguments": "{}"}}]}], "tools": TOOLS}, "'name'"),
    ]:
        assert_error(httpx.post(url, json={**base, **body}), 400, contains=contains)
    r = httpx.post(qwen.base + "/apply-template", json={**base, "tools": TOOLS})
    assert r.status_code == 200 and "<tool_call>" in r.json()["prompt"] and "get_time" in r.json()["prompt"]


def test_builtin_template_refuses_tools():
    eng = ToolFake("x")
    srv = ServerThread(create_app(eng, model_path="/m/x.gguf", log_requests=False, chat_template="chatml",
                                  render_chat=builtin_renderer("chatml")))
    try:
        r = httpx.post(srv.base + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
        assert_error(r, 400, contains="need a Jinja chat template")
        assert _chat(srv.base)["choices"][0]["message"]["content"] == "x"   # without tools: served
    finally:
        srv.stop()


def test_openai_client_round_trip(qwen):
    """The official client: tools -> tool_calls -> the tool's result appended -> the next prompt
    shows the call and the result in Qwen3's own syntax; streamed calls reassemble in the client."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=qwen.base + "/v1", api_key="sk-none", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    qwen.engine.answer = CALLS_ONLY
    try:
        out = client.chat.completions.create(model="x", messages=messages, tools=TOOLS)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"})
        qwen.engine.answer = "It is sunny in Paris."
        out = client.chat.completions.create(model="x", messages=messages, tools=TOOLS)
        assert out.choices[0].message.content == "It is sunny in Paris." and out.choices[0].finish_reason == "stop"
        prompt = qwen.engine.last_prompt()
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n'
                '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n'
                '<|im_start|>assistant\n') in prompt
        # streamed through the client
        qwen.engine.answer = QWEN_ANSWER
        calls: dict = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(model="x", messages=messages[:1], tools=TOOLS, stream=True):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                c = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = t.id or c["id"]
                c["name"] = (t.function.name if t.function and t.function.name else None) or c["name"]
                c["arguments"] += (t.function.arguments or "") if t.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert content == "Let me check." and finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    finally:
        qwen.engine.answer = QWEN_ANSWER


@pytest.mark.parametrize("template,answer,content,reasoning", [
    ("llama-cpp-deepseek-r1.jinja",
     f"Let me think.\n</think>\n\nChecking.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
     f"{{\"city\": \"Paris\"}}\n```{DS_CALL_END}{DS_CALLS_END}", "Checking.", "Let me think."),
    ("GLM-4.6.jinja", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
     None, None),
    ("Kimi-K2-Instruct.jinja", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
     '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', None, None),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, None),
])
def test_http_other_families(template, answer, content, reasoning):
    eng = ToolFake(answer)
    srv = ServerThread(create_app(eng, model_path="/m/x.gguf", log_requests=False, chat_template=_template(template)))
    try:
        msg = _chat(srv.base, tools=TOOLS)["choices"][0]["message"]
        assert msg["content"] == content and msg.get("reasoning_content") == reasoning
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
            [("get_weather", '{"city":"Paris"}')]
        if template.startswith("Kimi"):
            assert msg["tool_calls"][0]["id"] == "functions.get_weather:0"      # the model's own id
        events = stream_post(srv.base, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == (content or "")
        assert "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", [])) == \
            '{"city":"Paris"}'
    finally:
        srv.stop()


class PreservingFake(ToolFake):
    """An engine that can write control tokens out as text (submit takes preserved_tokens); its
    tokenizer knows Kimi's markers as single tokens."""
    MARKERS = {m: 1000 + i for i, m in enumerate(preserved_tokens("kimi_k2"))}

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return [self.MARKERS[text]] if text in self.MARKERS else super().tokenize(text, add_special)

    def submit(self, prompt, params, n_predict, stop, on_event, cache_prompt=True, preserved_tokens=None):
        self.preserved = preserved_tokens
        return super().submit(prompt, params, n_predict, stop, on_event, cache_prompt)


def test_preserved_tokens_reach_an_engine_that_takes_them():
    eng = PreservingFake("plain")
    srv = ServerThread(create_app(eng, model_path="/m/x.gguf", log_requests=False,
                                  chat_template=_template("Kimi-K2-Instruct.jinja")))
    try:
        _chat(srv.base, tools=TOOLS)
        assert eng.preserved == list(PreservingFake.MARKERS.values())
        _chat(srv.base)
        assert eng.preserved is None                   # no tools: nothing to preserve
    finally:
        srv.stop()


def test_anthropic_messages_tools(qwen):
    tools = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER["function"]["parameters"]}]
    body = {"model": "x", "max_tokens": 400, "tools": tools, "messages": [{"role": "user", "content": "Weather?"}]}
    d = httpx.post(qwen.base + "/v1/messages", json=body, timeout=60).json()
    assert d["stop_reason"] == "tool_use"
    text, *uses = d["content"]
    assert text["type"] == "text" and "Let me check." in text["text"]
    assert [(u["type"], u["name"], u["input"]) for u in uses] == [("tool_use", "get_weather", {"city": "Paris"}),
                                                                  ("tool_use", "get_time", {"tz": "Europe/Paris"})]
    assert all(ID.fullmatch(u["id"]) for u in uses)
    # streamed: a text block, then one tool_use block per call with its input in JSON pieces
    with httpx.stream("POST", qwen.base + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    pieces = {1: "", 2: ""}
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            pieces[e["index"]] += e["delta"]["partial_json"]
    assert [json.loads(v) for v in pieces.values()] == [{"city": "Paris"}, {"tz": "Europe/Paris"}]
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    # the history: tool_use and tool_result blocks render as Qwen3's call and result
    history = {"model": "x", "max_tokens": 10, "tools": tools, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]}]}
    r = httpx.post(qwen.base + "/v1/messages", json=history, timeout=60)
    assert r.status_code == 200, r.text
    prompt = qwen.engine.last_prompt()
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n'
            '<|im_start|>user\nAnd tomorrow?<|im_end|>') in prompt
    for bad, contains in [({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "input_schema"),
                          ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
                          ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image")]:
        assert_error(httpx.post(qwen.base + "/v1/messages", json={**body, **bad}), 400, contains=contains)
    d = httpx.post(qwen.base + "/v1/messages", json={**body, "tool_choice": {"type": "none"}}, timeout=60).json()
    assert d["stop_reason"] == "end_turn" and [b["type"] for b in d["content"]] == ["text"]


# ============================================================================ the real server

def _serving_available() -> str:
    try:
        import engine.serving  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"engine.serving is not usable ({type(e).__name__}: {e})"
    from ikcli.defaults import demo_model
    return "" if os.path.exists(demo_model()) else "the embedded demo model is missing"


@pytest.fixture(scope="module")
def demo():
    """`ikcli server` on the demo model (no chat template: ChatML with the generic tool format);
    a context large enough for the tool descriptions."""
    if _serving_available():
        pytest.skip(_serving_available())
    s = launch_server("-c", "2048", "-np", "1", "-t", "1", timeout=90)
    yield s.base
    assert stop_server(s) == 0


def test_real_server_takes_tools(demo):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=demo + "/v1", api_key="sk-none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = httpx.post(demo + "/apply-template", json={"messages": messages, "tools": TOOLS})
    prompt = r.json()["prompt"]
    assert prompt.startswith("<|im_start|>system\n" + GENERIC_INSTRUCTION) and '"name": "get_time"' in prompt
    out = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, max_tokens=12, seed=3)
    ch = out.choices[0]
    # the demo model writes no JSON: its words are the content, as the same request without tools gives
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, seed=3)
    assert ch.message.tool_calls is None and ch.finish_reason == "length"
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="demo", messages=messages, tools=TOOLS, max_tokens=12, seed=3, stream=True) if c.choices)
    assert text == ch.message.content
    # a round trip's history renders as the generic format's JSON
    messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = httpx.post(demo + "/apply-template", json={"messages": messages, "tools": TOOLS}).json()["prompt"]
    assert '<|im_start|>assistant\n{\n  "tool_calls": [' in prompt and '"tool_response": {' in prompt
    out = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason == "length"
