"""Tool calls of chat models: the native formats, and parsers from model text to OpenAI tool calls.

What this module holds (pure functions and classes, no HTTP):

* :func:`normalize_tools` / :func:`parse_tool_choice`: OpenAI ``tools`` / ``tool_choice`` checked
  and put in the shape llama.cpp hands to chat templates;
* :func:`detect_format`: which family of tool-call syntax a chat template uses, picked from marker
  strings in the template text as llama.cpp's common/chat.cpp does (``None``: no known family, the
  caller then uses the ``generic`` JSON format);
* :func:`parse_message`: a whole answer -> :class:`ParsedMessage` (content, reasoning, tool calls);
* :class:`ToolCallStream`: the same, fed piece by piece, giving OpenAI-style deltas (new call with
  id and name, then argument fragments); text that may still become a call marker is held back.

Families (the model's syntax):

``hermes``         Qwen2.5/Qwen3/Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
``qwen3_coder``    ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``
``deepseek_r1``    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...``
``deepseek_v3_1``  ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...``
``kimi_k2``        ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>...``
``glm_4_5``        ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``
``llama3``         a leading ``{"name": ..., "parameters": {...}}``, or ``<|python_tag|>NAME.call(k=v, ...)``
``gpt_oss``        harmony: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
                   (``analysis`` messages are reasoning, ``final`` ones content)
``mistral_nemo``   ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]``
``generic``        the whole answer is JSON: ``{"tool_call": {...}}``, ``{"tool_calls": [...]}`` or
                   ``{"response": "..."}`` (llama.cpp's format for templates without tool support)

Arguments come out as JSON text: for JSON-argument formats the model's own JSON with the whitespace
between tokens removed (string contents and number spellings kept as written, raw control characters
in strings escaped), so that streamed fragments concatenate to exactly the non-streamed value; for
the XML formats (GLM, Qwen3-Coder) an object built from the key/value pairs (a value is JSON when it
parses as JSON and the tool's schema does not declare the parameter a string).

A call counts once its header is complete (name known, arguments begun); text that only looks like
the start of a call and then is not one (malformed) stays content.  A call cut off by the token limit
keeps the arguments generated so far (as OpenAI's API does with finish_reason "length").
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import regex

__all__ = ["FORMATS", "ToolCall", "ParsedMessage", "ToolCallStream", "normalize_tools", "parse_tool_choice",
           "detect_format", "parse_message", "preserved_tokens"]

FORMATS = ("generic", "hermes", "qwen3_coder", "deepseek_r1", "deepseek_v3_1", "kimi_k2", "glm_4_5", "llama3",
           "gpt_oss", "mistral_nemo")


# ------------------------------------------------------------------------------------ data types

@dataclass
class ToolCall:
    """One call: the function's name, its arguments as JSON text (a prefix while streaming), the id
    the model gave it ("" when it gave none: the server makes one)."""
    name: str
    arguments: str = ""
    id: str = ""


@dataclass
class ParsedMessage:
    """An assistant answer split into content, reasoning and tool calls."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


# ------------------------------------------------------------------------------ request checking

