"""OpenAI-style chat ``messages`` -> prompt text, using the GGUF's chat template.

The template stored in a GGUF file (``tokenizer.chat_template``) is a Jinja
template written for HuggingFace transformers' ``apply_chat_template``; it is
rendered here the way transformers does it:

* ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks`` and the ``loopcontrols`` extension (``{% break %}``,
  ``{% continue %}``), plus a no-op ``{% generation %}`` block tag;
* globals ``raise_exception(msg)`` (aborts rendering) and ``strftime_now(fmt)``;
* a ``tojson`` filter that is plain ``json.dumps`` (non-ASCII kept, no HTML
  escaping), with ``indent``/``separators``/``sort_keys``/``ensure_ascii``;
* variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``
  (and whatever the caller adds through ``extra_vars``, e.g. ``tools`` or
  ``enable_thinking``).

Before rendering, the messages get llama.cpp's server work-arounds (``polyfill``,
on by default): role ``developer`` becomes ``system``, and a leading system
message is merged into the first user message (system + newline + user) when
the template cannot show a system message (it raises, like Gemma's, or drops it,
like Phi-3-mini's).  With these, the output equals ik_llama.cpp's ``--jinja``
rendering for the reference cases of ``tests/test-chat-template.cpp``.

Without a template the prompt is ChatML, which is what llama.cpp's server uses
for files that have none::

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n

Every problem the client can cause (bad ``messages``, a template that does not
compile, ``raise_exception`` in the template, a runtime error while rendering)
is reported as a ``ValueError`` with a one-line message.
"""
from __future__ import annotations

import copy
import datetime as _dt
import json
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["render_chat", "normalize_messages", "render_chatml", "CHATML", "GGUF", "BUILTIN_TEMPLATES",
           "builtin_template_names", "render_builtin", "builtin_renderer", "ToolCaps", "tool_caps",
           "prepare_tool_messages", "GENERIC_INSTRUCTION"]

#: name returned by :func:`render_chat` when the GGUF's own template was used
GGUF = "gguf"
#: name returned by :func:`render_chat` when the ChatML fallback was used
CHATML = "chatml"

_MAX_ERROR_CHARS = 500

# the only OpenAI content part type a text model accepts
_CONTENT_PART_TEXT = "text"


# ---------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------
def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _join_content_parts(parts: list, index: int) -> str:
    """Join OpenAI content parts of type "text" with newlines (as llama.cpp does)."""
    texts: list[str] = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ValueError(
                f"messages[{index}].content[{j}]: expected a content part object, got {type(part).__name__}")
        ptype = part.get("type")
        if ptype is None:
            raise ValueError(f"messages[{index}].content[{j}]: missing content part 'type'")
        if ptype != _CONTENT_PART_TEXT:
            raise ValueError(
                f"messages[{index}].content[{j}]: unsupported content part type {_short_repr(ptype)} "
                f"(only 'text' is supported)")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(
                f"messages[{index}].content[{j}]: 'text' must be a string, got {type(text).__name__}")
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI chat messages and return copies ready for a template.

    Each message must be a dict with a non-empty string ``role`` and a ``content``
    that is a string or a list of ``{"type": "text", "text": ...}`` parts (joined
    with ``"\\n"``).  ``content`` may be missing or ``None`` only on a message
    that carries ``tool_calls`` (OpenAI assistant tool-call turns); it is then
    passed on as ``None``.  Other keys (``tool_calls``, ``name``,
    ``tool_call_id``, ``reasoning_content`` ...) are passed through unchanged,
    except that keys whose value is ``None`` and an empty ``tool_calls`` list
    are dropped (as llama.cpp does).

    Raises ``ValueError`` (one line) for anything else.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"'messages' must be a list of message objects, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("'messages' must contain at least one message")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}]: expected a message object, got {type(msg).__name__}")
        if "role" not in msg:
            raise ValueError(f"messages[{i}]: missing 'role'")
        role = msg["role"]
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}]: 'role' must be a string, got {type(role).__name__}")
        if not role:
            raise ValueError(f"messages[{i}]: 'role' must not be empty")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise ValueError(f"messages[{i}]: 'tool_calls' must be a list, got {type(tool_calls).__name__}")
        has_tool_calls = bool(tool_calls)
        content = msg.get("content")
        if isinstance(content, str):
            pass
        elif isinstance(content, list):
            content = _join_content_parts(content, i)
        elif content is None:
            if not has_tool_calls:
                raise ValueError(f"messages[{i}]: missing 'content' (a string or a list of text parts)")
        else:
            raise ValueError(
                f"messages[{i}]: 'content' must be a string or a list of content parts, "
                f"got {type(content).__name__}")
        # like llama.cpp, drop keys sent as null (and an empty tool_calls list) so that
        # templates testing `'tool_calls' in message` / `message.name is defined` behave
        new = {k: v for k, v in msg.items() if v is not None and k != "content"}
        if not has_tool_calls:
            new.pop("tool_calls", None)
        new["content"] = content
        out.append(new)
    return out


