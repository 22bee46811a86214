"""Tokenizer parity with llama.cpp's test-tokenizer-0 vocab fixtures.

Each ggml-vocab-*.gguf has a .inp (cases separated by "\\n__ggml_vocab_test__\\n")
and a .out (expected ids, one line per case), produced with add_special=False,
parse_special=False, exactly as tests/test-tokenizer-0.cpp tokenizes them.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
from conftest import split_vocab_cases

from engine.gguf_meta import read_metadata
from engine.tokenizer import Tokenizer

VOCAB_DIR = Path(__file__).resolve().parents[2] / "shared" / "vocab"
VOCABS = ["gpt-2", "llama-spm", "deepseek-llm", "deepseek-coder"]

needs_vocab = pytest.mark.skipif(not VOCAB_DIR.is_dir(), reason=f"vocab fixtures not found at {VOCAB_DIR}")


@lru_cache(maxsize=None)
def load(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(read_metadata(str(VOCAB_DIR / f"ggml-vocab-{name}.gguf")))


def read_cases(name: str) -> list[tuple[str, list[int]]]:
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    raw = base.with_name(base.name + ".inp").read_bytes().decode("utf-8")
    inputs = split_vocab_cases(raw)     # as test-tokenizer-0.cpp: a trailing separator ends the last case
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(inputs) == len(lines), f"{name}: {len(inputs)} inputs vs {len(lines)} outputs"
    return [(s, [int(t) for t in line.split()]) for s, line in zip(inputs, lines)]


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
def test_vocab_fixtures(name: str) -> None:
    tok = load(name)
    failures = []
    for text, expected in read_cases(name):
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != expected:
            failures.append(f"{text!r}: got {got} expected {expected}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:10])


ROUND_TRIP = [
    "Hello world",
    " Hello World!",
    "    Hello\n    Hello",
    "нещо на Български",
    "🚀 (normal) 😶‍🌫️ ✅",
    "我想在apple工作1314151天～",
    "Führer ½ months\t\ttabs\r\n",
    "x = [1, 2, 3]  # comment",
]


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
def test_round_trip(name: str) -> None:
    tok = load(name)
    for text in ROUND_TRIP:
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text, (name, text, ids)
        # with BOS stripped by remove_special; like llama.cpp, SPM then keeps the
        # prefix space that encode() added (only a leading piece gets it removed)
        ids = tok.encode(text, add_special=True)
        expected = (" " + text) if tok.type == "spm" else text
        assert tok.decode(ids, remove_special=True) == expected, (name, text, ids)


@needs_vocab
def test_bos_and_specials() -> None:
    spm = load("llama-spm")
    assert (spm.bos_id, spm.eos_id, spm.add_bos, spm.add_eos) == (1, 2, True, False)
    plain = spm.encode("Hello world", add_special=False)
    assert spm.encode("Hello world") == [1] + plain
    assert spm.encode("", add_special=True) == [1]
    assert spm.encode("") == [1] and spm.encode("", add_special=False) == []
    # control tokens only parsed on request
    assert spm.encode("<s>Hi", add_special=False, parse_special=True)[0] == 1
    assert 1 not in spm.encode("<s>Hi", add_special=False, parse_special=False)
    assert spm.is_eog(2) and not spm.is_eog(1)
    assert spm.decode([1, 15043], unparse_special=True) == "<s> Hello"

    ds = load("deepseek-llm")
    assert ds.add_bos and ds.bos_id == 100000
    assert ds.encode("Hello")[0] == 100000
    assert ds.encode("Hello", parse_special=True) == ds.encode("Hello")

    g2 = load("gpt-2")
    assert not g2.add_bos and g2.bos_id == 50256
    assert g2.encode("Hello") == g2.encode("Hello", add_special=False)
    assert g2.encode("<|endoftext|>", add_special=False, parse_special=True) == [50256]
    assert g2.is_eog(50256)
    assert g2.token_to_piece(50256) == "<|endoftext|>"
    assert g2.token_to_piece(50256, special=False) == ""
    # clean_spaces (gpt-2 decodes like HF with clean_up_tokenization_spaces)
    assert g2.decode(g2.encode("Hello , world !", add_special=False)) == "Hello, world!"


def test_unsupported_raises() -> None:
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match="unsupported tokenizer model"):
        Tokenizer.from_metadata(meta)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre",
            "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []}
    with pytest.raises(ValueError, match="pre-tokenizer"):
        Tokenizer.from_metadata(meta)