def normalize_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` -> [{"type": "function", "function": {"name", "description", "parameters"}}]
    (what llama.cpp hands to templates: description defaults to "", parameters to {}).
    Raises ``ValueError`` (one line) for anything that is not such a list."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"'tools' must be an array, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ValueError(f"tools[{i}] must be an object")
        if t.get("type") != "function":
            raise ValueError(f"tools[{i}]: unsupported tool type {json.dumps(t.get('type'))[:40]} "
                             f"(only 'function' is supported)")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}]: missing 'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function: 'name' must be a non-empty string")
        desc = fn.get("description")
        if desc is None:
            desc = ""
        if not isinstance(desc, str):
            raise ValueError(f"tools[{i}].function: 'description' must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function: 'parameters' must be a JSON schema object")
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    return out


def parse_tool_choice(value: Any, tools: list[dict]) -> tuple[str, Optional[str]]:
    """OpenAI ``tool_choice`` -> (mode, function name): mode "auto", "none", "required", or
    "function" with the name (which must be one of ``tools``).  Raises ``ValueError``."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value in ("auto", "none", "required"):
            return value, None
        raise ValueError(f"Invalid tool_choice: {value}")
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError("'tool_choice': a named choice needs 'function': {'name': ...}")
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"'tool_choice' names the function '{name}', which is not in 'tools'")
        return "function", name
    raise ValueError("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")


# ---------------------------------------------------------------------------------- detection

_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"


def detect_format(template: Optional[str]) -> Optional[str]:
    """The tool-call family of a Jinja chat template, from its text (llama.cpp's checks, in its
    order); ``None`` when it shows none of them (then the ``generic`` format applies)."""
    src = template or ""
    if "message['prefix'] is defined and message['prefix'] and thinking" in src:
        return "deepseek_v3_1"
    if _DS_CALLS_BEGIN in src:
        return "deepseek_r1"
    if "[gMASK]<sop>" in src and "<arg_key>" in src and "<arg_value>" in src:
        return "glm_4_5"
    if all(m in src for m in ("<tool_call>", "<function>", "<function=", "<parameters>", "<parameter=")):
        return "qwen3_coder"
    if "<tool_call>" in src:
        return "hermes"
    if "<|channel|>" in src:
        return "gpt_oss"
    if "<|tool_calls_section_begin|>" in src and "<|tool_call_begin|>" in src:
        return "kimi_k2"
    if "<|start_header_id|>ipython<|end_header_id|>" in src:
        return "llama3"
    if "[TOOL_CALLS]" in src:
        return "mistral_nemo"
    return None


_PRESERVED = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>"],
    "deepseek_r1": [_DS_CALLS_BEGIN, "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
    "glm_4_5": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "llama3": ["<|python_tag|>"],
    "gpt_oss": ["<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>"],
    "mistral_nemo": ["[TOOL_CALLS]"],
}
_PRESERVED["deepseek_v3_1"] = _PRESERVED["deepseek_r1"]


def preserved_tokens(fmt: Optional[str]) -> list[str]:
    """The marker texts of a family that must come out of the detokenizer as text (llama.cpp's
    preserved_tokens: a vocabulary may hold them as control tokens, which are otherwise dropped)."""
    return list(_PRESERVED.get(fmt or "", []))


# -------------------------------------------------------------------------------- JSON scanning

_CTRL_ESC = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_HEX = set("0123456789abcdefABCDEF")
_SCALAR = set("0123456789+-.eEtrufalsn")
_LITERALS = ("true", "false", "null")
_NUMBER = regex.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = regex.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_WS = " \t\n\r"


class _JsonScan:
    """A resumable scan of one JSON value from text[start:] (leading whitespace skipped): checks the
    syntax as it goes and keeps the value without insignificant whitespace (`out`).  `end` is the
    index just past the value once it is complete; `bad` is set at the first character that cannot
    continue valid JSON (`bad_at`)."""

    __slots__ = ("pos", "out", "stack", "expect", "in_str", "key", "esc", "uni", "tok", "end", "bad",
                 "bad_at", "first")

    def __init__(self, start: int) -> None:
        self.pos = start
        self.out: list[str] = []
        self.stack: list[str] = []
        self.expect = "value"
        self.in_str = self.key = self.esc = False
        self.uni = 0
        self.tok = ""
        self.end: Optional[int] = None
        self.bad = False
        self.bad_at = -1
        self.first = ""          # the value's first character ("" until seen)

    @property
    def text(self) -> str:
        return "".join(self.out)

    def _value_done(self, end: int) -> None:
        if not self.stack:
            self.end = end
        else:
            self.expect = "comma_or_close"

    def _fail(self, i: int) -> None:
        self.bad, self.bad_at = True, i

    def _end_token(self, i: int) -> bool:
        tok, self.tok = self.tok, ""
        if tok in _LITERALS or _NUMBER.fullmatch(tok):
            self._value_done(i)
            return True
        self._fail(i)
        return False

    def run(self, text: str, final: bool) -> "_JsonScan":
        i, n, out = self.pos, len(text), self.out
        while i < n and self.end is None and not self.bad:
            c = text[i]
            if self.in_str:
                if self.uni:
                    if c not in _HEX:
                        self._fail(i)
                        break
                    self.uni -= 1
                    out.append(c)
                elif self.esc:
                    self.esc = False
                    if c == "u":
                        self.uni = 4
                    elif c not in '"\\/bfnrt':
                        self._fail(i)
                        break
                    out.append(c)
                elif c == "\\":
                    self.esc = True
                    out.append(c)
                elif c == '"':
                    self.in_str = False
                    out.append(c)
                    if self.key:
                        self.expect = "colon"
                    else:
                        self._value_done(i + 1)
                elif c < " ":
                    # a raw control character is not valid in a JSON string: written escaped
                    out.append(_CTRL_ESC.get(c, f"\\u{ord(c):04x}"))
                else:
                    out.append(c)
                i += 1
                continue
            if self.tok:
                if c in _SCALAR:
                    self.tok += c
                    ok = any(lit.startswith(self.tok) for lit in _LITERALS) if self.tok[0] in "tfn" \
                        else _NUMBER_PREFIX.fullmatch(self.tok) is not None
                    if not ok:
                        self._fail(i)
                        break
                    out.append(c)
                    i += 1
                    continue
                if not self._end_token(i) or self.end is not None:
                    break
            if c in _WS:
                i += 1
                continue
            exp = self.expect
            if not self.first:
                self.first = c
            if c == '"' and exp in ("value", "value_or_close", "key", "key_or_close"):
                self.in_str, self.key = True, exp in ("key", "key_or_close")
            elif c in "{[" and exp in ("value", "value_or_close"):
                self.stack.append(c)
                self.expect = "key_or_close" if c == "{" else "value_or_close"
            elif c in "}]" and self.stack and self.stack[-1] == ("{" if c == "}" else "[") and (
                    exp == "comma_or_close" or exp == ("key_or_close" if c == "}" else "value_or_close")):
                self.stack.pop()
                out.append(c)
                self._value_done(i + 1)
                i += 1
                continue
            elif c == ":" and exp == "colon":
                self.expect = "value"
            elif c == "," and exp == "comma_or_close":
                self.expect = "key" if self.stack[-1] == "{" else "value"
            elif c in "-0123456789tfn" and exp in ("value", "value_or_close"):
                self.tok = c
                if c in "tfn" or _NUMBER_PREFIX.fullmatch(c):
                    out.append(c)
                    i += 1
                    continue
                self._fail(i)
                break
            else:
                self._fail(i)
                break
            out.append(c)
            i += 1
        self.pos = i
        if final and self.end is None and not self.bad and self.tok and not self.stack:
            self._end_token(i)       # a top-level number/literal that the text ends
        return self


class _Ctx:
    """State shared by the successive parses of one growing text: JSON scans resumed where they
    stopped (keyed by kind and start), the tools' schemas, the reasoning choice."""

    def __init__(self, tools: Optional[list[dict]] = None, extract_reasoning: bool = True) -> None:
        self.scans: dict[tuple, _JsonScan] = {}
        self.extract_reasoning = extract_reasoning
        self.props: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function", {}) if isinstance(t, dict) else {}
            params = fn.get("parameters") if isinstance(fn, dict) else None
            props = params.get("properties") if isinstance(params, dict) else None
            if isinstance(fn.get("name"), str) and isinstance(props, dict):
                self.props[fn["name"]] = props

    def scan(self, kind: str, text: str, start: int, final: bool) -> _JsonScan:
        s = self.scans.get((kind, start))
        if s is None:
            s = self.scans[(kind, start)] = _JsonScan(start)
        return s.run(text, final)

    def is_string_param(self, fn: str, key: str) -> bool:
        spec = self.props.get(fn, {}).get(key)
        t = spec.get("type") if isinstance(spec, dict) else None
        return t == "string" or (isinstance(t, list) and t and all(x in ("string", "null") for x in t))


# ------------------------------------------------------------------------------- text helpers

def _held(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers` (held back:
    the next piece may complete the marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _add_content(msg: ParsedMessage, text: str, partial: bool, markers: list[str]) -> None:
    if partial:
        text = text[:len(text) - _held(text, markers)]
    msg.content += text


def _before(msg: ParsedMessage, seg: str) -> str:
    """Add the content that a call marker follows, without the whitespace around the call (a
    segment right after a call loses its leading whitespace while no content precedes it); returns
    the trailing whitespace, for when the marker turns out to be no call."""
    if msg.tool_calls and not msg.content:
        seg = seg.lstrip()
    body = seg.rstrip()
    msg.content += body
    return seg[len(body):]


def _tail(msg: ParsedMessage, seg: str, partial: bool, markers: list[str]) -> None:
    """Add the content after the last marker: while streaming, trailing whitespace and what may be
    the start of a marker wait (dropped if a call follows)."""
    if msg.tool_calls and not msg.content:
        seg = seg.lstrip()
    if partial:
        seg = seg[:len(seg) - _held(seg, markers)].rstrip()
    msg.content += seg


def _find_first(text: str, markers: list[str], start: int) -> tuple[int, str]:
    best, which = -1, ""
    for m in markers:
        j = text.find(m, start)
        if j >= 0 and (best < 0 or j < best):
            best, which = j, m
    return best, which


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _unescape(s: str) -> str:
    try:
        return json.loads('"' + s + '"')
    except ValueError:
        return s


def _skip_close(text: str, i: int, close: str, partial: bool, skip: tuple = ()) -> Optional[int]:
    """After a call's arguments end at i: skip whitespace and the optional `skip` tokens, then the
    `close` marker.  None: (partial) what follows may still be one of them, wait.  Without the
    marker the call ends there and the text goes on as content."""
    t = _skip_ws(text, i)
    for tok in skip:
        if text.startswith(tok, t):
            t = _skip_ws(text, t + len(tok))
        elif partial and tok.startswith(text[t:]):
            return None
    if close:
        if text.startswith(close, t):
            return t + len(close)
        if partial and close.startswith(text[t:]):
            return None
    return t


_HOLD, _BAD, _CALL = "hold", "bad", "call"


def _args_of(scan: _JsonScan, final: bool) -> Optional[str]:
    """The arguments text of a scanned value: an object/array streams as it comes; a string is the
    JSON it holds (known only once complete: None until then)."""
    if scan.first in "{[":
        return scan.text
    if scan.end is None and not (final and scan.bad):
        return None
    raw = scan.text
    if scan.first == '"':
        try:
            inner = json.loads(raw)
        except ValueError:
            return raw
        try:
            return _dump(json.loads(inner))
        except ValueError:
            return inner
    return raw


def _json_call(text: str, k: int, head: Any, partial: bool, ctx: _Ctx, kind: str,
               fallback: bool = True) -> tuple[str, Optional[ToolCall], Optional[int], bool]:
    """A JSON call object at text[k:]: `head` matches `{"name": "NAME", "arguments": ` (the arguments
    then stream); with `fallback`, any complete object with "name" and "arguments"/"parameters" is a
    call too (other key orders; known only once the object is complete).
    -> (_CALL | _HOLD | _BAD, call, end, whole): end = index past the arguments (None while they are
    open); whole: the call object's own "}" is consumed too (the fallback form)."""
    m = head.match(text, k, partial=True)
    if m is not None and not m.partial:
        name = _unescape(m.group(1)).strip()
        if name:
            scan = ctx.scan(kind, text, m.end(), not partial)
            if not scan.first:
                return (_HOLD if partial else _BAD), None, None, False
            if scan.first in '{["':
                args = _args_of(scan, not partial)
                return _CALL, ToolCall(name, args or ""), scan.end, False
    elif m is not None and partial:
        return _HOLD, None, None, False
    if not fallback:
        return _BAD, None, None, False
    s = _skip_ws(text, k)
    if s == len(text):
        return (_HOLD if partial else _BAD), None, None, False
    if text[s] != "{":
        return _BAD, None, None, False
    scan = ctx.scan(kind + "-obj", text, s, not partial)
    if scan.bad:
        return _BAD, None, None, False
    if scan.end is None:
        return (_HOLD if partial else _BAD), None, None, False
    try:
        obj = json.loads(text[s:scan.end])
    except ValueError:
        return _BAD, None, None, False
    call = _call_from_obj(obj)
    if call is None:
        return _BAD, None, None, False
    return _CALL, call, scan.end, True


def _call_from_obj(obj: Any, args_keys: tuple = ("arguments", "parameters")) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = None
    for k in args_keys:
        if k in obj:
            args = obj[k]
            break
    else:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCall(obj["name"], args, obj["id"] if isinstance(obj.get("id"), str) else "")
    return ToolCall(obj["name"], _dump(args), obj["id"] if isinstance(obj.get("id"), str) else "")


# ------------------------------------------------------------------------------------ families

_JSON_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_LLAMA_HEAD = regex.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
                            r'\s*"(?:parameters|arguments)"\s*:\s*')


