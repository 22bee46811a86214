"""Grammars that hold a chat answer to its template's tool-call syntax (tool_choice), as llama-server
builds them (common/chat.cpp: a grammar per format, lazy for "auto" with its triggers).

    tool_grammar(fmt, tools, mode, function, parallel, special_id=..., think=...) -> ToolGrammar | None

The grammar is llguidance Lark (engine.grammar): each call's arguments are a `%json` rule of the
tool's `parameters` schema (llama.cpp's conventions: listed properties only, its whitespace rule),
so a call that comes out parses (engine.tool_calls) into arguments that validate against the schema.

  * mode "required": the answer is one or more calls (one when parallel_tool_calls is false);
  * mode "function": the same with only the named tool (llama-server reads tool_choice only as a
    string and takes an object as "auto"; OpenAI's API forces that call, which this does);
  * mode "auto": lazy (llama.cpp's grammar_lazy): free text until a trigger of the format (its
    call-section marker, or llama-server's patterns), the calls constrained from there to the end.

`special_id(text)` says when a marker is one special token of the model's vocabulary (llguidance
never matches grammar text against those: the grammar names the token, `<[id]>`); otherwise the
marker is grammar text.  `think`: "" (the answer starts with the calls), "optional" (a
`<think>...</think>` block may come first) or "forced" (the prompt opened the reasoning: its text and
`</think>` come first); the required grammars allow it, as llama-server's reasoning-aware ones do.

Formats: hermes, qwen3_coder, deepseek_r1, deepseek_v3_1, kimi_k2, glm_4_5, llama3 (the JSON call
and `<|python_tag|>` + JSON; not the `NAME.call(...)` form), gpt_oss, mistral_nemo, generic.  For the
XML formats (GLM-4.5, Qwen3-Coder) a value of a non-string parameter is `%json` of its schema and a
string value is free text (an enum's values are fixed), parameters in schema order, required ones
present; a string's pattern / length is not enforced there.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .grammar import TRIGGER_PATTERN, TRIGGER_PATTERN_FULL, TRIGGER_WORD, schema_lark

__all__ = ["ToolGrammar", "tool_grammar", "CONSTRAINED_FORMATS"]

CONSTRAINED_FORMATS = ("hermes", "qwen3_coder", "deepseek_r1", "deepseek_v3_1", "kimi_k2", "glm_4_5", "llama3",
                       "gpt_oss", "mistral_nemo", "generic")

# llama.cpp's json-schema-to-grammar space rule, between markers and JSON
_SPACE = r"/(?: |\n{1,2}[ \t]{0,20})/"
_DS_BEGINS = ["<｜tool▁calls▁begin｜>", "<｜tool_calls_begin｜>", "<｜tool calls begin｜>", "<｜tool\\_calls\\_begin｜>",
              "<｜tool▁calls｜>"]


@dataclass
class ToolGrammar:
    """What a chat request's sampler gets: the grammar, whether it is lazy, and its triggers in
    llama-server's JSON form ({"type": 1 word | 2 pattern | 3 full pattern, "value": ...})."""
    grammar: str
    lazy: bool
    triggers: list[dict] = field(default_factory=list)


def _str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _rx(text: str) -> str:
    """text as a literal inside a Lark /regex/."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/])", r"\\\1", text).replace("\n", r"\n").replace("\t", r"\t")


class _Lark:
    """Rules of one grammar, named as they are added."""

    def __init__(self, special_id: Callable[[str], Optional[int]]) -> None:
        self.special_id = special_id
        self.rules: list[str] = []
        self.n = 0

    def rule(self, body: str, prefix: str = "r") -> str:
        self.n += 1
        name = f"{prefix}_{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def lexeme(self, body: str) -> str:
        self.n += 1
        name = f"T_{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def lit(self, text: str) -> str:
        """A marker: the special token's reference when it is one, else its text."""
        tid = self.special_id(text)
        return f"<[{tid}]>" if tid is not None else _str(text)

    def until(self, marker: str, max_len: Optional[int] = None, newlines: bool = False) -> str:
        """Any text (at most max_len characters, and with `newlines` a newline before and after
        them), then `marker` (which the text does not contain)."""
        body = "(?s:.)*" if max_len is None else f"(?s:.){{0,{int(max_len)}}}"
        if newlines and max_len is not None:
            body = rf"\n?{body}\n?"
        tid = self.special_id(marker)
        if tid is not None:          # text never matches a special token: plain text, then the token
            return f"{self.lexeme('/' + body + '/ & /(?s:.)+/')}? <[{tid}]>"
        # one lexeme for text and marker: llguidance's lexer does not backtrack between lexemes
        m = _rx(marker)
        return self.lexeme(f"/{body}{m}/ & ~/(?s:.)*{m}(?s:.)+/")

    def json(self, schema: Any) -> str:
        return self.rule(schema_lark(schema if isinstance(schema, dict) else {}), "json")

    def text(self, start: str) -> str:
        return "%llguidance {}\n" + f"start: {start}\n" + "\n".join(self.rules) + "\n"


