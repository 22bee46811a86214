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

import datetime as _dt
import json
from functools import lru_cache
from typing import Any

__all__ = ["render_chat", "normalize_messages", "render_chatml", "CHATML", "GGUF"]

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


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _environment():
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
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
# public entry point
# ---------------------------------------------------------------------------
def render_chat(messages: list[dict], template: str | None, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, *, extra_vars: dict | None = None,
                strip_bos: bool = False, polyfill: bool = True) -> tuple[str, str]:
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
        variables.update(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                         bos_token=bos_token, eos_token=eos_token)
        try:
            text = compiled.render(**variables)
        except template_raised as e:
            raise ValueError(_one_line(f"chat template error: {e.message or 'raise_exception() called'}")) from e
        except RecursionError as e:
            raise ValueError("chat template rendering failed: recursion too deep") from e
        except Exception as e:  # noqa: BLE001 - undefined attrs, None + str, sandbox violations ...
            raise ValueError(_one_line(f"chat template rendering failed: {type(e).__name__}: {e}")) from e
        used = GGUF

    if strip_bos and bos_token and text.startswith(bos_token):
        text = text[len(bos_token):]
    return text, used