def _parse_hermes(text: str, partial: bool, ctx: _Ctx) -> ParsedMessage:
    """<tool_call>{"name": ..., "arguments": ...}</tool_call>, any number, content around them."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    msg, pos = ParsedMessage(), 0
    while True:
        j = text.find(OPEN, pos)
        if j < 0:
            _tail(msg, text[pos:], partial, [OPEN])
            return msg
        ws = _before(msg, text[pos:j])
        k = j + len(OPEN)
        status, call, end, whole = _json_call(text, k, _JSON_HEAD, partial, ctx, "hermes")
        if status == _HOLD:
            return msg
        if status == _BAD:                  # no call: the marker is text
            msg.content += ws + OPEN
            pos = k
            continue
        msg.tool_calls.append(call)
        if end is None:
            return msg
        nxt = _skip_close(text, end, CLOSE, partial, skip=() if whole else ("}",))
        if nxt is None:
            return msg
        pos = nxt


@dataclass
class _BlockSpec:
    opens: list[str]             # markers that open the calls section
    consume_open: dict           # marker -> whether it is consumed (False: it is also a call's start)
    head: Any                    # a call's header (regex; group "name", optional group "id")
    call_close: str
    close_skip: tuple
    block_close: str
    id_of: Callable[[Any], str]
    name_of: Callable[[Any], str]


def _parse_block(text: str, partial: bool, ctx: _Ctx, spec: _BlockSpec, kind: str) -> ParsedMessage:
    """A calls section (DeepSeek, Kimi): content, the section's opening marker, calls each with a
    header regex and JSON arguments, the section's closing marker, content."""
    msg = ParsedMessage()
    j, marker = _find_first(text, spec.opens, 0)
    if j < 0:
        _tail(msg, text, partial, spec.opens)
        return msg
    ws = _before(msg, text[:j])
    p = j + (len(marker) if spec.consume_open[marker] else 0)
    emitted = False
    while True:
        m = spec.head.search(text, p, partial=True)
        e = text.find(spec.block_close, p) if spec.block_close else -1
        if e >= 0 and (m is None or e < m.start()):
            gap = text[p:e]
            if gap.strip():             # text inside the section that is no call
                msg.content += gap if emitted else ws + text[j:e + len(spec.block_close)]
            msg.content += text[e + len(spec.block_close):].lstrip()
            return msg
        if m is None or m.partial:
            if partial:
                return msg
            # the text ends inside the section without (more) calls: what is left is content
            msg.content += text[p:] if emitted else ws + text[j:]
            return msg
        gap = text[p:m.start()]
        if gap.strip():
            msg.content += gap if emitted else ws + text[j:m.start()]
            emitted = True
        scan = ctx.scan(kind, text, m.end(), not partial)
        if not scan.first:
            if partial:
                return msg
            msg.content += text[m.start():] if emitted else ws + text[j:]
            return msg
        if scan.first not in '{["':
            msg.content += text[m.start():m.end()] if emitted else ws + text[j:m.end()]
            emitted = True
            p = m.end()
            continue
        args = _args_of(scan, not partial)
        msg.tool_calls.append(ToolCall(spec.name_of(m), args or "", spec.id_of(m)))
        emitted = True
        if scan.end is None:
            return msg
        nxt = _skip_close(text, scan.end, spec.call_close, partial, spec.close_skip)
        if nxt is None:
            return msg
        p = nxt