def _fn(tool: dict) -> tuple[str, dict]:
    fn = tool.get("function", {})
    params = fn.get("parameters")
    return fn["name"], params if isinstance(params, dict) else {}


def _repeat(L: _Lark, call: str, parallel: bool, sep: str = "") -> str:
    """One call, or one or more (parallel), `sep` (optional) between them."""
    if not parallel:
        return call
    return L.rule(f"{call} ({sep + '? ' if sep else ''}{call})*")


def _think(L: _Lark, think: str) -> str:
    if think == "forced":
        return f"{L.until('</think>')} {_SPACE}? "
    if think == "optional":
        return f"({L.lit('<think>')} {L.until('</think>')} {_SPACE}?)? "
    return ""


def _call_object(name: str, params: dict, args_key: str = "arguments", extra: Optional[dict] = None) -> dict:
    props: dict = {"name": {"const": name}, args_key: params or {"type": "object"}}
    required = ["name", args_key]
    for k, v in (extra or {}).items():
        props[k] = v
        required.append(k)
    return {"type": "object", "properties": props, "required": required}


# ------------------------------------------------------------------------------- the formats

def _hermes(L: _Lark, tools: list, parallel: bool) -> str:
    o, c = L.lit("<tool_call>"), L.lit("</tool_call>")
    calls = [f"{o} {_SPACE}? {L.json(_call_object(*_fn(t)))} {_SPACE}? {c}" for t in tools]
    return _repeat(L, L.rule(" | ".join(calls), "call"), parallel, _SPACE)


def _section(L: _Lark, begins: list[str], calls: list[str], end: str, parallel: bool) -> str:
    begin = " | ".join(L.lit(b) for b in begins)
    body = _repeat(L, L.rule(" | ".join(calls), "call"), parallel, _SPACE)
    return f"({begin}) {_SPACE}? {body} {_SPACE}? {L.lit(end)}"


def _deepseek_r1(L: _Lark, tools: list, parallel: bool) -> str:
    cb, sep, ce = L.lit("<｜tool▁call▁begin｜>"), L.lit("<｜tool▁sep｜>"), L.lit("<｜tool▁call▁end｜>")
    calls = [f'{cb} "function" {sep} {_str(n + chr(10) + "```json" + chr(10))} {L.json(p)} {_SPACE}? "```" {ce}'
             for n, p in map(_fn, tools)]
    return _section(L, _DS_BEGINS, calls, "<｜tool▁calls▁end｜>", parallel)


def _deepseek_v3_1(L: _Lark, tools: list, parallel: bool) -> str:
    cb, sep, ce = L.lit("<｜tool▁call▁begin｜>"), L.lit("<｜tool▁sep｜>"), L.lit("<｜tool▁call▁end｜>")
    calls = [f"{cb} {_str(n)} {sep} {L.json(p)} {ce}" for n, p in map(_fn, tools)]
    return _section(L, _DS_BEGINS, calls, "<｜tool▁calls▁end｜>", parallel)


def _kimi_k2(L: _Lark, tools: list, parallel: bool) -> str:
    cb, ab, ce = L.lit("<|tool_call_begin|>"), L.lit("<|tool_call_argument_begin|>"), L.lit("<|tool_call_end|>")
    idx = L.lexeme("/[0-9]{1,4}/")
    calls = [f"{cb} {_str('functions.' + n + ':')} {idx} {ab} {L.json(p)} {ce}" for n, p in map(_fn, tools)]
    return _section(L, ["<|tool_calls_section_begin|>"], calls, "<|tool_calls_section_end|>", parallel)


def _is_string(spec: Any) -> bool:
    t = spec.get("type") if isinstance(spec, dict) else None
    return t == "string" or (isinstance(t, list) and bool(t) and all(x in ("string", "null") for x in t))


def _xml_params(L: _Lark, params: dict, item: Callable[[str, str, Optional[int]], str]) -> str:
    """The parameters of an XML-format call in schema order (required ones present); any keys with
    free values when the schema lists no properties.  item(key rule text, value rule or "" for free
    text, the free text's maxLength) -> one pair."""
    props = params.get("properties") if isinstance(params.get("properties"), dict) else None
    if not props:
        key = L.lexeme(r"/[A-Za-z0-9_.\-]+/")
        return f"({item(key, '', None)})*"
    required = set(params.get("required") or [])
    parts = []
    for k, spec in props.items():
        spec = spec if isinstance(spec, dict) else {}
        enum = spec.get("enum") if isinstance(spec.get("enum"), list) else None
        if not _is_string(spec) and not (enum and all(isinstance(v, str) for v in enum)):
            pair = item(_str(k), L.json(spec), None)
        elif enum:
            pair = item(_str(k), " | ".join(_str(v) for v in enum), None)
        else:
            n = spec.get("maxLength")
            pair = item(_str(k), "", n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None)
        parts.append(pair if k in required else f"({pair})?")
    return " ".join(parts) if parts else '""'


