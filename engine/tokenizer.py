"""Text <-> token ids for GGUF vocabularies, following llama.cpp's tokenizer semantics.

Two vocabulary families are supported:

* BPE (``tokenizer.ggml.model == "gpt2"``): regex pre-tokenizer chosen by
  ``tokenizer.ggml.pre``, GPT-2 byte-to-unicode encoding, merges ranked by their
  order in ``tokenizer.ggml.merges``.
* SentencePiece (``tokenizer.ggml.model == "llama"``): llama.cpp's score-driven
  bigram merging with ``<0xXX>`` byte fallback and whitespace escaped as U+2581.

The goal is bit-exact agreement with llama.cpp's ``llama_tokenize`` /
``llama_detokenize``, including its quirks (e.g. how ``\\p{..}`` classes are
approximated for non-ASCII text, see ``_translate_regex``).
"""
from __future__ import annotations

import heapq
import re
import unicodedata
from typing import Any, Callable

__all__ = ["Tokenizer"]

# ---------------------------------------------------------------------------
# token attributes (bit flags with the same meaning as llama.cpp's llama_token_attr)
# ---------------------------------------------------------------------------
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

# GGUF token_type values (gguf.TokenType) -> attribute
_TOKEN_TYPE_TO_ATTR = {
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

_SPACE_ESC = "\u2581"  # SentencePiece's visible space "▁"

# ---------------------------------------------------------------------------
# GPT-2 byte <-> unicode mapping
# ---------------------------------------------------------------------------


def gpt2_byte_chars() -> list[str]:
    """Byte value -> printable unicode char, as in GPT-2's bytes_to_unicode()."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table: dict[int, int] = {b: b for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return [chr(table[b]) for b in range(256)]


_BYTE_CHARS = gpt2_byte_chars()
# str.translate table applied to bytes decoded as latin-1 (one char per byte)
_BYTE_ENCODE_TABLE = {b: _BYTE_CHARS[b] for b in range(256)}
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_CHARS)}


def merge_pairs(syms: list[str], priority: Callable[[str, str], float | None]) -> list[str]:
    """Repeatedly merge the adjacent pair with the lowest priority value (ties: leftmost first).

    One loop for both tokenizer families: BPE ranks pairs by merge order, SPM by the negated
    score of the merged piece. Symbols form a linked list; stale heap entries are skipped.
    """
    n = len(syms)
    if n < 2:
        return [x for x in syms if x]
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        r = priority(syms[i], syms[i + 1])
        if r is not None:
            heap.append((r, i, i + 1, syms[i] + syms[i + 1]))
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        _, left, right, text = pop(heap)
        ls, rs = syms[left], syms[right]
        if not ls or not rs or ls + rs != text:
            continue  # stale entry
        syms[left] = text
        syms[right] = ""
        nx = nxt[right]
        nxt[left] = nx
        if nx >= 0:
            prv[nx] = left
        p = prv[left]
        if p >= 0:
            r = priority(syms[p], text)
            if r is not None:
                push(heap, (r, p, left, syms[p] + text))
        if nx >= 0:
            r = priority(text, syms[nx])
            if r is not None:
                push(heap, (r, left, nx, text + syms[nx]))
    return [x for x in syms if x]


def _byte_encode(word: str) -> str:
    """UTF-8 bytes of `word` spelled with the GPT-2 byte alphabet."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


# ---------------------------------------------------------------------------
# Unicode classification (llama.cpp's flags: one category per code point + whitespace)
# ---------------------------------------------------------------------------

# White_Space property (PropList.txt)
_WHITESPACE = frozenset(
    list(range(0x09, 0x0E))
    + list(range(0x2000, 0x200B))
    + [0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

# Code points assigned in Unicode 15.0/15.1 (llama.cpp's tables are 15.1), as
# "start[-end]Category".  Used only where the running Python's unicodedata says
# "unassigned", so older Pythons classify these like llama.cpp does.
_UNICODE_15_ADDITIONS = (
    "CF3M ECEM 2FFC-2FFFS 31EFS 10EFD-10EFFM 1123F-11240L 11241M 11B00-11B09P 11F00-11F01M "
    "11F02L 11F03M 11F04-11F10L 11F12-11F33L 11F34-11F3AM 11F3E-11F42M 11F43-11F4FP "
    "11F50-11F59N 1342FL 13439-1343FC 13440M 13441-13446L 13447-13455M 1B132L 1B155L "
    "1D2C0-1D2D3N 1DF25-1DF2AL 1E030-1E06DL 1E08FM 1E4D0-1E4EBL 1E4EC-1E4EFM 1E4F0-1E4F9N "
    "1F6DCS 1F774-1F776S 1F77B-1F77FS 1F7D9S 1FA75-1FA77S 1FA87-1FA88S 1FAAD-1FAAFS "
    "1FABB-1FABDS 1FABFS 1FACE-1FACFS 1FADA-1FADBS 1FAE8S 1FAF7-1FAF8S 2B739L 2EBF0-2EE5DL "
    "31350-323AFL"
)


def _parse_additions(spec: str) -> list[tuple[int, int, str]]:
    out = []
    for item in spec.split():
        cat = item[-1]
        lo, _, hi = item[:-1].partition("-")
        out.append((int(lo, 16), int(hi or lo, 16), cat))
    return out


_ADDITIONS = _parse_additions(_UNICODE_15_ADDITIONS)


def _major_category(cp: int) -> str:
    """'L','N','P','M','S','Z','C' or 'U' (unassigned) for a code point."""
    cat = unicodedata.category(chr(cp))
    if cat == "Cn":
        for lo, hi, c in _ADDITIONS:
            if lo <= cp <= hi:
                return c
        return "U"
    return cat[0]


# One stand-in character per category: llama.cpp runs its regexes over a
# "collapsed" copy of the text where every non-ASCII code point is replaced by
# such a stand-in, so that \p{L} etc. can be expressed with plain ASCII regexes.
_COLLAPSED_CAT_CHAR = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_COLLAPSED_OTHER = "\xd0"
_COLLAPSED_SPACE = "\x0b"


class _CollapseTable(dict):
    """str.translate table: code point -> stand-in char, filled lazily."""

    def __missing__(self, cp: int) -> str:
        if cp in _WHITESPACE:
            ch = _COLLAPSED_SPACE
        else:
            ch = _COLLAPSED_CAT_CHAR.get(_major_category(cp), _COLLAPSED_OTHER)
        self[cp] = ch
        return ch


_COLLAPSE_TABLE = _CollapseTable({cp: cp for cp in range(128)})
# for regexes without \p{..}: only non-ASCII whitespace is replaced (by \v) so that \s sees it
_WS_TABLE = {cp: 0x0B for cp in _WHITESPACE if cp >= 128}

# Kimi-K2's splitter tells Han apart from the other letters.  "Han" is a fixed list of CJK
# blocks (unified ideographs, extensions A-F, compatibility ideographs), not the Unicode
# script property: e.g. U+3005 and U+3007 count as ordinary letters/numbers.
_HAN_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2A6DF),
               (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF),
               (0x2F800, 0x2FA1F))
_HAN_LETTER = "\xd6"  # stand-in for a Han letter
_HAN_OTHER = "\xd7"   # stand-in for an unassigned code point inside a Han block


def _is_han(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _HAN_RANGES)


class _HanCollapseTable(_CollapseTable):
    """Like _CollapseTable, with Han code points mapped to their own stand-ins."""

    def __missing__(self, cp: int) -> str:
        if _is_han(cp):
            ch = _HAN_LETTER if _major_category(cp) == "L" else _HAN_OTHER
            self[cp] = ch
            return ch
        return super().__missing__(cp)


_HAN_COLLAPSE_TABLE = _HanCollapseTable({cp: cp for cp in range(128)})
_SUBJECT_TABLES = {"c": _COLLAPSE_TABLE, "h": _HAN_COLLAPSE_TABLE, "w": _WS_TABLE}

# \p{..} names understood by llama.cpp's regex collapsing, and what they become:
# the category stand-in plus the ASCII members of the category *as llama.cpp lists them*
# (note: '~' is in neither P nor S there; we keep that quirk for bit-exactness).
_UCAT_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S",
               "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}
_UCAT_ASCII = {
    "N": "0-9",
    "L": "A-Za-z",
    "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "",
    "S": r"\$\+<->^`\|",
}


def _translate_regex(expr: str) -> tuple[re.Pattern, bool]:
    """Turn one llama.cpp pre-tokenizer regex into a Python pattern.

    Returns (pattern, collapsed): when `collapsed` the pattern must run on the
    collapsed text (see _CollapseTable), otherwise on the text with non-ASCII
    whitespace replaced by '\\v'.  Also maps ECMAScript's '$' (end of input only)
    to Python's '\\Z'.
    """
    collapsed = any(("\\p{%s}" % name) in expr for name in _UCAT_NAMES)
    if collapsed and any(ord(c) >= 128 for c in expr):
        raise ValueError("regex mixes unicode categories and non-ASCII characters: %r" % expr)
    out: list[str] = []
    inside = False  # inside [...]
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        escaped = i > 0 and expr[i - 1] == "\\"
        if c == "[" and not escaped:
            out.append(c)
            inside = True
            i += 1
            continue
        if inside and c == "]" and not escaped:
            out.append(c)
            inside = False
            i += 1
            continue
        if collapsed and expr.startswith("\\p{", i):
            close = expr.find("}", i + 3)
            if close != -1 and close <= i + 10:
                cat = _UCAT_NAMES.get(expr[i + 3:close])
                if cat is not None:
                    body = _COLLAPSED_CAT_CHAR[cat] + _UCAT_ASCII[cat]
                    out.append(body if inside else "[" + body + "]")
                    i = close + 1
                    continue
        if c == "$" and not inside and not escaped:
            out.append(r"\Z")
            i += 1
            continue
        out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII), collapsed