_DS_OPENS = [_DS_CALLS_BEGIN, "<｜tool_calls_begin｜>", "<｜tool calls begin｜>", "<｜tool\\_calls\\_begin｜>",
             "<｜tool▁calls｜>"]
_DS_R1 = _BlockSpec(
    opens=_DS_OPENS, consume_open={m: True for m in _DS_OPENS},
    head=regex.compile(r"(?:<｜tool▁call▁begin｜>)?function<｜tool▁sep｜>(?P<name>[^\n<]+)\n```(?:json)?\n"),
    call_close="<｜tool▁call▁end｜>", close_skip=("```",), block_close="<｜tool▁calls▁end｜>",
    id_of=lambda m: "", name_of=lambda m: m.group("name").strip())
_DS_V31 = _BlockSpec(
    opens=_DS_OPENS, consume_open={m: True for m in _DS_OPENS},
    head=regex.compile(r"(?:<｜tool▁call▁begin｜>)?(?P<name>[^\n<]+)<｜tool▁sep｜>"),
    call_close="<｜tool▁call▁end｜>", close_skip=(), block_close="<｜tool▁calls▁end｜>",
    id_of=lambda m: "", name_of=lambda m: m.group("name").strip())

_KIMI_ID = regex.compile(r"functions\.(.+):[0-9]+")


