"""ik_llama.cpp's banned strings: phrases (and regexes) the answer must not contain.

ik's server (server-context.cpp, buffer_and_check_string_ban) holds the newest generated tokens
back in a buffer of n_buffer tokens (the longest banned string's length in bytes + 1, or the
request's banbuffer_size).  After each token it looks for a banned phrase (ASCII-lowercased, in the
ASCII-lowercased buffer text), a banned_regex or a banned_regex_case_insensitive match in the
buffer's text.  When one is found: the token where the earliest match starts is banned at that
position (a logit bias, banned_bias, -999 by default; banned_n tokens from there: 1 by default,
-1 all of them, 0 none), the tokens from there on are dropped from the answer and the KV cache, and
generation goes on from that position (another draw, with the ban).  Else the buffer's oldest token
goes out once the buffer is full.  Rewinds are limited: rewind_count_max (-1: ik's heuristic, stop
rewinding after 20 rewinds in a row when that is also more than 2 per banned entry; 0: no limit).
The rewound tokens still count towards n_predict, as ik's n_decoded does.

This module holds the request's settings and the search (BanSpec); engine.serving does the holding
back and the rewind.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["BanSpec", "DEFAULT_BIAS"]

DEFAULT_BIAS = -999.0          # ik's ban_phrases_bias


@dataclass(frozen=True)
class BanSpec:
    """One request's banned strings, as the engine applies them."""
    phrases: tuple[bytes, ...]          # ASCII-lowercased UTF-8, longest first
    regex: tuple["re.Pattern[bytes]", ...]
    regex_ci: tuple["re.Pattern[bytes]", ...]
    n_buffer: int                       # tokens held back (>= 1)
    bias: float = DEFAULT_BIAS
    banned_n: int = 1
    rewind_max: int = -1

    @property
    def n_entries(self) -> int:
        return len(self.phrases) + len(self.regex) + len(self.regex_ci)

    def find(self, text: bytes) -> int:
        """Byte offset in text where the earliest banned match starts (-1: none)."""
        best = -1
        low = text.lower()           # bytes.lower() changes ASCII letters only, as ik's string_lower
        for p in self.phrases:
            i = low.find(p)
            if i >= 0 and (best < 0 or i < best):
                best = i
        for rx in self.regex + self.regex_ci:
            m = rx.search(text)
            if m is not None and (best < 0 or m.start() < best):
                best = m.start()
        return best

    def may_rewind(self, n_rewinds: int) -> bool:
        """Whether one more rewind is allowed after n_rewinds in a row (ik's rule)."""
        if self.rewind_max == -1:
            return not (n_rewinds >= 20 and n_rewinds > 2 * self.n_entries)
        if self.rewind_max > 0:
            return n_rewinds < self.rewind_max
        return True

    @classmethod
    def build(cls, phrases: Optional[Sequence[str]], regex: Optional[Sequence[str]] = None,
              regex_ci: Optional[Sequence[str]] = None, buffer_size: int = 0, bias: float = DEFAULT_BIAS,
              banned_n: int = 1, rewind_max: int = -1) -> "BanSpec":
        """From the request's fields (None: the field was not given).  ValueError with ik's words for
        a regex that does not compile."""
        ph = sorted({p.encode("utf-8").lower() for p in phrases or () if p}, key=len, reverse=True)
        n = max((len(p) for p in ph), default=0)
        rx, rx_ci = [], []
        for field, src, flags, out in (("banned_regex", regex, 0, rx),
                                       ("banned_regex_case_insensitive", regex_ci, re.IGNORECASE, rx_ci)):
            for s in src or ():
                if not s:
                    continue
                try:
                    out.append(re.compile(s.encode("utf-8"), flags))
                except re.error:
                    raise ValueError(f"Invalid regex in {field}: {s}") from None
                n = max(n, len(s.encode("utf-8")))
        return cls(tuple(ph), tuple(rx), tuple(rx_ci), buffer_size if buffer_size > 0 else n + 1, float(bias),
                   int(banned_n), int(rewind_max))


def read_banned_file(path: str) -> list[str]:
    """ik's --banned-string-file: one string a line, double quotes removed, empty lines skipped."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return [s for s in (line.replace('"', "") for line in text.split("\n")) if s]


def spec_of_request(body: dict, default_phrases: Sequence[str] = (), default_banned_n: int = 1) -> Optional[BanSpec]:
    """The BanSpec of a request's banned_strings / banned_regex / banned_regex_case_insensitive /
    banbuffer_size / banned_bias / banned_n / rewind_count_max, the server's --banned-string-file
    phrases where the request gives no banned_strings (None: nothing to ban, no buffer).  ValueError
    (one line) for a field of the wrong type or a bad regex."""
    def strings(name: str) -> Optional[list[str]]:
        v = body.get(name)
        if v is None:
            return None
        if not isinstance(v, list):
            raise ValueError(f"'{name}' must be an array of strings")
        return [x for x in v if isinstance(x, str)]       # ik skips what is not a string

    def number(name: str, default: Any, kind: type) -> Any:
        v = body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise ValueError(f"'{name}' must be {'an integer' if kind is int else 'a number'}")
        return kind(v)

    phrases, regex, regex_ci = strings("banned_strings"), strings("banned_regex"), strings("banned_regex_case_insensitive")
    given = phrases is not None or regex is not None or regex_ci is not None
    if phrases is None and default_phrases:
        phrases = list(default_phrases)
    if not phrases and not regex and not regex_ci:
        return None              # nothing to ban: ik's buffer of one token changes nothing
    return BanSpec.build(phrases, regex, regex_ci, number("banbuffer_size", 0, int) if given else 0,
                         number("banned_bias", DEFAULT_BIAS, float), number("banned_n", default_banned_n, int),
                         number("rewind_count_max", -1, int))