# ---------------------------------------------------------------------------
# pre-tokenizer regexes (data taken from llama.cpp's llm_tokenizer_bpe)
# ---------------------------------------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_DEEPSEEK3_MAIN = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
                      "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*"
                      "|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_RE_CASED_WORDS = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                   + _CONTRACTIONS + r"?"
                   r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                   + _CONTRACTIONS + r"?")
_RE_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

# special (non-regex) splitters, implemented in Python below
_AFMOE_DIGITS = "<afmoe-digits>"
_KIMI_K2 = "<kimi-k2>"

# Kimi-K2 (tiktoken's pattern, as llama.cpp's hand-written splitter applies it):
#   [\p{Han}]+ | [^\r\n\p{L}\p{N}]? (letters but Han)+ contraction? | \p{N}{1,3}
#   | " "?[^\s\p{L}\p{N}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+
# Unlike the original pattern, upper/lower case runs are not told apart ("HelloWorld" stays
# one piece) and combining marks are not letters.  Written directly over the Han-aware
# collapsed alphabet: \xd6/\xd7 Han, \xd2 other letters, \xd1 numbers.  An unassigned code
# point inside a Han block (\xd7) joins Han runs but, being no letter, can also continue a
# punctuation run.
_KIMI_LETTER = "\xd2A-Za-z"  # letters other than Han
_KIMI_NUMBER = "\xd10-9"
_KIMI_HAN = _HAN_LETTER + _HAN_OTHER
_RE_KIMI_K2 = re.compile(
    "[" + _KIMI_HAN + "]+"
    "|[^\r\n" + _KIMI_LETTER + _HAN_LETTER + _KIMI_NUMBER + "]?[" + _KIMI_LETTER + "]+" + _CONTRACTIONS + "?"
    "|[" + _KIMI_NUMBER + "]{1,3}"
    "| ?[^\\s" + _KIMI_LETTER + _HAN_LETTER + _KIMI_NUMBER + "]+[\r\n]*"
    "|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    re.ASCII,
)