def _kimi_name(m: Any) -> str:
    ident = m.group("name").strip()
    k = _KIMI_ID.fullmatch(ident)
    if k:
        return k.group(1)
    return ident[len("functions."):] if ident.startswith("functions.") else ident


_KIMI = _BlockSpec(
    opens=["<|tool_calls_section_begin|>", "<|tool_call_begin|>"],
    consume_open={"<|tool_calls_section_begin|>": True, "<|tool_call_begin|>": False},
    head=regex.compile(r"<\|tool_call_begin\|>\s*(?P<name>[^<]+?)\s*<\|tool_call_argument_begin\|>"),
    call_close="<|tool_call_end|>", close_skip=(), block_close="<|tool_calls_section_end|>",
    id_of=lambda m: m.group("name").strip() if _KIMI_ID.fullmatch(m.group("name").strip()) else "",
    name_of=_kimi_name)


def _xml_value(ctx: _Ctx, fn: str, key: str, raw: str) -> str:
    """A parameter's value as JSON: the text itself for a string parameter, else its JSON when it
    parses as JSON, else the text as a string."""
    if not ctx.is_string_param(fn, key):
        try:
            return _dump(json.loads(raw))
        except ValueError:
            pass
    return _dump(raw)


def _parse_glm(text: str, partial: bool, ctx: _Ctx) -> ParsedMessage:
    """GLM-4.5/4.6: <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>."""
    OPEN, CLOSE, KO, KC, VO, VC = "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    msg, pos = ParsedMessage(), 0
    while True:
        j = text.find(OPEN, pos)
        if j < 0:
            _tail(msg, text[pos:], partial, [OPEN])
            return msg
        ws = _before(msg, text[pos:j])
        k = j + len(OPEN)
        e, _m = _find_first(text, ["\n", KO, CLOSE], k)
        if e < 0:
            if partial:
                return msg
            e = len(text)
        name = text[k:e].strip()
        if not name or any(ch in name for ch in " <>\t"):
            msg.content += ws + OPEN
            pos = k
            continue
        call = ToolCall(name, "{")
        msg.tool_calls.append(call)
        p, n_args = e, 0
        while True:
            p = _skip_ws(text, p)
            if text.startswith(CLOSE, p):
                call.arguments += "}"
                p += len(CLOSE)
                break
            if text.startswith(KO, p):
                ke = text.find(KC, p + len(KO))
                if ke < 0:
                    if partial:
                        return msg
                    call.arguments += "}"
                    return msg
                key = text[p + len(KO):ke].strip()
                v = _skip_ws(text, ke + len(KC))
                if not text.startswith(VO, v):
                    if partial and VO.startswith(text[v:]):
                        return msg
                    p = v
                    continue
                ve = text.find(VC, v + len(VO))
                if ve < 0 and partial:
                    return msg
                raw = text[v + len(VO):ve if ve >= 0 else len(text)]
                call.arguments += ("," if n_args else "") + _dump(key) + ":" + _xml_value(ctx, name, key, raw)
                n_args += 1
                if ve < 0:
                    call.arguments += "}"
                    return msg
                p = ve + len(VC)
                continue
            if partial and p == len(text) or partial and (KO.startswith(text[p:]) or CLOSE.startswith(text[p:])):
                return msg
            c = text.find(CLOSE, p)          # something else: the call ends at its closing tag
            if c < 0:
                if partial:
                    return msg
                call.arguments += "}"
                return msg
            call.arguments += "}"
            p = c + len(CLOSE)
            break
        pos = p


