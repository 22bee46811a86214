"""Constrained output: llama.cpp's GBNF grammars and JSON schemas as per-token masks (llguidance).

The masks come from llguidance (PyPI `llguidance`: an Earley parser over a lexer, which builds a
token mask from a token trie in tens of microseconds).  This module holds:

  * gbnf_to_lark(text)      llama.cpp's GBNF (its syntax and its error wording, src/llama-grammar.cpp)
                            as an llguidance Lark grammar with the same language: every character is
                            its own lexeme, so the parse is a plain character-level context-free
                            parse, as llama.cpp's (llguidance's own converter makes multi-character
                            lexemes, which its greedy lexer can split differently from a CFG);
  * schema_grammar(schema)  a JSON schema as the grammar text llama-server builds with llguidance
                            ("%llguidance {}\\nstart: %json {...}"), with llama.cpp's conventions:
                            the empty schema {} is any JSON object, an object schema with properties
                            and no additionalProperties allows no other properties, and whitespace is
                            llama.cpp's `space` rule (nothing, one space, or 1-2 newlines and up to 20
                            spaces/tabs, between any two JSON lexemes);
  * check_grammar(text, tokenizer)   raises GrammarError (the request's 400) for a grammar that does
                            not parse or compile;
  * TokenVocab.of(tokenizer, n_vocab) the llguidance tokenizer of a model, built once and cached;
  * GrammarMatcher          one request's parse state: allowed_mask() over the vocabulary, accept(token),
                            is_stopped() (only an end-of-generation token can follow).

A grammar text is GBNF unless it is llguidance's Lark (a line starting with `%llguidance` or
`start:`), which is passed through, as llama.cpp does when built with llguidance.

What the grammar sees of a token is exactly what the server outputs for it (token_to_bytes with
special=False); tokens that output nothing (control, unknown) and look-alike user-defined tokens
(`<...>`) are special to llguidance: never matched by grammar text, only by a `<[id]>` / `<name>`
reference.  Deliberate differences from llama.cpp: llama.cpp's grammar matches a control token's
text (`<|im_end|>`) although the answer then shows nothing for it; left-recursive GBNF rules and
nested repetitions past llama.cpp's rule-count limit are accepted (the Earley parser handles them).

Without llguidance installed every entry point raises GrammarUnavailable (a GrammarError), so the
server answers the constrained-output fields with a clear 400.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np

try:  # optional: only constrained output needs it
    import llguidance as _llg
except ImportError:  # pragma: no cover - exercised where the package is missing
    _llg = None

__all__ = ["GrammarError", "GrammarUnavailable", "available", "gbnf_to_lark", "schema_grammar", "schema_lark",
           "is_lark", "compile_grammar", "check_grammar", "TokenVocab", "GrammarMatcher", "ANY_OBJECT_SCHEMA",
           "TRIGGER_TOKEN", "TRIGGER_WORD", "TRIGGER_PATTERN", "TRIGGER_PATTERN_FULL"]

MAX_REPETITION = 2000          # llama.cpp's MAX_REPETITION_THRESHOLD for {m,n}
# llama.cpp's json-schema-to-grammar SPACE_RULE: | " " | "\n"{1,2} [ \t]{0,20}
JSON_SPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
ANY_OBJECT_SCHEMA: dict = {"type": "object"}
_ATTR_UNKNOWN, _ATTR_CONTROL, _ATTR_USER_DEFINED = 1 << 0, 1 << 3, 1 << 4   # engine.tokenizer's flags


class GrammarError(ValueError):
    """A grammar or schema that cannot be used; the message is what the client is told."""


class GrammarUnavailable(GrammarError):
    """The llguidance package is not installed."""


def available() -> bool:
    """Whether constrained output can run here (llguidance is importable)."""
    return _llg is not None


def _need_llg() -> Any:
    if _llg is None:
        raise GrammarUnavailable("constrained output (grammar, json_schema, response_format) needs the "
                                 "'llguidance' Python package, which is not installed on this server")
    return _llg


# ---------------------------------------------------------------------------------------------
# GBNF -> Lark
# ---------------------------------------------------------------------------------------------

def is_lark(text: str) -> bool:
    """llguidance's own Lark syntax (llama.cpp built with llguidance takes it the same way)."""
    return re.search(r"(?m)^\s*(%llguidance\b|start\s*:)", text) is not None


