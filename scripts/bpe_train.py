#!/usr/bin/env python3
"""Byte-level BPE tokenizer (GPT-2 style) trainer + llama.cpp-compatible encoder.

Used by scripts/train_demo_model.py to build the vocabulary of the demo
deepseek2 GGUF model.

* Pre-tokenizer: the GPT-2 regex
      's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
  which is what llama.cpp applies for tokenizer.ggml.pre = "gpt-2"
  (ik_llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT2, implemented by
  unicode_regex_split_custom_gpt2 in src/unicode.cpp).
* Byte-to-unicode mapping: GPT-2's bytes_to_unicode().
* Encoding (BpeTokenizer.encode_word): llama.cpp's llm_tokenizer_bpe_session
  semantics: start from one symbol per (byte-mapped) character, repeatedly merge
  the adjacent pair with the lowest merge rank; ties -> leftmost pair.
* Training: classic frequency-based BPE over pre-token counts, incremental pair
  counts, deterministic tie-breaking (highest count, then smallest
  (left_string, right_string)).

Vocabulary layout: ids 0..255 = the 256 single-byte tokens in byte-value order
(mapped through bytes_to_unicode), then one token per merge in merge order,
then the special token "<|endoftext|>" (last id).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import os

import regex

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.tokenizer import gpt2_byte_chars  # noqa: E402

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    return dict(enumerate(gpt2_byte_chars()))


BYTE2UNI = bytes_to_unicode()
_pat = regex.compile(GPT2_PAT)


def pretokenize(text: str) -> list[str]:
    """Split text with the GPT-2 regex and map each piece to byte-level unicode."""
    out = []
    for m in _pat.finditer(text):
        out.append("".join(BYTE2UNI[b] for b in m.group(0).encode("utf-8")))
    return out


def train_bpe(text: str, vocab_size: int, verbose: bool = False):
    """Return (tokens, merges). tokens includes the 256 bytes, merge results and EOT (last)."""
    n_merges_target = vocab_size - 256 - 1
    assert n_merges_target >= 0
    counts: dict[str, int] = defaultdict(int)
    for w in pretokenize(text):
        counts[w] += 1
    words = [list(w) for w in counts]          # symbol sequences
    freqs = [counts[w] for w in counts]

    pair_counts: dict[tuple[str, str], int] = defaultdict(int)
    pair_where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, syms in enumerate(words):
        f = freqs[wi]
        for a, b in zip(syms, syms[1:]):
            pair_counts[(a, b)] += f
            pair_where[(a, b)].add(wi)

    tokens = [BYTE2UNI[b] for b in range(256)]
    token_set = set(tokens)
    merges: list[tuple[str, str]] = []
    while len(tokens) < vocab_size - 1:
        if not pair_counts:
            break
        # highest count, then lexicographically smallest pair (deterministic)
        best = min(pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        (a, b), cnt = best
        if cnt <= 0:
            break
        new = a + b
        merges.append((a, b))
        if new not in token_set:
            tokens.append(new)
            token_set.add(new)
        # update every word containing the pair
        for wi in list(pair_where.get((a, b), ())):
            syms = words[wi]
            f = freqs[wi]
            # remove old pairs of this word
            for p in zip(syms, syms[1:]):
                pair_counts[p] -= f
                if pair_counts[p] <= 0:
                    del pair_counts[p]
                s = pair_where.get(p)
                if s is not None:
                    s.discard(wi)
            # merge left-to-right, non-overlapping
            out = []
            i = 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == a and syms[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[wi] = out
            for p in zip(out, out[1:]):
                pair_counts[p] += f
                pair_where[p].add(wi)
        pair_where.pop((a, b), None)
        pair_counts.pop((a, b), None)
        if verbose and len(merges) % 100 == 0:
            print(f"  bpe: {len(merges)} merges, last {a!r}+{b!r} ({cnt})", file=sys.stderr)
    tokens.append(EOT)
    return tokens, merges


class BpeTokenizer:
    """Encoder reproducing llama.cpp's BPE tokenizer (gpt2 model, gpt-2 pre-tokenizer)."""

    def __init__(self, tokens: list[str], merges: list[tuple[str, str]], bos_id: int | None = None):
        self.tokens = tokens
        self.tok2id = {t: i for i, t in enumerate(tokens)}
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.merges = merges
        self.bos_id = self.tok2id[EOT] if bos_id is None else bos_id
        self._cache: dict[str, list[int]] = {}
        self.uni2byte = {u: b for b, u in BYTE2UNI.items()}

    def encode_word(self, word: str) -> list[int]:
        r = self._cache.get(word)
        if r is not None:
            return r
        syms = list(word)
        ranks = self.ranks
        while len(syms) > 1:
            best_rank = None
            best_i = -1
            for i in range(len(syms) - 1):
                rk = ranks.get((syms[i], syms[i + 1]))
                if rk is not None and (best_rank is None or rk < best_rank):
                    best_rank, best_i = rk, i
            if best_i < 0:
                break
            syms[best_i:best_i + 2] = [syms[best_i] + syms[best_i + 1]]
        ids = []
        for s in syms:
            t = self.tok2id.get(s)
            if t is not None:
                ids.append(t)
            else:  # byte fallback, as llama.cpp does
                for ch in s:
                    ids.append(self.tok2id[ch])
        self._cache[word] = ids
        return ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for w in pretokenize(text):
            ids.extend(self.encode_word(w))
        return ids

    def decode(self, ids) -> str:
        bs = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t == EOT:
                continue
            bs.extend(self.uni2byte[c] for c in t)
        return bs.decode("utf-8", errors="replace")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="/work/shared/corpus/shakespeare.train.txt")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--out", required=True, help="output JSON {tokens, merges}")
    a = ap.parse_args()
    text = open(a.train, encoding="utf-8").read()
    tokens, merges = train_bpe(text, a.vocab_size, verbose=True)
    with open(a.out, "w") as f:
        json.dump({"tokens": tokens, "merges": [f"{x} {y}" for x, y in merges]}, f)
    tok = BpeTokenizer(tokens, merges)
    n = len(tok.encode(text))
    print(f"vocab {len(tokens)}, merges {len(merges)}, train tokens {n} ({len(text)/n:.2f} chars/token)")


if __name__ == "__main__":
    main()