# ---------------------------------------------------------------------------
# ChatML fallback
# ---------------------------------------------------------------------------
def render_chatml(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """ChatML, as llama.cpp's ``chatml`` built-in template (``messages`` already normalized)."""
    parts = [f"<|im_start|>{m['role']}\n{m['content'] or ''}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# ---------------------------------------------------------------------------
# Jinja environment (transformers-compatible)
# ---------------------------------------------------------------------------
def _now() -> _dt.datetime:  # separate so tests can pin the clock
    return _dt.datetime.now()


def _strftime_now(fmt: str) -> str:
    return _now().strftime(fmt)


def _json_default(o: Any) -> Any:
    # what Jinja filters hand on: `tools | map(attribute='function') | tojson` passes a generator
    if isinstance(o, Mapping):
        return dict(o)
    if isinstance(o, Iterable) and not isinstance(o, (str, bytes)):
        return list(o)
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_json_default)


# ids of the containers handed to the template (messages, tools, ...): those stay immutable, while
# lists and dicts the template builds itself may change (Kimi-K2's template appends to and pops
# from its own list); None: nothing known, everything immutable
_INPUT_IDS: ContextVar[Optional[frozenset]] = ContextVar("ikcli_template_input_ids", default=None)
_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "setdefault",
             "popitem"}


def _container_ids(*values: Any) -> frozenset:
    ids, stack = set(), list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, (list, dict)) and id(v) not in ids:
            ids.add(id(v))
            stack.extend(v.values() if isinstance(v, dict) else v)
    return frozenset(ids)