def _parse_qwen3_coder(text: str, partial: bool, ctx: _Ctx) -> ParsedMessage:
    """Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>."""
    OPEN, CLOSE, FO, FC, PO, PC = "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>"
    msg, pos = ParsedMessage(), 0
    while True:
        j = text.find(OPEN, pos)
        if j < 0:
            _tail(msg, text[pos:], partial, [OPEN])
            return msg
        ws = _before(msg, text[pos:j])
        p = _skip_ws(text, j + len(OPEN))
        n_calls = 0
        while True:                      # one or more functions inside the <tool_call> scope
            if not text.startswith(FO, p):
                if partial and FO.startswith(text[p:]):
                    return msg
                if n_calls:
                    c = _skip_close(text, p, CLOSE, partial)
                    if c is None:
                        return msg
                    p = c
                    break
                msg.content += ws + OPEN
                p = j + len(OPEN)
                break
            ne = text.find(">", p + len(FO))
            if ne < 0:
                if partial:
                    return msg
                msg.content += (ws if not n_calls else "") + text[j if not n_calls else p:]
                return msg
            name = text[p + len(FO):ne].strip()
            if not name or "\n" in name or "<" in name:
                if n_calls:
                    c = _skip_close(text, p, CLOSE, partial)
                    if c is None:
                        return msg
                    p = c
                    break
                msg.content += ws + OPEN
                p = j + len(OPEN)
                break
            call = ToolCall(name, "{")
            msg.tool_calls.append(call)
            n_calls += 1
            p, n_args = ne + 1, 0
            while True:
                p = _skip_ws(text, p)
                if text.startswith(FC, p):
                    call.arguments += "}"
                    p = _skip_ws(text, p + len(FC))
                    break
                if text.startswith(PO, p):
                    ke = text.find(">", p + len(PO))
                    ve = text.find(PC, ke + 1) if ke >= 0 else -1
                    if ve < 0 and partial:
                        return msg
                    if ke < 0:
                        call.arguments += "}"
                        return msg
                    key = text[p + len(PO):ke].strip()
                    raw = text[ke + 1:ve if ve >= 0 else len(text)].strip()
                    call.arguments += ("," if n_args else "") + _dump(key) + ":" + _xml_value(ctx, name, key, raw)
                    n_args += 1
                    if ve < 0:
                        call.arguments += "}"
                        return msg
                    p = ve + len(PC)
                    continue
                if partial and (FC.startswith(text[p:]) or PO.startswith(text[p:])):
                    return msg
                c = text.find(FC, p)
                if c < 0:
                    if partial:
                        return msg
                    call.arguments += "}"
                    return msg
                call.arguments += "}"
                p = _skip_ws(text, c + len(FC))
                break
        pos = p


_PY_CALL = regex.compile(r"\s*([A-Za-z_][\w.]*?)\s*\.\s*call\s*\(")
_PY_ARG = regex.compile(r"\s*(\w+)\s*=\s*")


def _python_tag_call(text: str, k: int, partial: bool) -> tuple[str, Optional[ToolCall], int]:
    """<|python_tag|>NAME.call(key=JSON, ...) -> one call once the ")" closes (held until then)."""
    m = _PY_CALL.match(text, k, partial=True)
    if m is None:
        return _BAD, None, k
    if m.partial:
        return (_HOLD if partial else _BAD), None, k
    args, p = {}, m.end()
    while True:
        p = _skip_ws(text, p)
        if text.startswith(")", p):
            return _CALL, ToolCall(m.group(1), _dump(args)), p + 1
        a = _PY_ARG.match(text, p, partial=True)
        if a is None:
            return _BAD, None, k
        if a.partial:
            return (_HOLD if partial else _BAD), None, k
        scan = _JsonScan(a.end()).run(text, not partial)
        if scan.bad or scan.end is None:
            return (_HOLD if partial and not scan.bad else _BAD), None, k
        args[a.group(1)] = json.loads(text[_skip_ws(text, a.end()):scan.end])
        p = _skip_ws(text, scan.end)
        if text.startswith(",", p):
            p += 1
        elif p == len(text):
            return (_HOLD if partial else _BAD), None, k


def _parse_llama3(text: str, partial: bool, ctx: _Ctx) -> ParsedMessage:
    """Llama 3.x: the answer starts with one JSON call {"name": ..., "parameters": {...}}, or has a
    <|python_tag|> call (NAME.call(k=v, ...) or the same JSON); text after the call is content."""
    TAG = "<|python_tag|>"
    msg = ParsedMessage()
    s = _skip_ws(text, 0)
    if s == len(text) and partial:
        return msg
    if text.startswith("{", s):
        status, call, end, whole = _json_call(text, s, _LLAMA_HEAD, partial, ctx, "llama")
        if status == _HOLD:
            return msg
        if status == _CALL:
            msg.tool_calls.append(call)
            nxt = None if end is None else _skip_close(text, end, "", partial, skip=() if whole else ("}",))
            if nxt is not None:
                msg.content += text[nxt:].lstrip()
            return msg
    j = text.find(TAG)
    if j < 0:
        _tail(msg, text, partial, [TAG])
        return msg
    ws = _before(msg, text[:j])
    k = _skip_ws(text, j + len(TAG))
    if k == len(text) and partial:
        return msg
    whole = True
    if text.startswith("{", k):
        status, call, end, whole = _json_call(text, k, _LLAMA_HEAD, partial, ctx, "llama-tag")
    else:
        status, call, end = _python_tag_call(text, k, partial)
    if status == _HOLD:
        return msg
    if status == _BAD:
        msg.content += ws + text[j:]
        return msg
    msg.tool_calls.append(call)
    nxt = None if end is None else _skip_close(text, end, "", partial, skip=() if whole else ("}",))
    if nxt is not None:
        msg.content += text[nxt:].lstrip()
    return msg