_PRE_REGEXES: dict[str, list[str]] = {
    "llama3": [_RE_LLAMA3],
    "jais2": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
              r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"],
    "deepseek-llm": [
        "[\r\n]",
        "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
        "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
        "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
        "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
        "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
        "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
        "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
        "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
        "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
        "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
        "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        _CJK_DEEPSEEK,
        r"\p{N}+",
    ],
    "deepseek3": [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _RE_DEEPSEEK3_MAIN],
    "youtu": [
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b"
        "\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        _RE_CASED_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DEEPSEEK, r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, "[0-9][0-9][0-9]"],
    "starcoder": [r"\p{N}", _RE_GPT2],
    "gpt2": [_RE_GPT2],
    "qwen2": [_RE_QWEN2],
    "qwen35": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "bloom": [_RE_BLOOM],
    "chatglm4": [_RE_LLAMA3],
    "viking": [_RE_BLOOM, r"\p{N}"],
    "tekken": [r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
               r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "chameleon": [
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _RE_GPT2,
    ],
    "gpt4o": [r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
              r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    # llama.cpp splits tiny_aya's digit groups with the AFMoE digit splitter
    "tiny_aya": [_AFMOE_DIGITS,
                 _RE_CASED_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "superbpe": [r"\p{N}+", r"(?=(\d{3})+(?!\d))"],
    "bailingmoe": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
    "seed-coder": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "afmoe": [
        _AFMOE_DIGITS,
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
        "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
        "\u1100-\u11ff]+",
        _RE_DEEPSEEK3_MAIN,
    ],
    "exaone-moe": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"],
    "gemma4": ["[^\\n]+|[\\n]+"],
    "kimi-k2": [_KIMI_K2],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
}

# tokenizer.ggml.pre value -> (regex group, flag overrides), as in llama.cpp's vocab loader.
# Flags: clean_spaces (defaults True for BPE), ignore_merges, add_bos, add_sep, bos_none.
_NO_CLEAN = {"clean_spaces": False}
_PRE_TYPES: dict[str, tuple[str, dict[str, bool]]] = {}


def _reg(names: tuple[str, ...], group: str, **flags: bool) -> None:
    for name in names:
        _PRE_TYPES[name] = (group, flags)


_reg(("default",), "default")
_reg(("llama3", "llama-v3", "llama-bpe", "laguna", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
      "lfm2", "jina-v5-nano"), "llama3", ignore_merges=True, add_bos=True)
_reg(("deepseek-llm",), "deepseek-llm", **_NO_CLEAN)
_reg(("deepseek-coder",), "deepseek-coder", **_NO_CLEAN)
_reg(("deepseek-v3",), "deepseek3", **_NO_CLEAN)
_reg(("youtu",), "youtu", clean_spaces=False, ignore_merges=True)
_reg(("falcon",), "falcon")
_reg(("mpt",), "gpt2")
_reg(("starcoder",), "starcoder")
_reg(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "exaone4"), "gpt2")
_reg(("mellum2",), "starcoder")
_reg(("jais-2",), "jais2")
_reg(("jina-v1-en", "jina-v2-code", "roberta-bpe"), "gpt2", add_sep=True)
_reg(("refact",), "starcoder")
_reg(("command-r", "cohere2_moe"), "starcoder", **_NO_CLEAN)
_reg(("qwen2", "deepseek-r1-qwen", "kormo", "openpangu", "f2llmv2"), "qwen2", **_NO_CLEAN)
_reg(("qwen35",), "qwen35", **_NO_CLEAN)
_reg(("stablelm2",), "qwen2")
_reg(("olmo",), "gpt2")
_reg(("dbrx", "smaug-bpe"), "llama3")
_reg(("poro-chat",), "bloom", **_NO_CLEAN)
_reg(("glm4", "chatglm-bpe"), "chatglm4", bos_none=True)
_reg(("viking",), "viking", **_NO_CLEAN)
_reg(("jais",), "gpt2")
_reg(("tekken",), "tekken", clean_spaces=False, ignore_merges=True, add_bos=True)
_reg(("smollm",), "starcoder", **_NO_CLEAN)
_reg(("codeshell",), "starcoder")
_reg(("bloom", "gpt3-finnish"), "bloom")
_reg(("exaone",), "starcoder")
_reg(("exaone-moe",), "exaone-moe")
_reg(("chameleon",), "chameleon", add_bos=True, clean_spaces=False)
_reg(("minerva-7b",), "starcoder")
_reg(("megrez",), "qwen2")
_reg(("gpt-4o", "llama4", "kanana2"), "gpt4o", **_NO_CLEAN)
_reg(("tiny_aya",), "tiny_aya", **_NO_CLEAN)
_reg(("superbpe",), "superbpe", **_NO_CLEAN)
_reg(("trillion", "granite-docling"), "gpt2", **_NO_CLEAN)
_reg(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe", **_NO_CLEAN)
_reg(("seed-coder",), "seed-coder", **_NO_CLEAN)
_reg(("hunyuan", "solar-open"), "qwen2", **_NO_CLEAN)
_reg(("hunyuan-dense", "joyai-llm"), "deepseek3", **_NO_CLEAN)
_reg(("grok-2",), "qwen2", **_NO_CLEAN)
_reg(("afmoe",), "afmoe", **_NO_CLEAN)
_reg(("minimax-m2",), "gpt4o", **_NO_CLEAN)
_reg(("kimi-k2",), "kimi-k2", **_NO_CLEAN)

# token texts llama.cpp treats as end-of-generation (and forces to CONTROL)
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
])
# auto-detection by text of special ids that the metadata did not set
_AUTO_SPECIAL_TEXTS: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# metadata keys of special ids (the deprecated prefix/suffix/middle keys come last, as in llama.cpp)
_SPECIAL_ID_KEYS = (
    ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
    ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"), ("mask", "mask_token_id"),
    ("fim_pre", "fim_pre_token_id"), ("fim_suf", "fim_suf_token_id"),
    ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"),
    ("fim_rep", "fim_rep_token_id"), ("fim_sep", "fim_sep_token_id"),
    ("fim_pre", "prefix_token_id"), ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"),
)

_SURROGATES = re.compile("[\ud800-\udfff]")
_SPM_CUT = re.compile("(?<=[^\u2581])\u2581")
_AFMOE_NUM = re.compile("[0-9\xd1]+")
_CLEAN1 = re.compile(rb" (?=[?!.,])")
_CLEAN2 = re.compile(rb" ' ")
_CLEAN3 = re.compile(rb" (?='(?:[sm]|re|ve))")

_CACHE_LIMIT = 1 << 18  # entries per word/chunk cache before it is reset


class Tokenizer:
    """llama.cpp-compatible tokenizer built from GGUF metadata (see module docstring)."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool

    def __init__(self) -> None:  # use from_metadata()
        self._word_cache: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        from engine.gguf_meta import read_metadata

        return cls.from_metadata(read_metadata(path))

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        self = cls()
        model = meta.get("tokenizer.ggml.model")
        pre = meta.get("tokenizer.ggml.pre") or ""
        if model is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.model")
        self.model = model
        self.pre = pre

        # --- vocabulary family and its defaults (mirrors llama.cpp's loader)
        self.add_eos = False
        self.add_sep = False
        self.ignore_merges = False
        self.byte_encode = True
        self.escape_whitespaces = False
        specials: dict[str, int | None] = {k: None for k, _ in _SPECIAL_ID_KEYS}
        if model == "llama":
            self.type = "spm"
            specials.update(bos=1, eos=2, unk=0)
            self.add_space_prefix = True
            self.clean_spaces = False
            self.add_bos = True
        elif model in ("gpt2", "gemma4"):
            self.type = "bpe"
            if model == "gpt2":
                specials.update(bos=11, eos=11)  # llama.cpp's (odd) BPE defaults
            else:
                pre = self.pre = "gemma4"
            self.add_space_prefix = False
            self.clean_spaces = True
            self.add_bos = False
            if pre == "gemma4":
                group, flags = "gemma4", {}
                self.byte_encode = False
                self.escape_whitespaces = True
            elif not pre:
                group, flags = "default", {}  # llama.cpp warns and falls back to 'default'
            elif pre in _PRE_TYPES:
                group, flags = _PRE_TYPES[pre]
            else:
                raise ValueError(f"unsupported BPE pre-tokenizer type: {pre!r}")
            self.clean_spaces = flags.get("clean_spaces", True)
            self.ignore_merges = flags.get("ignore_merges", False)
            self.add_bos = flags.get("add_bos", False)
            self.add_sep = flags.get("add_sep", False)
            if flags.get("bos_none"):
                specials["bos"] = None
            self._steps = self._compile_steps(_PRE_REGEXES[group])
        else:
            raise ValueError(f"unsupported tokenizer model: {model!r} (supported: 'llama', 'gpt2')")

        if "tokenizer.ggml.add_space_prefix" in meta:
            self.add_space_prefix = bool(meta["tokenizer.ggml.add_space_prefix"])

        # --- tokens, scores, attributes
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        n = len(tokens)
        for i, t in enumerate(tokens):
            if not t:
                tokens[i] = f"[EMPTY_{i}]"
        scores = meta.get("tokenizer.ggml.scores")
        types = meta.get("tokenizer.ggml.token_type")
        if scores is not None and len(scores) < n:
            raise ValueError("tokenizer.ggml.scores is shorter than the token list")
        if types is not None and len(types) < n:
            raise ValueError("tokenizer.ggml.token_type is shorter than the token list")
        self.tokens = tokens
        self.n_vocab = n
        self.scores = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
        if types is not None:
            self.attrs = [_TOKEN_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in types[:n]]
        else:
            self.attrs = [ATTR_NORMAL] * n
        self.token_to_id = {t: i for i, t in enumerate(tokens)}  # duplicates: last id wins

        if self.type == "bpe":
            self.bpe_ranks: dict[tuple[str, str], int] = {}
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                if self.pre != "kimi-k2":  # llama.cpp lets only Kimi-K2 go without merges
                    raise ValueError("BPE vocabulary without tokenizer.ggml.merges")
                merges = []
            for rank, m in enumerate(merges):
                cut = m.find(" ", 1)
                key = (m[:cut], m[cut + 1:]) if cut >= 0 else ("", "")
                self.bpe_ranks.setdefault(key, rank)  # first occurrence keeps its rank
        else:
            self._init_spm()

        # --- special ids from metadata (ignored when out of range, like llama.cpp)
        for name, key in _SPECIAL_ID_KEYS:
            v = meta.get("tokenizer.ggml." + key)
            if v is not None and 0 <= int(v) < n:
                specials[name] = int(v)
        if "tokenizer.ggml.add_bos_token" in meta:
            self.add_bos = bool(meta["tokenizer.ggml.add_bos_token"])
        if "tokenizer.ggml.add_eos_token" in meta:
            self.add_eos = bool(meta["tokenizer.ggml.add_eos_token"])
        if "tokenizer.ggml.add_sep_token" in meta:
            self.add_sep = bool(meta["tokenizer.ggml.add_sep_token"])
        if self.pre == "gemma4":
            self.add_bos = True

        self._init_special_tokens(specials)
        self._init_token_attrs(meta)
        self.bos_id = specials["bos"]
        self.eos_id = specials["eos"]
        self.eot_id = specials["eot"]
        self.unk_id = specials["unk"]
        self.pad_id = specials["pad"]
        self.special_ids = specials
        self._pieces: list[bytes | None] = [None] * n
        return self

    @staticmethod
    def _compile_steps(exprs: list[str]) -> list[tuple[str, re.Pattern | None, str]]:
        """(kind, pattern, subject) per pre-tokenizer step; subject names the copy of the text
        the pattern runs on: "c" collapsed, "h" collapsed with Han apart, "w" whitespace-mapped."""
        steps: list[tuple[str, re.Pattern | None, str]] = []
        for expr in exprs:
            if expr == _AFMOE_DIGITS:
                steps.append(("afmoe", None, "c"))
            elif expr == _KIMI_K2:
                steps.append(("re", _RE_KIMI_K2, "h"))
            else:
                pat, collapsed = _translate_regex(expr)
                steps.append(("re", pat, "c" if collapsed else "w"))
        return steps

    def _init_spm(self) -> None:
        # Characters that may directly precede "▁" inside some vocab entry.  A chunk
        # boundary in front of a "▁" whose left neighbour is not in this set can never
        # be crossed by a merge, so such chunks are tokenized (and cached) separately.
        before_space: set[str] = set()
        for t in self.token_to_id:
            j = t.find(_SPACE_ESC, 1)
            while j > 0:
                before_space.add(t[j - 1])
                j = t.find(_SPACE_ESC, j + 1)
        self._spm_no_cut = before_space
        self._byte_tokens: list[int | None] = []
        for b in range(256):
            tid = self.token_to_id.get("<0x%02X>" % b)
            if tid is None and b < 0x80:
                tid = self.token_to_id.get(chr(b))
            self._byte_tokens.append(tid)

    def _init_special_tokens(self, sp: dict[str, int | None]) -> None:
        attrs, tokens, ids = self.attrs, self.tokens, self.token_to_id

        def force_control(tid: int) -> None:
            attrs[tid] |= ATTR_CONTROL

        # auto-detect missing special ids by their text (lowest id wins on ties)
        for name, texts in _AUTO_SPECIAL_TEXTS.items():
            if sp[name] is not None:
                continue
            found = sorted(ids[t] for t in texts if t in ids)
            if found:
                sp[name] = found[0]
                force_control(found[0])
        # control tokens whose text says "unused" are unused
        for tid, t in enumerate(tokens):
            if attrs[tid] & ATTR_CONTROL and "unused" in t:
                attrs[tid] |= ATTR_UNUSED
        eog: set[int] = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if sp[name] is not None:
                eog.add(sp[name])
        for t in _EOG_TEXTS:
            tid = ids.get(t)
            if tid is not None:
                eog.add(tid)
                force_control(tid)
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if t in ids:  # gpt-oss: always rendered
                attrs[ids[t]] = ATTR_USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if sp[name] is not None:
                eog.add(sp[name])
        texts = {tokens[t]: t for t in eog}
        if ("<|end|>" in texts and "<|call|>" in texts and "<|return|>" in texts) or (
                "<|end|>" in texts and "<|calls|>" in texts and "<|flush|>" in texts):
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = ATTR_NORMAL
        self.eog_ids = frozenset(eog)

    def _init_token_attrs(self, meta: dict[str, Any]) -> None:
        attrs, ids = self.attrs, self.token_to_id
        special_mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        # texts split out before tokenization: longest first (by UTF-8 length)
        special = [i for i in range(self.n_vocab) if attrs[i] & special_mask]
        special.sort(key=lambda i: (-len(self.tokens[i].encode("utf-8")), i))
        self._special_ids = special
        # per-model strip attributes, as llama.cpp sets them by name
        name = str(meta.get("general.name") or "").lower()
        arch = str(meta.get("general.architecture") or "")
        pre = str(meta.get("tokenizer.ggml.pre") or "")

        def set_attr(text: str, flag: int, on: bool) -> None:
            if text in ids:
                tid = ids[text]
                attrs[tid] = (attrs[tid] | flag) if on else (attrs[tid] & ~flag)

        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
                s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            set_attr("<mask>", ATTR_LSTRIP, True)
        elif "phi-3" in name or "phi3" in name:
            for tid in special:
                attrs[tid] |= ATTR_RSTRIP
            set_attr("</s>", ATTR_RSTRIP, True)
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(t, ATTR_RSTRIP, False)
        elif "modern-bert" in name:
            set_attr("[MASK]", ATTR_LSTRIP, True)

    # ------------------------------------------------------------------ queries
    def is_eog(self, id: int) -> bool:
        return id in self.eog_ids

    def is_control(self, id: int) -> bool:
        return bool(self.attrs[id] & ATTR_CONTROL)

    def token_attr(self, id: int) -> int:
        return self.attrs[id]

    # ------------------------------------------------------------------ encode
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, like llama_tokenize(add_special, parse_special)."""
        if not text.isascii() and _SURROGATES.search(text):
            # llama.cpp sees invalid UTF-8 as U+FFFD
            text = _SURROGATES.sub("\ufffd", text)
        frags: list[str | int] = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if self.type == "spm":
            if add_special and self.add_bos and self.bos_id is not None:
                out.append(self.bos_id)
            prev_special = True  # the first text fragment gets the space prefix
            for f in frags:
                if isinstance(f, str):
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    out.extend(self._spm_tokenize(f.replace(" ", _SPACE_ESC)))
                    prev_special = False
                else:
                    out.append(f)
                    prev_special = True
        else:
            if add_special and self.add_bos and self.bos_id is not None:
                out.append(self.bos_id)
            for f in frags:
                if isinstance(f, str):
                    if self.escape_whitespaces:
                        f = f.replace(" ", _SPACE_ESC)
                    self._bpe_tokenize(f, out)
                else:
                    out.append(f)
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split out special-token texts (user-defined always; control/unknown only
        when parse_special), longest tokens first, like llama.cpp."""
        frags: list[str | int] = [text]
        skip = 0 if parse_special else (ATTR_CONTROL | ATTR_UNKNOWN)
        # cheap prefilter: many special tokens share a prefix ("[PAD1..", "<|reserved..")
        # that one substring search can rule out for all of them
        prefix_seen: dict[str, bool] = {}
        for tid in self._special_ids:
            attr = self.attrs[tid]
            if attr & skip:
                continue
            tok = self.tokens[tid]
            head = tok[:3]
            present = prefix_seen.get(head)
            if present is None:
                present = prefix_seen[head] = head in text
            if not present or tok not in text:  # fragments are substrings of text
                continue
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, str) and tok in f:
                    self._split_fragment(f, tok, tid, attr, new)
                else:
                    new.append(f)
            frags = new
        return frags

    @staticmethod
    def _split_fragment(f: str, tok: str, tid: int, attr: int, out: list[str | int]) -> None:
        ws = " \t\n\v\f\r"
        pos, n, L = 0, len(f), len(tok)
        while True:
            m = f.find(tok, pos)
            if m < 0:
                if pos < n:
                    out.append(f[pos:])
                return
            left = f[pos:m]
            if attr & ATTR_LSTRIP:
                left = left.rstrip(ws)
            if left:
                out.append(left)
            out.append(tid)
            pos = m + L
            if pos >= n:
                return
            if attr & ATTR_RSTRIP:
                while pos < n and f[pos] in ws:
                    pos += 1

    # --- BPE
    def _pre_split(self, text: str) -> list[str]:
        """Apply the pre-tokenizer regexes one after the other; each one splits every
        current piece into its matches and the unmatched gaps between them."""
        n = len(text)
        subjects: dict[str, str] = {}
        ascii_text = text.isascii()
        segs = [(0, n)]
        for kind, pat, subj in self._steps:
            subject = subjects.get(subj)
            if subject is None:
                if ascii_text:
                    subject = text
                else:
                    subject = text.translate(_SUBJECT_TABLES[subj])
                subjects[subj] = subject
            out: list[tuple[int, int]] = []
            append = out.append
            if kind == "afmoe":
                for s, e in segs:
                    prev = s
                    for m in _AFMOE_NUM.finditer(subject, s, e):
                        a, b = m.span()
                        cut = a + (b - a) % 3
                        if cut == a:
                            cut += 3
                        while cut <= b:
                            append((prev, cut))
                            prev = cut
                            cut += 3
                    if prev < e:
                        append((prev, e))
            else:
                finditer = pat.finditer
                for s, e in segs:
                    pos = s
                    for m in finditer(subject, s, e):
                        a, b = m.span()
                        if a > pos:
                            append((pos, a))
                        if b > a:
                            append((a, b))
                        pos = b
                    if pos < e:
                        append((pos, e))
            segs = out
        return [text[a:b] for a, b in segs]

    def _bpe_tokenize(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        for word in self._pre_split(text):
            ids = cache.get(word)
            if ids is None:
                ids = cache[word] = self._bpe_word(word)
            out.extend(ids)

    def _bpe_word(self, word: str) -> list[int]:
        vocab = self.token_to_id
        enc = _byte_encode(word) if self.byte_encode else word
        if self.ignore_merges and enc in vocab:
            return [vocab[enc]]
        if self.pre == "gemma4" and enc.strip("\n") == "" and enc in vocab:
            return [vocab[enc]]
        ids: list[int] = []
        for sym in self._bpe_merge(enc):
            tid = vocab.get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            for b in sym.encode("utf-8"):  # no token: fall back to single bytes
                if self.byte_encode:
                    tid = vocab.get(chr(b)) if b < 0x80 else None
                else:
                    tid = vocab.get("<0x%02X>" % b)
                if tid is not None:
                    ids.append(tid)
        return ids

    def _bpe_merge(self, enc: str) -> list[str]:
        """Merge adjacent symbols by lowest merge rank (ties: leftmost first)."""
        ranks = self.bpe_ranks
        return merge_pairs(list(enc), lambda l, r: ranks.get((l, r)))

    # --- SPM
    def _spm_tokenize(self, text: str) -> list[int]:
        cache = self._word_cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        out: list[int] = []
        no_cut = self._spm_no_cut
        start = 0
        cuts = [m.start() for m in _SPM_CUT.finditer(text) if text[m.start() - 1] not in no_cut]
        cuts.append(len(text))
        for end in cuts:
            chunk = text[start:end]
            start = end
            ids = cache.get(chunk)
            if ids is None:
                ids = cache[chunk] = self._spm_chunk(chunk)
            out.extend(ids)
        return out

    def _spm_chunk(self, text: str) -> list[int]:
        """llama.cpp's SPM: repeatedly merge the adjacent pair whose concatenation is the
        highest-scoring vocab entry (ties: leftmost first); leftovers become byte tokens."""
        vocab, scores = self.token_to_id, self.scores

        def priority(left: str, right: str):
            tid = vocab.get(left + right)
            return None if tid is None else -scores[tid]

        syms = merge_pairs(list(text), priority)
        ids: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = vocab.get(s)
            if tid is not None:
                ids.append(tid)
                continue
            for b in s.encode("utf-8"):
                tid = self._byte_tokens[b]
                if tid is None:
                    tid = self.unk_id
                    if tid is None:
                        raise ValueError(f"no byte token for 0x{b:02X} and no <unk> in vocab")
                ids.append(tid)
        return ids

    # ------------------------------------------------------------------ decode
    def _piece(self, id: int) -> bytes:
        """Bytes rendered for one token (special tokens included), cached."""
        p = self._pieces[id]
        if p is not None:
            return p
        attr = self.attrs[id]
        text = self.tokens[id]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            p = text.encode("utf-8")
        elif attr & ATTR_NORMAL:
            if self.type == "spm" or self.escape_whitespaces:
                p = text.replace(_SPACE_ESC, " ").encode("utf-8")
            else:
                p = self._decode_byte_chars(text)
        elif attr & ATTR_BYTE:
            p = bytes([int(text[3:5], 16)])
        else:
            p = b""
        self._pieces[id] = p
        return p

    @staticmethod
    def _decode_byte_chars(text: str) -> bytes:
        """GPT-2 byte alphabet -> raw bytes (unknown chars are reported inline, like llama.cpp)."""
        out = bytearray()
        for ch in text:
            b = _CHAR_TO_BYTE.get(ch)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)

    def _check_id(self, id: int) -> None:
        if not 0 <= id < self.n_vocab:
            raise ValueError(f"token id {id} out of range [0, {self.n_vocab})")

    def token_to_bytes(self, id: int, special: bool = True) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence)."""
        self._check_id(id)
        if not special and self.attrs[id] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        return self._piece(id)

    def token_to_piece(self, id: int, special: bool = True) -> str:
        """Text of one token, like common_token_to_piece (special tokens rendered by default)."""
        return self.token_to_bytes(id, special).decode("utf-8", errors="replace")

    def decode(self, ids: list[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of `ids`, like llama_detokenize(remove_special, unparse_special).

        Control/unknown tokens are dropped unless `unparse_special`; `remove_special`
        strips the BOS/EOS that encode(add_special=True) added.  With SPM the leading
        space of the first piece is removed (unless a BOS was stripped first), and
        BPE vocabs with clean_spaces tidy " ," / " 's" etc.
        """
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        buf = bytearray()
        hidden = ATTR_UNKNOWN | ATTR_CONTROL
        for tid in ids:
            self._check_id(tid)
            if not unparse_special and self.attrs[tid] & hidden:
                piece = b""
            else:
                piece = self._piece(tid)
            if remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            buf += piece
        data = bytes(buf)
        if self.clean_spaces and data:
            data = _CLEAN1.sub(b"", data)
            data = _CLEAN2.sub(b"'", data)
            data = _CLEAN3.sub(b"", data)
        return data.decode("utf-8", errors="replace")
