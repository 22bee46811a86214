"""Reading prompt/text files the way llama.cpp's common argument parser does."""
from __future__ import annotations

import re

_ESC = re.compile(r"\\(x[0-9A-Fa-f]{2}|.)", re.S)
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def process_escapes(s: str) -> str:
    """\\n \\r \\t \\' \\" \\\\ and \\xHH become the characters they name; other \\c stay as they are."""
    def sub(m: re.Match) -> str:
        e = m.group(1)
        if e in _SIMPLE:
            return _SIMPLE[e]
        if len(e) == 3 and e[0] == "x":
            return chr(int(e[1:], 16))
        return m.group(0)
    return _ESC.sub(sub, s)


def prompt_from_file(data: str, escape: bool = True) -> str:
    """`-f FILE`: one trailing newline dropped, then escapes processed unless --no-escape."""
    if data.endswith("\n"):
        data = data[:-1]
    return process_escapes(data) if escape else data


def decode_utf8(data: bytes, name: str, log) -> str:
    """UTF-8 text as llama.cpp reads it (invalid bytes become U+FFFD), saying how many were replaced."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        bad = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
        log(f"warning: {name}: {bad} bytes of invalid UTF-8 replaced by U+FFFD")
        return data.decode("utf-8", errors="replace")