def _glm_4_5(L: _Lark, tools: list, parallel: bool) -> str:
    o, c = L.lit("<tool_call>"), L.lit("</tool_call>")
    ko, kc, vo, vc = (L.lit(m) for m in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))

    def item(key: str, value: str, max_len: Optional[int]) -> str:
        # the value as it is (the parser keeps a string value's text untouched)
        v = f"({value}) {vc}" if value else L.until("</arg_value>", max_len)
        return f"{ko} {key} {kc} {_SPACE}? {vo} {v} {_SPACE}?"

    calls = [f"{o} {_str(n)} {_SPACE}? {_xml_params(L, p, item)} {c}" for n, p in map(_fn, tools)]
    return _repeat(L, L.rule(" | ".join(calls), "call"), parallel, _SPACE)


def _qwen3_coder(L: _Lark, tools: list, parallel: bool) -> str:
    o, c = L.lit("<tool_call>"), L.lit("</tool_call>")
    fo, fc, po, pc = (L.lit(m) for m in ("<function=", "</function>", "<parameter=", "</parameter>"))

    def item(key: str, value: str, max_len: Optional[int]) -> str:
        # the parser strips the value: a newline around it is free (beyond maxLength)
        v = f"{_SPACE}? ({value}) {_SPACE}? {pc}" if value else \
            L.until("</parameter>", max_len, newlines=True)
        return f'{po} {key} ">" {v} {_SPACE}?'

    calls = [f'{o} {_SPACE}? {fo} {_str(n + ">")} {_SPACE}? {_xml_params(L, p, item)} {fc} {_SPACE}? {c}'
             for n, p in map(_fn, tools)]
    return _repeat(L, L.rule(" | ".join(calls), "call"), parallel, _SPACE)


def _llama3(L: _Lark, tools: list) -> str:
    """One call: the JSON object {"name", "parameters"} (optionally "type": "function" first), also
    after <|python_tag|>."""
    objs = []
    for n, p in map(_fn, tools):
        o = _call_object(n, p, "parameters")
        o["properties"] = {"type": {"const": "function"}, **o["properties"]}
        objs.append(L.json(o))
    call = L.rule(" | ".join(objs), "call")
    return f"({L.lit('<|python_tag|>')} {_SPACE}?)? {call}"


def _gpt_oss(L: _Lark, tools: list, lazy: bool) -> str:
    """harmony: a call is `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`
    (or the recipient in the role header: ` to=functions.NAME<|channel|>commentary json<|message|>`);
    required: analysis / commentary messages may come first, each ended by <|end|><|start|>assistant."""
    ch, msg = L.lit("<|channel|>"), L.lit("<|message|>")
    kind = '("commentary" | "analysis")'
    ws = L.lexeme(r"/[ \t\n]{1,8}/")
    ctype = L.lexeme(r"/[A-Za-z0-9_\-]{1,16}/")
    cons = L.lit("<|constrain|>")
    constraint = f"(({ws} {cons}? | {cons}) {ctype})?"
    calls = []
    for n, p in map(_fn, tools):
        to = f'{ws} {_str("to=functions." + n)}'
        args = L.json(p)
        calls.append(f"{to} {ch} {kind} {constraint} {msg} {args} {L.lit('<|call|>')}?")
        calls.append(f"{ch} {kind} {to} {constraint} {msg} {args} {L.lit('<|call|>')}?")
    call = L.rule(" | ".join(calls), "call")
    if lazy:
        return call
    start = L.lit("<|start|>")
    # ik's stray "<|channel|>commentary" before an analysis channel is allowed too
    message = L.rule(f'({ch} "commentary" ({ws} "to=assistant")?)? {ch} "analysis" {msg} {L.until("<|end|>")}'
                     f' | {ch} "commentary" {msg} {L.until("<|end|>")}', "msg")
    return f'({message} {start} "assistant")* {call}'


def _mistral_nemo(L: _Lark, tools: list, parallel: bool) -> str:
    ids = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
    items = [_call_object(n, p, extra={"id": ids}) for n, p in map(_fn, tools)]
    arr: dict = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        arr["maxItems"] = 1
    return f"{L.lit('[TOOL_CALLS]')} {_SPACE}? {L.json(arr)}"