def _is_word(c: str) -> bool:
    # llama.cpp's is_word_char: ASCII letters, digits and '-' (no underscore)
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9") or c == "-"


_SAFE_LITERAL = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !#$%&'()*+,-./:;<=>?@^_`{|}~")


def _char_lexeme(cp: int) -> str:
    """One character as a Lark lexeme: a literal when plainly printable, else a one-character regex."""
    ch = chr(cp)
    return f'"{ch}"' if ch in _SAFE_LITERAL else f"/\\x{{{cp:X}}}/"


class _Gbnf:
    """A recursive-descent reader of llama.cpp's GBNF, writing Lark as it goes."""

    def __init__(self, src: str, token_id: Callable[[str], int | None] | None, n_vocab: int | None) -> None:
        self.src, self.token_id, self.n_vocab = src, token_id, n_vocab
        self.rules: dict[str, str] = {}          # GBNF name -> Lark body (the last definition wins, as llama.cpp)
        self.refs: list[str] = []                # names referenced, in order
        self.lark_names: dict[str, str] = {}

    # -- helpers ---------------------------------------------------------------------------
    def fail(self, msg: str, pos: int | None = None) -> GrammarError:
        if pos is not None:
            rest = self.src[pos:pos + 40]
            msg = f"{msg} at {rest!r}" if rest else f"{msg} at the end"
        return GrammarError(msg)

    def at(self, pos: int) -> str:
        return self.src[pos] if pos < len(self.src) else ""

    def space(self, pos: int, newline_ok: bool) -> int:
        s = self.src
        while pos < len(s) and (s[pos] in " \t#" or (newline_ok and s[pos] in "\r\n")):
            if s[pos] == "#":
                while pos < len(s) and s[pos] not in "\r\n":
                    pos += 1
            else:
                pos += 1
        return pos

    def name(self, pos: int) -> int:
        end = pos
        while _is_word(self.at(end)):
            end += 1
        if end == pos:
            raise self.fail("expecting name", pos)
        return end

    def integer(self, pos: int) -> int:
        end = pos
        while self.at(end).isdigit() and self.at(end).isascii():
            end += 1
        if end == pos:
            raise self.fail("expecting integer", pos)
        return end

    def char(self, pos: int) -> tuple[int, int]:
        s = self.src
        if pos >= len(s):
            raise self.fail("unexpected end of input")
        if s[pos] != "\\":
            return ord(s[pos]), pos + 1
        esc = self.at(pos + 1)
        width = {"x": 2, "u": 4, "U": 8}.get(esc)
        if width:
            digits = s[pos + 2:pos + 2 + width]
            if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise self.fail(f"expecting {width} hex chars", pos + 2)
            cp = int(digits, 16)
            if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                raise self.fail("invalid code point", pos)
            return cp, pos + 2 + width
        simple = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93}
        if esc in simple:
            return simple[esc], pos + 2
        raise self.fail("unknown escape", pos)

    def ref(self, name: str) -> str:
        if name not in self.lark_names:
            base = "r_" + name.lower().replace("-", "_")
            taken = set(self.lark_names.values())
            lark, i = base, 1
            while lark in taken:
                i += 1
                lark = f"{base}_{i}"
            self.lark_names[name] = lark
        return self.lark_names[name]

    # -- grammar ---------------------------------------------------------------------------
    def parse(self) -> str:
        pos = self.space(0, True)
        while pos < len(self.src):
            pos = self.rule(pos)
        for name in self.refs:
            if name not in self.rules:
                raise GrammarError(f"Undefined rule identifier '{name}'")
        if "root" not in self.rules:
            raise GrammarError('grammar does not contain a "root" symbol')
        lines = ["%llguidance {}", f"start: {self.ref('root')}"]
        lines += [f"{self.ref(n)}: {body}" for n, body in self.rules.items()]
        return "\n".join(lines) + "\n"

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        name = self.src[pos:end]
        self.ref(name)
        pos = self.space(end, False)
        if self.src[pos:pos + 3] != "::=":
            raise self.fail("expecting ::=", pos)
        pos = self.space(pos + 3, True)
        body, pos = self.alternates(pos, False)
        self.rules[name] = body
        c = self.at(pos)
        if c == "\r":
            pos += 2 if self.at(pos + 1) == "\n" else 1
        elif c == "\n":
            pos += 1
        elif c:
            raise self.fail("expecting newline or end", pos)
        return self.space(pos, True)

    def alternates(self, pos: int, nested: bool) -> tuple[str, int]:
        seq, pos = self.sequence(pos, nested)
        alts = [seq]
        while self.at(pos) == "|":
            pos = self.space(pos + 1, True)
            seq, pos = self.sequence(pos, nested)
            alts.append(seq)
        return " | ".join(alts), pos

    def sequence(self, pos: int, nested: bool) -> tuple[str, int]:
        items: list[str] = []          # Lark for each symbol; repetition applies to the last one
        last: int | None = None        # index in items of the last symbol, None before the first
        s = self.src

        def repeat(lo: int, hi: int | None) -> None:
            if last is None:
                raise self.fail("expecting preceding item to */+/?/{", pos)
            item = items[last]
            suffix = ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}") if hi is None else \
                "?" if (lo, hi) == (0, 1) else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
            items[last] = f"{item}{suffix}"

        while pos < len(s):
            c = s[pos]
            if c == '"':
                pos += 1
                chars = []
                while self.at(pos) != '"':
                    if pos >= len(s):
                        raise self.fail("unexpected end of input")
                    cp, pos = self.char(pos)
                    chars.append(_char_lexeme(cp))
                pos = self.space(pos + 1, nested)
                # the literal is one symbol: a repetition repeats all of it
                items.append(chars[0] if len(chars) == 1 else f"({' '.join(chars)})" if chars else '""')
                last = len(items) - 1
            elif c == "[":
                pos += 1
                neg = self.at(pos) == "^"
                if neg:
                    pos += 1
                parts = []
                while self.at(pos) != "]":
                    if pos >= len(s):
                        raise self.fail("unexpected end of input")
                    lo, pos = self.char(pos)
                    if self.at(pos) == "-" and self.at(pos + 1) != "]":
                        if pos + 1 >= len(s):
                            raise self.fail("unexpected end of input")
                        hi, pos = self.char(pos + 1)
                        parts.append(f"\\x{{{lo:X}}}-\\x{{{hi:X}}}")
                    else:
                        parts.append(f"\\x{{{lo:X}}}")
                pos = self.space(pos + 1, nested)
                # llama.cpp: an empty class adds no element (it matches the empty string)
                items.append(f"/[{'^' if neg else ''}{''.join(parts)}]/" if parts else '""')
                last = len(items) - 1
            elif c in "<!":
                neg = c == "!"
                if neg:
                    pos += 1
                tid, pos = self.token(pos)
                pos = self.space(pos, nested)
                items.append(f"<[^{tid}]>" if neg else f"<[{tid}]>")
                last = len(items) - 1
            elif _is_word(c):
                end = self.name(pos)
                name = s[pos:end]
                self.refs.append(name)
                items.append(self.ref(name))
                last = len(items) - 1
                pos = self.space(end, nested)
            elif c == "(":
                pos = self.space(pos + 1, True)
                body, pos = self.alternates(pos, True)
                if self.at(pos) != ")":
                    raise self.fail("expecting ')'", pos)
                pos = self.space(pos + 1, nested)
                items.append(f"({body})")
                last = len(items) - 1
            elif c == ".":
                items.append("/(?s:.)/")       # any one character, newline included (llama.cpp's CHAR_ANY)
                last = len(items) - 1
                pos = self.space(pos + 1, nested)
            elif c in "*+?":
                pos = self.space(pos + 1, nested)
                repeat(*{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
            elif c == "{":
                pos = self.space(pos + 1, nested)
                if not (self.at(pos).isdigit() and self.at(pos).isascii()):
                    raise self.fail("expecting an int", pos)
                end = self.integer(pos)
                lo, hi = int(s[pos:end]), None
                pos = self.space(end, nested)
                if self.at(pos) == "}":
                    hi = lo
                    pos = self.space(pos + 1, nested)
                elif self.at(pos) == ",":
                    pos = self.space(pos + 1, nested)
                    if self.at(pos).isdigit() and self.at(pos).isascii():
                        end = self.integer(pos)
                        hi = int(s[pos:end])
                        pos = self.space(end, nested)
                    if self.at(pos) != "}":
                        raise self.fail("expecting '}'", pos)
                    pos = self.space(pos + 1, nested)
                else:
                    raise self.fail("expecting ','", pos)
                if lo > MAX_REPETITION or (hi is not None and hi > MAX_REPETITION):
                    raise GrammarError("number of repetitions exceeds sane defaults, please reduce the number "
                                       "of repetitions")
                if hi is not None and hi < lo:
                    raise self.fail(f"the repetition {{{lo},{hi}}} has its maximum below its minimum", pos)
                repeat(lo, hi)
            else:
                break
        return (" ".join(items) if items else '""'), pos

    def token(self, pos: int) -> tuple[int, int]:
        """<[id]> or <text> (one token of the vocabulary, special tokens included)."""
        s = self.src
        start = pos
        if self.at(pos) != "<":
            raise self.fail("expecting '<'", pos)
        pos += 1
        if self.at(pos) == "[":
            end = self.integer(pos + 1)
            tid = int(s[pos + 1:end])
            if self.at(end) != "]":
                raise self.fail("expecting ']'", end)
            if self.at(end + 1) != ">":
                raise self.fail("expecting '>'", end + 1)
            if self.n_vocab is not None and tid >= self.n_vocab:
                raise GrammarError(f"token id {tid} is out of range [0, {self.n_vocab})")
            return tid, end + 2
        if self.token_id is None:
            raise self.fail("no vocab to parse token", start)
        end = s.find(">", pos)
        if end < 0:
            raise self.fail("expecting '>'", len(s))
        text = s[start:end + 1]
        tid = self.token_id(text)
        if tid is None:
            raise GrammarError(f"invalid token '{text}'")
        return tid, end + 1


def gbnf_to_lark(text: str, token_id: Callable[[str], int | None] | None = None,
                 n_vocab: int | None = None) -> str:
    """An llguidance Lark grammar with the language of llama.cpp's GBNF `text`; GrammarError (with
    llama.cpp's wording) when it does not parse.  token_id: maps a `<text>` token reference to its id
    (None: not one token); n_vocab bounds `<[id]>` references."""
    if not isinstance(text, str):
        raise GrammarError("the grammar must be a string")
    return _Gbnf(text, token_id, n_vocab).parse()


# ---------------------------------------------------------------------------------------------
# JSON schema
# ---------------------------------------------------------------------------------------------

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "unevaluatedItems")


def _closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of schema where an object schema listing properties but saying nothing about others
    allows none (llama.cpp's converter never generates unlisted properties).  Members of allOf are
    left open: closing each would forbid the properties of the others."""
    if isinstance(schema, list):
        return [_closed_objects(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if ("properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out
            and not in_all_of and out.get("type", "object") in ("object", ["object"])):
        out["additionalProperties"] = False
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {n: _closed_objects(s) for n, s in out[k].items()}
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_closed_objects(s) for s in out[k]]
    for k in _SUBSCHEMA_ONE:
        if k in out:
            out[k] = _closed_objects(out[k])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed_objects(out["additionalProperties"])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_closed_objects(s, in_all_of=True) for s in out["allOf"]]
    return out


def schema_lark(schema: Any) -> str:
    """A JSON schema as one llguidance Lark rule body ("%json {...}"), with the conventions of
    schema_grammar; usable inside a larger grammar (tool calls)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
    if not schema:
        schema = dict(ANY_OBJECT_SCHEMA)     # llama.cpp: the empty schema is any object
    schema = _closed_objects(schema)
    opts = dict(schema["x-guidance"]) if isinstance(schema.get("x-guidance"), dict) else {}
    if "whitespace_pattern" not in opts and "whitespace_flexible" not in opts:
        opts["whitespace_pattern"] = JSON_SPACE
    schema["x-guidance"] = opts
    try:
        body = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"the JSON schema cannot be written as JSON: {e}") from None
    return "%json " + body


def schema_grammar(schema: Any) -> str:
    """The grammar text for a JSON schema, as llama-server with llguidance writes it
    ("%llguidance {}\\nstart: %json <schema>"), after llama.cpp's conventions (module docstring).
    A schema's own "x-guidance" options (llguidance's JSON options) take precedence: e.g.
    {"whitespace_flexible": false} for compact JSON with no whitespace at all."""
    return "%llguidance {}\nstart: " + schema_lark(schema) + "\n"


# ---------------------------------------------------------------------------------------------
# compiling and checking
# ---------------------------------------------------------------------------------------------

def compile_grammar(text: str, vocab: "TokenVocab | None" = None) -> str:
    """llguidance's grammar object (serialized) for a grammar text: GBNF, or llguidance Lark.
    vocab resolves `<text>` token references of GBNF."""
    llg = _need_llg()
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar is empty")
    lark = text if is_lark(text) else _gbnf_cached(text, vocab)
    return llg.LLMatcher.grammar_from_lark(lark)


def _gbnf_cached(text: str, vocab: "TokenVocab | None") -> str:
    if vocab is None:
        return _gbnf_plain(text)
    return vocab.gbnf(text)


@functools.lru_cache(maxsize=64)
def _gbnf_plain(text: str) -> str:
    return gbnf_to_lark(text)


def _clean_error(msg: str) -> str:
    return msg.strip().replace("\n\n", "\n")


def check_grammar(text: str, tokenizer: Any = None, n_vocab: int | None = None) -> None:
    """GrammarError unless `text` (GBNF or llguidance Lark) compiles, for this tokenizer when given
    (which builds its TokenVocab, once per model)."""
    llg = _need_llg()
    vocab = TokenVocab.of(tokenizer, n_vocab) if tokenizer is not None else None
    g = compile_grammar(text, vocab)
    err = llg.LLMatcher.validate_grammar(g, vocab.lltok if vocab is not None else None)
    if err:
        raise GrammarError(_clean_error(err))


# ---------------------------------------------------------------------------------------------
# the vocabulary and the per-request matcher
# ---------------------------------------------------------------------------------------------

class _TokenizerView:
    """What llguidance's TokenizerWrapper reads: token byte strings, EOS / BOS and an encoder."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, encode: Callable[[str], list[int]]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, bos
        self.special_token_ids: list[int] = []
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._encode(text))


class TokenVocab:
    """A model's vocabulary as llguidance needs it (the LLTokenizer with its token trie), built once
    per tokenizer and logits width: TokenVocab.of(tokenizer, n_vocab)."""

    _cache: "weakref.WeakKeyDictionary[Any, dict[int, TokenVocab]]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, n_vocab: int | None = None) -> None:
        llg = _need_llg()
        n_tok = int(tokenizer.n_vocab)
        self.n_vocab = int(n_vocab) if n_vocab is not None else n_tok
        attr = getattr(tokenizer, "token_attr", None)
        tokens: list[bytes] = []
        # each token's text as a lazy grammar's trigger buffer sees it (special tokens' own text,
        # as llama.cpp's token_to_piece), and the ids llguidance holds as special
        self.pieces: list[bytes] = []
        special: set[int] = set()
        for i in range(min(n_tok, self.n_vocab)):
            out = tokenizer.token_to_bytes(i, False)      # what the server writes for the token
            full = tokenizer.token_to_bytes(i, True)
            a = int(attr(i)) if attr is not None else 0
            looks_special = a & _ATTR_USER_DEFINED and full[:1] == b"<" and full[-1:] == b">"
            if (not out and full) or a & (_ATTR_CONTROL | _ATTR_UNKNOWN) or looks_special:
                tokens.append(b"\xff" + full if full else b"")   # llguidance's mark of a special token
                self.pieces.append(full)
                special.add(i)
            else:
                tokens.append(out)
                self.pieces.append(out)
        tokens += [b""] * (self.n_vocab - len(tokens))    # logits wider than the vocabulary
        self.pieces += [b""] * (self.n_vocab - len(self.pieces))
        self.special_ids: frozenset[int] = frozenset(special)
        eog = sorted(int(t) for t in getattr(tokenizer, "eog_ids", ()) if 0 <= int(t) < self.n_vocab)
        eos = getattr(tokenizer, "eos_id", None)
        if not eog and eos is not None and 0 <= int(eos) < self.n_vocab:
            eog = [int(eos)]
        self.eog_ids: tuple[int, ...] = tuple(eog)
        enc = getattr(tokenizer, "encode", None)
        encode = (lambda s: enc(s, add_special=False, parse_special=False)) if enc is not None else (lambda s: [])
        view = _TokenizerView(tokens, eog[0] if eog else 0, getattr(tokenizer, "bos_id", None), encode)
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(view), n_vocab=self.n_vocab,
                                     eos_token=list(eog) if eog else None)
        self._tokenizer = weakref.ref(tokenizer) if _weakrefable(tokenizer) else (lambda t=tokenizer: t)
        self._gbnf: dict[str, str] = {}

    @classmethod
    def of(cls, tokenizer: Any, n_vocab: int | None = None) -> "TokenVocab":
        """The cached TokenVocab of tokenizer (built on first use: about 0.3 s for 100k tokens)."""
        if isinstance(tokenizer, TokenVocab):
            return tokenizer
        width = int(n_vocab) if n_vocab is not None else int(tokenizer.n_vocab)
        with cls._lock:
            try:
                per = cls._cache.setdefault(tokenizer, {})
            except TypeError:          # not weak-referenceable: no caching
                per = {}
            hit = per.get(width)
            if hit is None:
                hit = per[width] = cls(tokenizer, width)
            return hit

    def token_id(self, text: str) -> int | None:
        """The id of a `<text>` GBNF token reference: the text as exactly one token (special tokens
        parsed), else None."""
        tok = self._tokenizer()
        enc = getattr(tok, "encode", None)
        if enc is None:
            return None
        try:
            ids = list(enc(text, add_special=False, parse_special=True))
        except Exception:  # noqa: BLE001 - a text the tokenizer refuses is no token
            return None
        return int(ids[0]) if len(ids) == 1 and 0 <= int(ids[0]) < self.n_vocab else None

    def special_id(self, text: str) -> int | None:
        """The id of `text` when it is exactly one token that llguidance holds as special (grammar
        text never matches it: a grammar must name it as `<[id]>`), else None."""
        tid = self.token_id(text)
        return tid if tid is not None and tid in self.special_ids else None

    def encode_text(self, text: str) -> list[int]:
        """Plain text (no special-token parsing) as token ids of this vocabulary."""
        tok = self._tokenizer()
        enc = getattr(tok, "encode", None)
        return [int(t) for t in enc(text, add_special=False, parse_special=False)] if enc is not None else []

    def gbnf(self, text: str) -> str:
        """gbnf_to_lark with this vocabulary's token references (cached per text)."""
        hit = self._gbnf.get(text)
        if hit is None:
            hit = gbnf_to_lark(text, self.token_id, self.n_vocab)
            if len(self._gbnf) >= 64:
                self._gbnf.clear()
            self._gbnf[text] = hit
        return hit


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


# llama.cpp's grammar trigger kinds (common_grammar_trigger_type), by their JSON numbers
TRIGGER_TOKEN, TRIGGER_WORD, TRIGGER_PATTERN, TRIGGER_PATTERN_FULL = 0, 1, 2, 3


def normalize_triggers(triggers: Any) -> tuple[dict, ...]:
    """Lazy-grammar triggers in llama-server's JSON form, checked: [{"type": 0..3, "value": str}
    (+ "token": id for type 0)].  GrammarError (one line) for anything else or a bad pattern."""
    if triggers is None:
        return ()
    if not isinstance(triggers, (list, tuple)):
        raise GrammarError("'grammar_triggers' must be an array of {\"type\", \"value\"} objects")
    out = []
    for i, t in enumerate(triggers):
        if not isinstance(t, dict):
            raise GrammarError(f"grammar_triggers[{i}] must be an object with 'type' and 'value'")
        kind, value = t.get("type"), t.get("value")
        if isinstance(kind, bool) or not isinstance(kind, int) or not isinstance(value, str):
            raise GrammarError(f"grammar_triggers[{i}]: 'type' must be an integer and 'value' a string")
        if kind not in (TRIGGER_TOKEN, TRIGGER_WORD, TRIGGER_PATTERN, TRIGGER_PATTERN_FULL):
            raise GrammarError("Unknown grammar trigger type")
        item: dict = {"type": kind, "value": value}
        if kind == TRIGGER_TOKEN:
            tok = t.get("token")
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise GrammarError(f"grammar_triggers[{i}]: a token trigger (type 0) needs its 'token' id")
            item["token"] = tok
        elif kind != TRIGGER_WORD:
            _trigger_regex(_anchored(value) if kind == TRIGGER_PATTERN_FULL else value)
        out.append(item)
    return tuple(out)


def _anchored(pattern: str) -> str:
    # llama.cpp's PATTERN_FULL: the pattern must match the whole text generated so far
    if not pattern:
        return "^$"
    return ("" if pattern.startswith("^") else "^") + pattern + ("" if pattern.endswith("$") else "$")


@functools.lru_cache(maxsize=256)
def _trigger_regex(pattern: str) -> "re.Pattern[bytes]":
    # over bytes, as llama.cpp's std::regex runs over the UTF-8 text
    try:
        return re.compile(pattern.encode("utf-8"))
    except re.error as e:
        raise GrammarError(f"invalid grammar trigger pattern '{pattern}': {e}") from None


class GrammarMatcher:
    """The parse state of one generation: which tokens may come next, and the tokens taken so far.

    allowed_mask() is a bool array over the vocabulary (end-of-generation tokens are in it once the
    grammar is satisfied, and are all it holds once nothing else can follow); accept(token) advances
    the state.  is_stopped(): only an end-of-generation token can follow (the grammar is complete).

    lazy (llama.cpp's grammar_lazy): the grammar constrains nothing until a trigger fires (triggers:
    normalize_triggers' form).  Until then every token is allowed and its text goes to a buffer; a
    token trigger fires on that token (which the grammar then takes), a word when the buffer holds
    it, a pattern when it matches the buffer (from its first non-empty group, else from the match).
    The grammar then takes the buffer's text from there on: the tokens that lie wholly after that
    point as they are, the one it cuts re-encoded from the cut (llguidance takes tokens, not text).
    rollback(n) undoes the last n accepted tokens (banned strings), trigger state included."""

    def __init__(self, grammar: str, vocab: TokenVocab, lazy: bool = False, triggers: Sequence[dict] = ()) -> None:
        llg = _need_llg()
        self.vocab = vocab
        self.n_vocab = vocab.n_vocab
        self.grammar = grammar
        self._m = llg.LLMatcher(vocab.lltok, compile_grammar(grammar, vocab), log_level=0)
        if self._m.is_error():
            raise GrammarError(_clean_error(self._m.get_error()))
        self._mask: np.ndarray | None = None
        self.n_accepted = 0
        self.lazy = bool(lazy)
        trig = normalize_triggers(list(triggers))
        self._trigger_tokens = {t["token"] for t in trig if t["type"] == TRIGGER_TOKEN}
        # words and patterns in their order (llama.cpp tries them in order; the first that fires wins)
        self._searches: list[tuple[bytes | None, "re.Pattern[bytes] | None"]] = [
            (t["value"].encode("utf-8"), None) if t["type"] == TRIGGER_WORD else
            (None, _trigger_regex(_anchored(t["value"]) if t["type"] == TRIGGER_PATTERN_FULL else t["value"]))
            for t in trig if t["type"] != TRIGGER_TOKEN]
        self.awaiting = self.lazy                    # no trigger has fired yet
        self._buf = bytearray()                      # text since the start, while awaiting
        self._spans: list[tuple[int, int, int, int]] = []   # (step, token, start, end) in _buf
        self._steps: list[int] = []                  # matcher tokens consumed at each accept()
        self._fired_at = -1                          # the step whose token fired the trigger

    @property
    def error(self) -> str:
        """Why the matcher failed ('' while it has not)."""
        return self._m.get_error() if self._m.is_error() else ""

    def allowed_mask(self) -> np.ndarray:
        """bool (n_vocab,): the tokens the grammar allows next (cached until accept()); all of them
        while a lazy grammar waits for its trigger."""
        if self._mask is None:
            if self.awaiting:
                self._mask = np.ones(self.n_vocab, dtype=np.bool_)
            else:
                bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
                self._mask = np.unpackbits(bits, count=self.n_vocab, bitorder="little").view(np.bool_)
        return self._mask

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of logits with every token the grammar forbids at -inf (logits as they are while a
        lazy grammar waits)."""
        if self.awaiting:
            return logits
        return np.where(self.allowed_mask(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def _consume(self, ids: Sequence[int]) -> bool:
        n = 0
        ok = True
        for t in ids:
            if not self._m.consume_token(int(t)):
                ok = False
                break
            n += 1
        self.n_accepted += n
        self._steps.append(n)
        return ok

    def accept(self, token: int) -> bool:
        """Advance past token; False (and the matcher is failed for good) if the grammar forbids it."""
        self._mask = None
        token = int(token)
        if not self.awaiting:
            return self._consume([token])
        step = len(self._steps)
        if token in self._trigger_tokens:
            self.awaiting, self._fired_at = False, step
            return self._consume([token])
        start = len(self._buf)
        self._buf += self.vocab.pieces[token] if 0 <= token < len(self.vocab.pieces) else b""
        self._spans.append((step, token, start, len(self._buf)))
        at = self._find_trigger(start)
        if at < 0:
            self._steps.append(0)
            return True
        self.awaiting, self._fired_at = False, step
        ids: list[int] = []
        for _step, tok, a, b in self._spans:
            if b <= at:
                continue
            if a >= at:
                ids.append(tok)
            else:                                    # the token the trigger starts inside of
                ids += self.vocab.encode_text(bytes(self._buf[at:b]).decode("utf-8", errors="replace"))
        return self._consume(ids)

    def _find_trigger(self, start: int) -> int:
        """Where the grammar's text starts in the buffer (-1: no trigger fires yet)."""
        buf = bytes(self._buf)
        for word, rx in self._searches:
            if word is not None:
                # earlier searches found nothing: a new match ends inside the newest piece
                i = buf.find(word, max(0, start - len(word) + 1)) if word else -1
                if i >= 0:
                    return i
                continue
            m = rx.search(buf)
            if m is not None:
                return next((m.start(g) for g in range(1, (rx.groups or 0) + 1) if m.end(g) > m.start(g) >= 0),
                            m.start())
        return -1

    def rollback(self, n: int) -> None:
        """Undo the last n accept() calls (a lazy grammar waits again when its trigger is undone)."""
        n = min(int(n), len(self._steps))
        if n <= 0:
            return
        undo = sum(self._steps[-n:])
        del self._steps[-n:]
        if undo:
            self._m.rollback(undo)
            self.n_accepted -= undo
        self._mask = None
        if self.lazy:
            keep = len(self._steps)
            if self._fired_at >= keep:
                self.awaiting, self._fired_at = True, -1
            while self._spans and self._spans[-1][0] >= keep:
                self._spans.pop()
            del self._buf[self._spans[-1][3] if self._spans else 0:]

    def is_stopped(self) -> bool:
        """Nothing but an end-of-generation token can follow (also true once failed)."""
        return not self.awaiting and bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar (always, while a lazy grammar
        waits for its trigger)."""
        return self.awaiting or bool(self._m.is_accepting())

    def fallback_token(self) -> int | None:
        """The token to end with when no allowed token is left to sample (an end-of-generation one)."""
        return self.vocab.eog_ids[0] if self.vocab.eog_ids else None

    @classmethod
    def for_tokenizer(cls, grammar: str, tokenizer: Any, n_vocab: int | None = None, lazy: bool = False,
                      triggers: Sequence[dict] = ()) -> "GrammarMatcher":
        return cls(grammar, TokenVocab.of(tokenizer, n_vocab), lazy, triggers)


def token_texts(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text the server writes for ids (token_to_bytes, special=False), for tests and tools."""
    return b"".join(tokenizer.token_to_bytes(int(t), False) for t in ids).decode("utf-8", errors="replace")