_HARMONY_ENDS = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"]
_HARMONY_TO = regex.compile(r"to=functions\.([^<\s]+)")
_HARMONY_CHANNEL = regex.compile(r"<\|channel\|>\s*(\w+)")


def _parse_harmony(text: str, partial: bool, ctx: _Ctx) -> ParsedMessage:
    """gpt-oss (harmony): messages [<|start|>assistant]HEADER<|message|>BODY<|end|>/<|call|>; the
    analysis channel is reasoning, final (and commentary without a recipient) content, a
    `to=functions.NAME` recipient a call whose body is its JSON arguments."""
    msg, pos = ParsedMessage(), 0
    n = len(text)
    while pos < n:
        h = text.find("<|message|>", pos)
        if h < 0:
            if not partial:
                rest = text[pos:]
                if rest.startswith("<|start|>assistant"):
                    rest = rest[len("<|start|>assistant"):]
                if rest.strip() and "<|channel|>" not in rest:
                    msg.content += rest
            return msg
        header = text[pos:h]
        b = h + len("<|message|>")
        to = _HARMONY_TO.search(header)
        ch = _HARMONY_CHANNEL.search(header)
        channel = ch.group(1) if ch else ""
        if to:
            scan = ctx.scan("harmony", text, b, not partial)
            if scan.first and scan.first in '{["':
                msg.tool_calls.append(ToolCall(to.group(1), _args_of(scan, not partial) or ""))
                if scan.end is None:
                    return msg
                e, mk = _find_first(text, _HARMONY_ENDS, scan.end)
            elif not scan.first and partial:
                return msg
            else:                                   # not JSON: the body stays content
                e, mk = _find_first(text, _HARMONY_ENDS, b)
                body = text[b:e if e >= 0 else n]
                _add_content(msg, body, partial and e < 0, _HARMONY_ENDS)
        else:
            e, mk = _find_first(text, _HARMONY_ENDS, b)
            body = text[b:e] if e >= 0 else text[b:]
            if e < 0 and partial:
                # trailing whitespace and a partial end marker wait (dropped if the message ends)
                body = body[:len(body) - _held(body, _HARMONY_ENDS)]
                body = body.rstrip()
            else:
                body = body.rstrip()
            body = body.lstrip()
            if channel == "analysis":
                if ctx.extract_reasoning:
                    msg.reasoning += body
                else:
                    full = text[pos:e + len(mk)] if e >= 0 else text[pos:]
                    _add_content(msg, full, partial and e < 0, _HARMONY_ENDS)
            else:
                msg.content += body
        if e < 0:
            return msg
        pos = e if mk == "<|start|>" else e + len(mk)
        if text.startswith("<|start|>", pos):
            pos += len("<|start|>")
            if text.startswith("assistant", pos):
                pos += len("assistant")
            elif partial and "assistant".startswith(text[pos:]):
                return msg
    return msg


def _parse_mistral_nemo(text: str, partial: bool, ctx: _Ctx) -> ParsedMessage:
    """Mistral Nemo: [TOOL_CALLS] then a JSON array of {"name", "arguments", "id"} (whole calls)."""
    TAG = "[TOOL_CALLS]"
    msg = ParsedMessage()
    j = text.find(TAG)
    if j < 0:
        _tail(msg, text, partial, [TAG])
        return msg
    ws = _before(msg, text[:j])
    s = _skip_ws(text, j + len(TAG))
    if s == len(text) and partial:
        return msg
    scan = ctx.scan("nemo", text, s, not partial) if text.startswith("[", s) else None
    if scan is not None and scan.end is None and not scan.bad and partial:
        return msg
    calls = None
    if scan is not None and scan.end is not None:
        try:
            arr = json.loads(text[s:scan.end])
            calls = [_call_from_obj(x) for x in arr] if isinstance(arr, list) and arr else None
        except ValueError:
            calls = None
    if not calls or any(c is None for c in calls):
        msg.content += ws + text[j:]
        return msg
    msg.tool_calls.extend(calls)
    msg.content += text[scan.end:].lstrip()
    return msg


def _parse_generic(text: str, partial: bool, ctx: _Ctx) -> ParsedMessage:
    """llama.cpp's generic format: the answer is {"tool_calls": [...]}, {"tool_call": {...}} or
    {"response": ...} (anything else is content as it is)."""
    msg = ParsedMessage()
    s = _skip_ws(text, 0)
    if s == len(text):
        if not partial:
            msg.content = text
        return msg
    if text[s] != "{":
        msg.content = text
        return msg
    scan = ctx.scan("generic", text, s, not partial)
    if scan.end is None and not scan.bad and partial:
        return msg
    obj = None
    if scan.end is not None:
        try:
            obj = json.loads(text[s:scan.end])
        except ValueError:
            obj = None
    if isinstance(obj, dict):
        calls: Optional[list] = None
        if isinstance(obj.get("tool_calls"), list):
            calls = [_call_from_obj(x) for x in obj["tool_calls"]]
        elif isinstance(obj.get("tool_call"), dict):
            calls = [_call_from_obj(obj["tool_call"])]
        if calls and all(c is not None for c in calls):
            msg.tool_calls.extend(calls)
            msg.content = text[scan.end:].strip()
            return msg
        if "response" in obj:
            r = obj["response"]
            msg.content = (r if isinstance(r, str) else json.dumps(r, ensure_ascii=False, indent=2)) \
                + text[scan.end:].rstrip()
            return msg
    msg.content = text
    return msg