def _generic(L: _Lark, tools: list, parallel: bool, with_response: bool) -> str:
    """llama.cpp's generic format: {"tool_call": {...}} / {"tool_calls": [...]} (an id per call when
    parallel), or, for "auto", {"response": "..."}."""
    calls = []
    for n, p in map(_fn, tools):
        calls.append(_call_object(n, p, extra={"id": {"type": "string", "minLength": 4}} if parallel else None))
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    wrap = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
             "required": ["tool_calls"]} if parallel else
            {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"]})
    if with_response:
        wrap = {"anyOf": [wrap, {"type": "object", "properties": {"response": {"type": "string"}},
                                 "required": ["response"]}]}
    return L.json(wrap)


# each format's call grammar: (L, tools, parallel, lazy) -> body (every builder gets the same four)
_BODIES: dict[str, Callable[[_Lark, list, bool, bool], str]] = {
    "hermes": lambda L, t, par, lazy: _hermes(L, t, par),
    "deepseek_r1": lambda L, t, par, lazy: _deepseek_r1(L, t, par),
    "deepseek_v3_1": lambda L, t, par, lazy: _deepseek_v3_1(L, t, par),
    "kimi_k2": lambda L, t, par, lazy: _kimi_k2(L, t, par),
    "glm_4_5": lambda L, t, par, lazy: _glm_4_5(L, t, par),
    "qwen3_coder": lambda L, t, par, lazy: _qwen3_coder(L, t, par),
    "llama3": lambda L, t, par, lazy: _llama3(L, t),
    "gpt_oss": lambda L, t, par, lazy: _gpt_oss(L, t, lazy),
    "mistral_nemo": lambda L, t, par, lazy: _mistral_nemo(L, t, par),
    "generic": lambda L, t, par, lazy: _generic(L, t, par, with_response=lazy),
}


# llama-server's triggers of the lazy ("auto") grammars: where the calls begin
_TRIGGERS: dict[str, list[dict]] = {
    "hermes": [{"type": TRIGGER_WORD, "value": "<tool_call>"}],
    "qwen3_coder": [{"type": TRIGGER_WORD, "value": "<tool_call>"}],
    "glm_4_5": [{"type": TRIGGER_WORD, "value": "<tool_call>"}],
    "deepseek_r1": [{"type": TRIGGER_WORD, "value": w} for w in _DS_BEGINS],
    "deepseek_v3_1": [{"type": TRIGGER_WORD, "value": w} for w in _DS_BEGINS],
    "kimi_k2": [{"type": TRIGGER_WORD, "value": "<|tool_calls_section_begin|>"}],
    "mistral_nemo": [{"type": TRIGGER_WORD, "value": "[TOOL_CALLS]"}],
    "llama3": [{"type": TRIGGER_PATTERN_FULL,
                "value": r'\s*(\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*")[\s\S]*'},
               {"type": TRIGGER_WORD, "value": "<|python_tag|>"}],
    "gpt_oss": [{"type": TRIGGER_PATTERN, "value": r"^\s+to$"},
                {"type": TRIGGER_PATTERN, "value": r"^<\|channel\|>(?:commentary|analysis)\s+to=functions$"},
                {"type": TRIGGER_PATTERN, "value": r"<\|start\|>assistant(\s+to)"},
                {"type": TRIGGER_PATTERN, "value": r"<\|start\|>assistant(<\|channel\|>(?:commentary|analysis)\s+to)"}],
    # the answer is JSON or it is text: constrained once it opens an object
    "generic": [{"type": TRIGGER_PATTERN_FULL, "value": r"\s*(\{)[\s\S]*"}],
}


def tool_grammar(fmt: str, tools: list[dict], mode: str, function: Optional[str] = None, parallel: bool = True, *,
                 special_id: Optional[Callable[[str], Optional[int]]] = None, think: str = "") -> Optional[ToolGrammar]:
    """The grammar for tool_choice `mode` ("auto", "required", "function" with its name) over
    normalized `tools` in format `fmt` (engine.tool_calls.FORMATS); None for mode "none", no tools,
    or a format this module does not constrain."""
    if mode not in ("auto", "required", "function") or not tools or fmt not in CONSTRAINED_FORMATS:
        return None
    if mode == "function":
        tools = [t for t in tools if t.get("function", {}).get("name") == function]
        if not tools:
            return None
    lazy = mode == "auto"
    L = _Lark(special_id or (lambda text: None))
    body = _BODIES[fmt](L, tools, parallel, lazy)
    if not lazy and fmt not in ("gpt_oss", "generic", "llama3"):
        body = _think(L, think) + body
    elif not lazy and fmt == "llama3":
        body = f"{_SPACE}? {body}"
    return ToolGrammar(L.text(body), lazy, [dict(t) for t in _TRIGGERS[fmt]] if lazy else [])
