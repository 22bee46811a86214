#!/usr/bin/env python3
"""Per-token cost of grammar-constrained sampling and of logprobs against plain sampling.

    python scripts/bench_grammar.py [--vocab GGUF] [--tokens 400] [--seed 0]

No model: the sampler (engine.sampling.Sampler, the server's default chain: temp 0.8, top_k 40,
top_p 0.95, min_p 0.05) draws from random logits (N(0, 3^2)) over a real vocabulary, by default
../shared/vocab/ggml-vocab-deepseek-llm.gguf (102400 tokens).  Modes:

    plain         no constraint
    n_probs 10    plain + the top-10 probabilities report (/completion's n_probs, logprobs)
    json_schema   a response_format schema (nested object, enum, array, bounded strings) through
                  llguidance's JSON compiler
    json_object   response_format {"type": "json_object"} (any object)
    gbnf json     llama.cpp's grammars/json.gbnf through engine.grammar's GBNF converter
                  (one lexeme per character, as llama.cpp's character-level parse)
    tool required tool_choice "required": the Hermes (Qwen) tool-call grammar of two tools
                  (engine.tool_grammar), constrained from the first token
    lazy word     tool_choice "auto": the same grammar, lazy, waiting for its word trigger
                  "<tool_call>" (random logits never write it: the cost of waiting)
    lazy pattern  the generic format's lazy grammar, waiting for its full-pattern trigger
                  (an answer that opens with "{"), a regex over the text so far at every token

A generation restarts when its grammar completes.  Prints one table row per mode: the median and
mean milliseconds per token (sample() and the matcher's accept together) and the cost over plain;
and the one-time costs (the vocabulary's LLTokenizer, a grammar's compile).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine import grammar as G  # noqa: E402
from engine.sampling import Sampler, SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.tool_calls import normalize_tools  # noqa: E402
from engine.tool_grammar import tool_grammar  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "mood", "tags", "address"],
}
JSON_GBNF = r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''
TOOLS = normalize_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}])


def tool_params(fmt: str, mode: str, seed: int) -> SamplingParams:
    tg = tool_grammar(fmt, TOOLS, mode, parallel=False)
    return SamplingParams(seed=seed, grammar=tg.grammar, grammar_lazy=tg.lazy, grammar_triggers=tuple(tg.triggers))


def bench(tok, params: SamplingParams, logits: list[np.ndarray], n_tokens: int) -> tuple[np.ndarray, int]:
    """Milliseconds per sampled token over n_tokens, and how many generations it took."""
    times = []
    gens = 0
    while len(times) < n_tokens:
        s = Sampler(params, tok.n_vocab, None, tok.eog_ids, vocab=tok if params.grammar else None)
        gens += 1
        hist: list[int] = []
        while len(times) < n_tokens:
            lg = logits[len(times) % len(logits)]
            t0 = time.perf_counter()
            t = s.sample(lg, hist)
            times.append(time.perf_counter() - t0)
            hist.append(t)
            if tok.is_eog(t) or (s.grammar is not None and s.grammar.is_stopped()):
                break
    return np.array(times) * 1e3, gens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default=os.path.join(os.path.dirname(ROOT), "shared", "vocab",
                                                    "ggml-vocab-deepseek-llm.gguf"))
    ap.add_argument("--tokens", type=int, default=400, help="sampled tokens per mode")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if not G.available():
        sys.exit("llguidance is not installed (pip install llguidance)")
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(a.vocab)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    G.TokenVocab.of(tok)
    t_vocab = time.perf_counter() - t0
    rng = np.random.default_rng(a.seed)
    logits = [(rng.standard_normal(tok.n_vocab) * 3).astype(np.float32) for _ in range(64)]
    modes = [("plain", SamplingParams(seed=a.seed)),
             ("n_probs 10", SamplingParams(seed=a.seed, n_probs=10)),
             ("json_schema", SamplingParams(seed=a.seed, grammar=G.schema_grammar(SCHEMA))),
             ("json_object", SamplingParams(seed=a.seed, grammar=G.schema_grammar({}))),
             ("gbnf json", SamplingParams(seed=a.seed, grammar=JSON_GBNF)),
             ("tool required", tool_params("hermes", "required", a.seed)),
             ("lazy word", tool_params("hermes", "auto", a.seed)),
             ("lazy pattern", tool_params("generic", "auto", a.seed))]
    print(f"vocabulary: {os.path.basename(a.vocab)}, {tok.n_vocab} tokens (load {t_load:.2f} s; "
          f"llguidance tokenizer built once: {t_vocab * 1e3:.0f} ms)")
    print(f"{a.tokens} tokens per mode, random logits, default sampler chain\n")
    print(f"| {'mode':<13} | {'median ms/tok':>13} | {'mean ms/tok':>11} | {'vs plain':>8} | {'compile ms':>10} | generations |")
    print(f"|{'-' * 15}|{'-' * 15}|{'-' * 13}|{'-' * 10}|{'-' * 12}|-------------|")
    base = None
    for name, params in modes:
        compile_ms = 0.0
        if params.grammar:
            t0 = time.perf_counter()
            G.GrammarMatcher(params.grammar, G.TokenVocab.of(tok), params.grammar_lazy, params.grammar_triggers)
            compile_ms = (time.perf_counter() - t0) * 1e3
        bench(tok, params, logits, 20)                     # warm-up
        ms, gens = bench(tok, params, logits, a.tokens)
        med, mean = float(np.median(ms)), float(ms.mean())
        base = base if base is not None else med
        extra = f"{med - base:+.2f}" if name != "plain" else "-"
        print(f"| {name:<13} | {med:13.3f} | {mean:11.3f} | {extra:>8} | {compile_ms:10.2f} | {gens:11d} |")


if __name__ == "__main__":
    main()