_PARSERS: dict[str, Callable[[str, bool, _Ctx], ParsedMessage]] = {
    "hermes": _parse_hermes,
    "qwen3_coder": _parse_qwen3_coder,
    "deepseek_r1": lambda t, p, c: _parse_block(t, p, c, _DS_R1, "ds"),
    "deepseek_v3_1": lambda t, p, c: _parse_block(t, p, c, _DS_V31, "ds"),
    "kimi_k2": lambda t, p, c: _parse_block(t, p, c, _KIMI, "kimi"),
    "glm_4_5": _parse_glm,
    "llama3": _parse_llama3,
    "gpt_oss": _parse_harmony,
    "mistral_nemo": _parse_mistral_nemo,
    "generic": _parse_generic,
}


def _parse(text: str, fmt: str, partial: bool, ctx: _Ctx, max_calls: Optional[int]) -> ParsedMessage:
    msg = _PARSERS[fmt](text, partial, ctx)
    if max_calls is not None and len(msg.tool_calls) > max_calls:
        del msg.tool_calls[max_calls:]     # parallel_tool_calls: false -> the first call only
    return msg


def parse_message(text: str, fmt: str, *, tools: Optional[list[dict]] = None, extract_reasoning: bool = True,
                  max_calls: Optional[int] = None) -> ParsedMessage:
    """A whole answer in format `fmt` (one of FORMATS) -> content, reasoning, tool calls.

    tools: the request's tools (their schemas type the XML formats' values).
    extract_reasoning: gpt-oss's analysis messages as reasoning (else they stay in the content).
    max_calls: keep at most this many calls (parallel_tool_calls: false -> 1)."""
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format '{fmt}'; valid: {', '.join(FORMATS)}")
    return _parse(text, fmt, False, _Ctx(tools, extract_reasoning), max_calls)


# ---------------------------------------------------------------------------------- streaming

class ToolCallStream:
    """Parses a growing answer: feed() each new piece, finish() at the end.  Both return deltas:

    ("content", text), ("reasoning", text),
    ("tool_call", index, id, name, "") when a call starts (id: the model's, else new_id()),
    ("tool_call", index, None, None, fragment) for more of its arguments.

    The whole text is parsed again at each piece (as llama-server does) with the JSON scans resumed
    where they stopped; the deltas are the growth since the previous parse, so their concatenation
    equals :func:`parse_message` of the whole text."""

    def __init__(self, fmt: str, *, tools: Optional[list[dict]] = None, extract_reasoning: bool = True,
                 max_calls: Optional[int] = None, new_id: Optional[Callable[[], str]] = None) -> None:
        if fmt not in _PARSERS:
            raise ValueError(f"unknown tool-call format '{fmt}'; valid: {', '.join(FORMATS)}")
        self.fmt, self.max_calls = fmt, max_calls
        self.ctx = _Ctx(tools, extract_reasoning)
        self.new_id = new_id or (lambda: "")
        self.text = ""
        self.prev = ParsedMessage()
        self.ids: list[str] = []

    def feed(self, piece: str) -> list[tuple]:
        if not piece:
            return []
        self.text += piece
        return self._update(_parse(self.text, self.fmt, True, self.ctx, self.max_calls))

    def finish(self) -> list[tuple]:
        return self._update(_parse(self.text, self.fmt, False, self.ctx, self.max_calls))

    @staticmethod
    def _growth(old: str, new: str) -> str:
        # the parsers only ever extend what they reported; anything else would be a parser bug,
        # and what was sent cannot be taken back: only a true extension is sent
        return new[len(old):] if new.startswith(old) else ""

    def _update(self, cur: ParsedMessage) -> list[tuple]:
        out: list[tuple] = []
        d = self._growth(self.prev.reasoning, cur.reasoning)
        if d:
            out.append(("reasoning", d))
        d = self._growth(self.prev.content, cur.content)
        if d:
            out.append(("content", d))
        for i, call in enumerate(cur.tool_calls):
            if i < len(self.prev.tool_calls):
                d = self._growth(self.prev.tool_calls[i].arguments, call.arguments)
                if d:
                    out.append(("tool_call", i, None, None, d))
            else:
                self.ids.append(call.id or self.new_id())
                out.append(("tool_call", i, self.ids[i], call.name, ""))
                if call.arguments:
                    out.append(("tool_call", i, None, None, call.arguments))
        self.prev = copy.deepcopy(cur)
        return out

    def message(self) -> ParsedMessage:
        """What was reported so far, with the calls' ids."""
        msg = copy.deepcopy(self.prev)
        for c, i in zip(msg.tool_calls, self.ids):
            c.id = i
        return msg