@lru_cache(maxsize=1)
def _environment():
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a declared dependency
        raise RuntimeError("rendering a GGUF chat template needs jinja2 (pip install 'jinja2>=3')") from e

    class TemplateRaised(jinja2.TemplateError):
        """raise_exception() called by the template."""

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body."""
        tags = {"generation"}

        def parse(self, parser):  # noqa: D401
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message: Any = "") -> None:
        raise TemplateRaised(str(message))

    class Sandbox(ImmutableSandboxedEnvironment):
        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            inputs = _INPUT_IDS.get()
            if (inputs is not None and attr in _MUTATORS and type(obj) in (list, dict)
                    and id(obj) not in inputs):
                return SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
            return super().is_safe_attribute(obj, attr, value)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env, TemplateRaised


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    if len(text) > _MAX_ERROR_CHARS:
        text = text[: _MAX_ERROR_CHARS - 3] + "..."
    return text


@lru_cache(maxsize=16)
def _compile(template: str):
    env, _ = _environment()
    return env.from_string(template)


def _compile_or_raise(template: str):
    import jinja2
    try:
        return _compile(template)
    except jinja2.TemplateSyntaxError as e:
        where = f" at line {e.lineno}" if e.lineno else ""
        raise ValueError(_one_line(f"invalid chat template{where}: {e.message or e}")) from e
    except Exception as e:  # noqa: BLE001 - anything else the parser may raise
        raise ValueError(_one_line(f"invalid chat template: {type(e).__name__}: {e}")) from e


# ---------------------------------------------------------------------------
# llama.cpp's message work-arounds
# ---------------------------------------------------------------------------
_SYSTEM_NEEDLE = "<<ikcli system probe 7f3a>>"


@lru_cache(maxsize=16)
def _supports_system_role(template: str) -> bool:
    """Does the template show a leading system message?  (llama.cpp's ``supports_system_role`` cap.)

    Probed by rendering [system, user]: a template that raises on it (Gemma, old
    Mistral) or silently drops it (Phi-3-mini, Orion) does not support it.
    """
    probe = [{"role": "system", "content": _SYSTEM_NEEDLE}, {"role": "user", "content": "User message"}]
    try:
        out = _compile(template).render(messages=probe, add_generation_prompt=False, bos_token="", eos_token="")
    except Exception:  # noqa: BLE001
        return False
    return _SYSTEM_NEEDLE in out


def _apply_workarounds(msgs: list[dict], template: str | None) -> list[dict]:
    r"""What llama.cpp's server does to the messages before rendering a template.

    * role ``developer`` becomes ``system`` (except for GPT-OSS templates, which know it);
    * when the template does not support a system role, a leading system message is
      merged into the next message (``system + "\n" + content``), or dropped if alone.

    ``template=None`` stands for the ChatML fallback (which supports system messages).
    """
    if template is None or "<|channel|>" not in template:
        msgs = [dict(m, role="system") if m["role"] == "developer" else m for m in msgs]
    if template is not None and msgs and msgs[0]["role"] == "system" and not _supports_system_role(template):
        if len(msgs) > 1:
            second = dict(msgs[1])
            second["content"] = (msgs[0]["content"] or "") + "\n" + (second["content"] or "")
            msgs = [second] + msgs[2:]
        else:
            msgs = []
    return msgs


# ---------------------------------------------------------------------------
# tools: what a template shows, and llama.cpp's polyfills for what it does not
# ---------------------------------------------------------------------------
_TOOL_NEEDLE = "tool_name_probe_7f3a"
_CALL_NEEDLE = "tool_call_probe_7f3a"
_ARG_NEEDLE = "argument_needle"
_RESPONSE_NEEDLE = "tool_response_probe_7f3a"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _TOOL_NEEDLE, "description": "Tool description",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
                   "required": ["arg"]}}}]
# llama.cpp's generic format: the model answers in JSON (its system instruction, word for word)
GENERIC_INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                       "reply to the user's request")


class ToolCaps(NamedTuple):
    """What a chat template shows by itself: the tools list, assistant tool calls, tool results,
    and whether it needs a call's arguments as an object (it indexes into them, or renders them with
    `tojson`, which would quote a JSON string a second time)."""
    tools: bool
    tool_calls: bool
    tool_responses: bool
    object_arguments: bool
    null_content: bool = True      # takes content null on a turn with calls (else it gets "")


def _probe_render(template: str, messages: list, tools: Optional[list] = None, add_generation_prompt: bool = False,
                  bos_token: str = "", eos_token: str = "") -> Optional[str]:
    token = _INPUT_IDS.set(_container_ids(messages, tools))
    try:
        return _compile(template).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token)
    except Exception:  # noqa: BLE001 - a template that fails on a probe does not show that feature
        return None
    finally:
        _INPUT_IDS.reset(token)


def _probe_conversation(arguments: Any, content: Optional[str] = "") -> list[dict]:
    # ids of 9 alphanumerics: Mistral's templates refuse any other
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": content, "tool_calls": [
                {"id": "call00001", "type": "function", "function": {"name": _CALL_NEEDLE, "arguments": arguments}}]},
            {"role": "tool", "content": _RESPONSE_NEEDLE, "tool_call_id": "call00001", "name": _CALL_NEEDLE},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


def _shows_arguments(text: Optional[str]) -> bool:
    return text is not None and any(m in text for m in (
        f'"{_ARG_NEEDLE}":', f"'{_ARG_NEEDLE}':", f"<arg_key>{_ARG_NEEDLE}</arg_key>", f"<parameter={_ARG_NEEDLE}>",
        f'{_ARG_NEEDLE}="'))


@lru_cache(maxsize=16)
def tool_caps(template: Optional[str]) -> ToolCaps:
    """Probe a Jinja chat template (rendered on made-up conversations, as llama.cpp's template
    capabilities are found); no template (the ChatML fallback) shows none of it."""
    if template is None or not template.strip():
        return ToolCaps(False, False, False, False, True)
    try:
        _compile(template)
    except Exception:  # noqa: BLE001 - reported when the template is used
        return ToolCaps(False, False, False, False, True)
    out = _probe_render(template, [{"role": "user", "content": "User message"}], copy.deepcopy(_PROBE_TOOLS))
    shows_tools = out is not None and _TOOL_NEEDLE in out
    obj = {_ARG_NEEDLE: "print('Hello, World!')"}
    as_str = _probe_render(template, _probe_conversation(json.dumps(obj)), copy.deepcopy(_PROBE_TOOLS))
    as_obj = _probe_render(template, _probe_conversation(obj), copy.deepcopy(_PROBE_TOOLS))
    object_args = _shows_arguments(as_obj) and not _shows_arguments(as_str)
    out = as_obj if object_args else as_str
    shows_calls = out is not None and _CALL_NEEDLE in out
    null_ok = True
    if shows_calls:     # a null content must neither fail nor come out as "None"
        with_null = _probe_render(template, _probe_conversation(obj if object_args else json.dumps(obj), None),
                                  copy.deepcopy(_PROBE_TOOLS))
        null_ok = with_null is not None and with_null.count("None") == out.count("None")
    return ToolCaps(shows_tools, shows_calls, out is not None and _RESPONSE_NEEDLE in out, object_args, null_ok)


@lru_cache(maxsize=16)
def _tool_call_example(template: str, bos_token: str, eos_token: str, object_args: bool, null_content: bool) -> str:
    """The template's own rendering of one tool call (what llama.cpp's polyfill shows the model
    when the template does not list the tools itself): the text an assistant turn with a call adds."""
    args: Any = {"arg1": "some_value"}
    user = {"role": "user", "content": "Hey"}
    call = {"role": "assistant", "content": None if null_content else "", "tool_calls": [{
        "id": "call_1___", "type": "function", "function": {
        "name": "tool_name", "arguments": args if object_args else json.dumps(args)}}]}
    prefix = _probe_render(template, [user], None, True, bos_token, eos_token)
    full = _probe_render(template, [user, call], None, False, bos_token, eos_token)
    if prefix is None or full is None:
        return ""
    if eos_token and full.rstrip("\n").endswith(eos_token):
        full = full.rstrip("\n")[:-len(eos_token)]
    n = 0
    while n < min(len(prefix), len(full)) and prefix[n] == full[n]:
        n += 1
    if n and prefix[n - 1] == "<":     # do not cut a special token such as <|im_start|> in two
        n -= 1
    return full[n:]


def _has_tool_turns(msgs: list[dict]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs)


def _add_system(msgs: list[dict], text: str) -> list[dict]:
    if msgs and msgs[0]["role"] == "system":
        head = dict(msgs[0])
        head["content"] = (head["content"] or "") + "\n\n" + text
        return [head] + msgs[1:]
    return [{"role": "system", "content": text}] + msgs


def prepare_tool_messages(msgs: list[dict], template: Optional[str], tools: Optional[list] = None,
                          bos_token: str = "", eos_token: str = "") -> tuple[list[dict], bool]:
    """llama.cpp's handling of tools and tool turns before a template renders them (messages already
    normalized).  Returns the messages and whether the template is given `tools` itself.

    * each assistant tool call is checked (type "function", a function name, arguments a JSON
      string or an object); the arguments become an object where the template needs one, a JSON
      string where it concatenates them;
    * a template that does not show tool calls / tool results gets them as JSON text: the
      assistant's {"tool_calls": [...]} as its content, a tool result as a user message
      {"tool_response": {...}} (only when the request offers tools);
    * a template that does not list the tools gets them in the system message ("You can call any
      of the following tools ...", with an example call in the template's own syntax); in the
      generic format (no known tool-call syntax) the system message also asks for JSON answers;
    * gpt-oss: reasoning_content is passed as the "thinking" field its template reads.
    """
    from engine.tool_calls import detect_format     # engine-internal; imported late, only for tools

    caps = tool_caps(template)
    # the JSON stand-ins for calls and results only in a request that offers tools (without them a
    # template that cannot show a tool turn fails on it, as before)
    calls_as_json = bool(tools) and not caps.tool_calls
    results_as_json = bool(tools) and not caps.tool_responses
    out: list[dict] = []
    for i, m in enumerate(msgs):
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                where = f"messages[{i}].tool_calls[{j}]"
                if not isinstance(tc, dict):
                    raise ValueError(f"{where}: expected a tool call object")
                if tc.get("type", "function") != "function":
                    raise ValueError(f"{where}: unsupported tool call type {_short_repr(tc.get('type'))}")
                fn = tc.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ValueError(f"{where}: missing 'function' with a 'name'")
                args = fn.get("arguments", {})
                if args is None:
                    args = {}
                if isinstance(args, str) and (caps.object_arguments or calls_as_json):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError as e:
                        raise ValueError(f"{where}: 'arguments' is not valid JSON ({e})") from None
                elif isinstance(args, dict) and not caps.object_arguments and caps.tool_calls:
                    args = json.dumps(args, ensure_ascii=False)
                elif not isinstance(args, (str, dict)):
                    raise ValueError(f"{where}: 'arguments' must be a JSON string or an object")
                calls.append({**tc, "type": "function", "function": {**fn, "arguments": args}})
            if not calls_as_json:
                m["tool_calls"] = calls
                if m.get("content") is None and not caps.null_content:
                    m["content"] = ""
            else:
                shown: dict[str, Any] = {"tool_calls": [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"],
                     **({"id": c["id"]} if isinstance(c.get("id"), str) else {})} for c in calls]}
                if m.get("content"):
                    shown["content"] = m["content"]
                m["content"] = json.dumps(shown, ensure_ascii=False, indent=2)
                del m["tool_calls"]
        if m["role"] == "tool" and results_as_json:
            resp: dict[str, Any] = {}
            if isinstance(m.get("name"), str):
                resp["tool"] = m["name"]
            resp["content"] = m.get("content") or ""
            if isinstance(m.get("tool_call_id"), str):
                resp["tool_call_id"] = m["tool_call_id"]
            m = {"role": "user", "content": json.dumps({"tool_response": resp}, ensure_ascii=False, indent=2)}
        if template and "<|channel|>" in template and m["role"] == "assistant" \
                and isinstance(m.get("reasoning_content"), str) and "thinking" not in m:
            m["thinking"] = m["reasoning_content"]
        out.append(m)
    if not tools:
        return out, False
    parts = []
    if (detect_format(template) if template and template.strip() else None) is None:
        parts.append(GENERIC_INSTRUCTION)
    if not caps.tools:
        listing = ("You can call any of the following tools to satisfy the user's requests: "
                   + json.dumps(tools, ensure_ascii=False, indent=2))
        if caps.tool_calls:
            example = _tool_call_example(template, bos_token, eos_token, caps.object_arguments, caps.null_content)
        else:
            example = json.dumps({"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"}}]})
        if example:
            listing += "\n\nExample tool call syntax:\n\n" + example + "\n\n"
        parts.append(listing)
    if parts:
        out = _add_system(out, "\n\n".join(parts))
    return out, caps.tools


# ---------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------
def render_chat(messages: list[dict], template: str | None, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, *, extra_vars: dict | None = None,
                strip_bos: bool = False, polyfill: bool = True, tools: list | None = None) -> tuple[str, str]:
    """Turn OpenAI chat ``messages`` into a prompt string.

    Parameters
    ----------
    messages:
        OpenAI chat messages (see :func:`normalize_messages` for what is accepted).
    template:
        The GGUF's ``tokenizer.chat_template`` (``None`` or empty: ChatML fallback).
    bos_token, eos_token:
        Text of the vocabulary's BOS/EOS tokens, visible to the template.
    add_generation_prompt:
        Whether the prompt ends with the header of a new assistant turn.
    extra_vars:
        Additional template variables (e.g. ``tools``, ``enable_thinking``);
        the four standard variables above take precedence over them.
    strip_bos:
        Remove one leading ``bos_token`` from the rendered text, as llama.cpp
        does when the tokenizer adds BOS itself (avoids a double BOS).
    polyfill:
        Apply llama.cpp's message work-arounds before rendering the GGUF
        template (``developer`` -> ``system``; a system message merged into the
        first user message when the template does not support the system role).
        ``False`` renders the messages exactly as given, like transformers.
    tools:
        OpenAI tools (normalized: see ``engine.tool_calls.normalize_tools``) offered to the model:
        the template's ``tools`` variable when it lists tools itself, else described in the system
        message.  Assistant tool calls and tool results in ``messages`` are prepared as llama.cpp
        does (see :func:`prepare_tool_messages`), with or without ``tools``.

    Returns
    -------
    (prompt, used) where ``used`` is ``"gguf"`` (the file's template) or
    ``"chatml"`` (the fallback).

    Raises
    ------
    ValueError
        One-line message for invalid messages, an invalid template, a template
        calling ``raise_exception`` or any error while rendering.
    """
    msgs = normalize_messages(messages)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"chat template must be a string, got {type(template).__name__}")
    if extra_vars is not None and not isinstance(extra_vars, dict):
        raise ValueError(f"extra template variables must be a dict, got {type(extra_vars).__name__}")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list, got {type(tools).__name__}")
    template_tools = False
    if tools or _has_tool_turns(msgs):
        jinja_template = template if template is not None and template.strip() else None
        msgs, template_tools = prepare_tool_messages(msgs, jinja_template, tools, bos_token, eos_token)

    if template is None or not template.strip():
        if polyfill:
            msgs = _apply_workarounds(msgs, None)
        text, used = render_chatml(msgs, add_generation_prompt), CHATML
    else:
        compiled = _compile_or_raise(template)
        _, template_raised = _environment()
        if polyfill:
            msgs = _apply_workarounds(msgs, template)
        variables = dict(extra_vars or {})
        if template_tools:
            variables["tools"] = copy.deepcopy(tools)
        variables.update(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                         bos_token=bos_token, eos_token=eos_token)
        token = _INPUT_IDS.set(_container_ids(*variables.values()))
        try:
            try:
                text = compiled.render(**variables)
            except template_raised:
                raise
            except Exception:
                # some templates that show tool calls cannot take a null content (of an assistant
                # turn with calls): llama.cpp gives them "" instead
                if not any(m.get("content") is None for m in msgs) or not tool_caps(template).tool_calls:
                    raise
                variables["messages"] = [dict(m, content="") if m.get("content") is None else m for m in msgs]
                _INPUT_IDS.set(_container_ids(*variables.values()))
                text = compiled.render(**variables)
        except template_raised as e:
            raise ValueError(_one_line(f"chat template error: {e.message or 'raise_exception() called'}")) from e
        except RecursionError as e:
            raise ValueError("chat template rendering failed: recursion too deep") from e
        except Exception as e:  # noqa: BLE001 - undefined attrs, None + str, sandbox violations ...
            raise ValueError(_one_line(f"chat template rendering failed: {type(e).__name__}: {e}")) from e
        finally:
            _INPUT_IDS.reset(token)
        used = GGUF

    if strip_bos and bos_token and text.startswith(bos_token):
        text = text[len(bos_token):]
    return text, used


# ---------------------------------------------------------------------------
# llama.cpp's built-in (non-Jinja) chat formats, selected by name
# ---------------------------------------------------------------------------
# These follow ik_llama.cpp's hard-coded formatter (the one behind `--chat-template NAME`
# without --jinja): the messages are used as given (no system-message merging, no BOS/EOS,
# no date headers), content parts joined with "\n" as normalize_messages() does.

_ASCII_WS = " \t\n\v\f\r"


def _trim(text: str) -> str:
    """ik's trim(): strips ASCII whitespace only (a non-ASCII space is kept)."""
    return text.strip(_ASCII_WS)


def _content(m: dict) -> str:
    return m.get("content") or ""


class _Turns:
    """A format that writes each message as ``before + content + after`` looked up by role.

    turns: role -> (before, after); ``"*"`` is the entry for any other role (without it,
    such messages are left out).  ``{role}``, ``{Role}`` and ``{ROLE}`` in the strings are
    the role as given, capitalized and upper-cased.  trim: roles whose content is trimmed
    (``True``: all).  prefix: written first; gen: the generation prompt.
    """

    def __init__(self, turns: dict, gen: str = "", prefix: str = "", trim: Any = False):
        self.turns, self.gen, self.prefix, self.trim = turns, gen, prefix, trim

    def __call__(self, messages: list[dict], add_generation_prompt: bool) -> str:
        out = [self.prefix]
        for m in messages:
            role = m["role"]
            pair = self.turns.get(role, self.turns.get("*"))
            if pair is None:
                continue
            text = _content(m)
            if self.trim is True or (self.trim and role in self.trim):
                text = _trim(text)
            names = {"role": role, "Role": role[:1].upper() + role[1:], "ROLE": role.upper()}
            out.append(pair[0].format(**names) + text + pair[1].format(**names))
        if add_generation_prompt:
            out.append(self.gen)
        return "".join(out)


def _mistral(leading: str, trailing: str, trim_assistant: bool):
    """mistral-v1 / v3 / v3-tekken: [INST] opens a turn, an assistant message closes it."""
    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        out, inside = [], False
        for m in messages:
            if not inside:
                out.append(f"{leading}[INST]{trailing}")
                inside = True
            role, text = m["role"], _content(m)
            if role == "system":
                out.append(text + "\n\n")
            elif role == "user":
                out.append(f"{text}{leading}[/INST]")
            else:
                out.append(trailing + (_trim(text) if trim_assistant else text) + "</s>")
                inside = False
        return "".join(out)   # no generation prompt: the open [INST] turn is the prompt
    return render


def _mistral_v7(messages: list[dict], add_generation_prompt: bool) -> str:
    marks = {"system": ("[SYSTEM_PROMPT] ", "[/SYSTEM_PROMPT]"), "user": ("[INST] ", "[/INST]")}
    out = []
    for m in messages:
        before, after = marks.get(m["role"], (" ", "</s>"))
        out.append(before + _content(m) + after)
    return "".join(out)   # no generation prompt


def _llama2(system: bool, bos_inside: bool = False, strip: bool = False):
    """llama2 and its -sys / -sys-bos / -sys-strip variants (the first [INST] has no BOS)."""
    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        out, inside = ["[INST] "], True
        for m in messages:
            role, text = m["role"], _content(m)
            if strip:
                text = _trim(text)
            if not inside:
                inside = True
                out.append("<s>[INST] " if bos_inside else "[INST] ")
            if role == "system":
                out.append(f"<<SYS>>\n{text}\n<</SYS>>\n\n" if system else text + "\n")
            elif role == "user":
                out.append(text + " [/INST]")
            else:
                out.append(text + "</s>")
                inside = False
        return "".join(out)
    return render


def _merge_system(head: Callable[[str], str], tail: str, model_turn: Callable[[str], str],
                  is_model: Callable[[str], bool], gen: str, trim: bool):
    """Formats without a system role (gemma, orion): the last system text goes in front of the
    next message that is not a model turn, followed by a blank line."""
    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        out, system = [], ""
        for m in messages:
            role, text = m["role"], _content(m)
            text = _trim(text) if trim else text
            if role == "system":
                system = text
            elif is_model(role):
                out.append(model_turn(text))
            else:
                out.append(head(role) + (system + "\n\n" if system else "") + text + tail)
                system = ""
        if add_generation_prompt:
            out.append(gen)
        return "".join(out)
    return render


def _monarch(messages: list[dict], add_generation_prompt: bool) -> str:
    out = [("" if i == 0 else "<s>") + f"{m['role']}\n{_content(m)}</s>\n" for i, m in enumerate(messages)]
    if add_generation_prompt:
        out.append("<s>assistant\n")
    return "".join(out)


def _gigachat(messages: list[dict], add_generation_prompt: bool) -> str:
    has_system = bool(messages) and messages[0]["role"] == "system"
    out = ["<s>" + (_content(messages[0]) + "<|message_sep|>" if has_system else "")]
    for m in messages[1 if has_system else 0:]:
        if m["role"] == "user":
            out.append(f"user<|role_sep|>{_content(m)}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>")
        elif m["role"] == "assistant":
            out.append(f"assistant<|role_sep|>{_content(m)}<|message_sep|>")
    if add_generation_prompt:
        out.append("assistant<|role_sep|>")
    return "".join(out)


_BAILING = {"user": ("<role>HUMAN</role>", ""), "*": ("<role>{ROLE}</role>", "")}
_BAILING2 = _Turns({"user": ("<role>HUMAN</role>", "<|role_end|>"), "*": ("<role>{ROLE}</role>", "<|role_end|>")},
                   gen="<role>ASSISTANT</role>")


def _bailing2(messages: list[dict], add_generation_prompt: bool) -> str:
    lead = "" if messages and messages[0]["role"] == "system" else \
        "<role>SYSTEM</role>detailed thinking off<|role_end|>"
    return lead + _BAILING2(messages, add_generation_prompt)


_DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"

#: ik_llama.cpp's built-in chat formats by their `--chat-template` names
BUILTIN_TEMPLATES: dict[str, Callable[[list[dict], bool], str]] = {
    "chatml": _Turns({"*": ("<|im_start|>{role}\n", "<|im_end|>\n")}, gen="<|im_start|>assistant\n"),
    "llama2": _llama2(system=False),
    "llama2-sys": _llama2(system=True),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True),
    "llama2-sys-strip": _llama2(system=True, strip=True),
    "mistral-v1": _mistral(" ", " ", False),
    "mistral-v3": _mistral("", " ", True),
    "mistral-v3-tekken": _mistral("", "", False),
    "mistral-v7": _mistral_v7,
    "phi3": _Turns({"*": ("<|{role}|>\n", "<|end|>\n")}, gen="<|assistant|>\n"),
    "falcon3": _Turns({"*": ("<|{role}|>\n", "\n")}, gen="<|assistant|>\n"),
    "falcon_e": _Turns({"*": ("{role}", "\n")}, gen="assistant\n"),
    "zephyr": _Turns({"*": ("<|{role}|>\n", "<|endoftext|>\n")}, gen="<|assistant|>\n"),
    "monarch": _monarch,
    "gemma": _merge_system(lambda r: f"<start_of_turn>{r}\n", "<end_of_turn>\n",
                           lambda t: f"<start_of_turn>model\n{t}<end_of_turn>\n", lambda r: r == "assistant",
                           "<start_of_turn>model\n", True),
    "orion": _merge_system(lambda r: "Human: ", "\n\nAssistant: </s>", lambda t: t + "</s>",
                           lambda r: r != "user", "", False),
    "openchat": _Turns({"system": ("", "<|end_of_turn|>"), "*": ("GPT4 Correct {Role}: ", "<|end_of_turn|>")},
                       gen="GPT4 Correct Assistant:"),
    "vicuna": _Turns({"system": ("", "\n\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "</s>\n")},
                     gen="ASSISTANT:"),
    "vicuna-orca": _Turns({"system": ("SYSTEM: ", "\n"), "user": ("USER: ", "\n"),
                           "assistant": ("ASSISTANT: ", "</s>\n")}, gen="ASSISTANT:"),
    "deepseek": _Turns({"system": ("", ""), "user": ("### Instruction:\n", "\n"),
                        "assistant": ("### Response:\n", "\n<|EOT|>\n")}, gen="### Response:\n"),
    "deepseek2": _Turns({"system": ("", "\n\n"), "user": ("User: ", "\n\n"),
                         "assistant": ("Assistant: ", _DEEPSEEK_EOS)}, gen="Assistant:"),
    "deepseek3": _Turns({"system": ("", "\n\n"), "user": ("<｜User｜>", ""),
                         "assistant": ("<｜Assistant｜>", _DEEPSEEK_EOS)}, gen="<｜Assistant｜>"),
    "command-r": _Turns({"system": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
                         "user": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
                         "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>")},
                        gen="<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", trim=True),
    "llama3": _Turns({"*": ("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")},
                     gen="<|start_header_id|>assistant<|end_header_id|>\n\n", trim=True),
    "chatglm3": _Turns({"*": ("<|{role}|>\n ", "")}, gen="<|assistant|>", prefix="[gMASK]sop"),
    "chatglm4": _Turns({"*": ("<|{role}|>\n", "")}, gen="<|assistant|>", prefix="[gMASK]<sop>"),
    "minicpm": _Turns({"user": ("<用户>", "<AI>"), "*": ("", "")}, trim=True),
    "exaone3": _Turns({"system": ("[|system|]", "[|endofturn|]\n"), "user": ("[|user|]", "\n"),
                       "assistant": ("[|assistant|]", "[|endofturn|]\n")}, gen="[|assistant|]", trim=True),
    "rwkv-world": _Turns({"user": ("User: ", "\n\nAssistant:"), "*": ("", "\n\n")}),
    "granite": _Turns({"assistant_tool_call": ("<|start_of_role|>{role}<|end_of_role|><|tool_call|>", "<|end_of_text|>\n"),
                       "*": ("<|start_of_role|>{role}<|end_of_role|>", "<|end_of_text|>\n")},
                      gen="<|start_of_role|>assistant<|end_of_role|>\n"),
    "gigachat": _gigachat,
    "megrez": _Turns({"*": ("<|role_start|>{role}<|role_end|>", "<|turn_end|>")},
                     gen="<|role_start|>assistant<|role_end|>"),
    "llama4": _Turns({"*": ("<|header_start|>{role}<|header_end|>\n\n", "<|eot|>")},
                     gen="<|header_start|>assistant<|header_end|>\n\n", trim=True),
    "hunyuan-moe": _Turns({"system": ("<|startoftext|>", "<|extra_4|>"), "assistant": ("<|startoftext|>", "<|eos|>"),
                           "*": ("<|startoftext|>", "<|extra_0|>")}),
    # ik's kimi-k2 formatter labels user turns "assistant" and assistant turns "user" (sic);
    # kept as ik writes it, so prompts equal ik's
    "kimi-k2": _Turns({"system": ("<|im_system|>system<|im_middle|>", "<|im_end|>"),
                       "assistant": ("<|im_user|>user<|im_middle|>", "<|im_end|>"),
                       "*": ("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>")},
                      gen="<|im_assistant|>assistant<|im_middle|>"),
    "gpt-oss": _Turns({"assistant": ("<|start|>{role}<|message|>", "<|return|>"),
                       "*": ("<|start|>{role}<|message|>", "<|end|>")}, gen="<|start|>assistant"),
    "bitnet": _Turns({"system": ("System: ", ""), "user": ("User: ", "<|eot_id|>Assistant: "), "*": ("", "")}),
    "grok-2": _Turns({"system": ("System: ", "<|separator|>\n\n"), "user": ("Human: ", "<|separator|>\n\n"),
                      "assistant": ("Assistant: ", "<|separator|>\n\n")}, gen="Assistant:", trim={"system", "user"}),
    "bailing": _Turns(_BAILING, gen="<role>ASSISTANT</role>"),
    "bailing-think": _Turns(_BAILING, gen="<role>ASSISTANT</role><think>"),
    "bailing2": _bailing2,
    "seed_oss": _Turns({"*": ("<seed:bos>{role}\n", "<seed:eos>")}, gen="<seed:bos>assistant\n", trim={"assistant"}),
}
BUILTIN_TEMPLATES["deepseek4"] = BUILTIN_TEMPLATES["deepseek3"]   # ik: an alias


def builtin_template_names() -> list[str]:
    """The names `--chat-template` accepts as built-in formats, sorted (as ik lists them)."""
    return sorted(BUILTIN_TEMPLATES)


def render_builtin(name: str, messages: Any, add_generation_prompt: bool = True) -> str:
    """Render OpenAI chat ``messages`` with ik's built-in format ``name`` (messages validated
    by :func:`normalize_messages`; no work-arounds).  Unknown name: ``ValueError`` listing the names."""
    fmt = BUILTIN_TEMPLATES.get(name)
    if fmt is None:
        raise ValueError(f"unknown built-in chat template '{name}'; valid names: "
                         + ", ".join(builtin_template_names()))
    return fmt(normalize_messages(messages), bool(add_generation_prompt))


def builtin_renderer(name: str) -> Callable[..., tuple[str, str]]:
    """A drop-in for :func:`render_chat` that ignores the template/BOS/EOS arguments and renders
    the built-in format ``name`` (what the server uses for ``--chat-template NAME``); it carries
    the name as ``builtin_name`` (these formats have no tool calls)."""
    if name not in BUILTIN_TEMPLATES:
        render_builtin(name, [{"role": "user", "content": ""}])   # raises the listing error

    def render(messages: Any, template: Any = None, bos_token: str = "", eos_token: str = "",
               add_generation_prompt: bool = True, *, extra_vars: Optional[dict] = None,
               **_ignored: Any) -> tuple[str, str]:
        return render_builtin(name, messages, add_generation_prompt), name
    render.builtin_name = name      # type: ignore[attr-defined]  # the server refuses tools for these
    return render
