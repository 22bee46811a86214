#!/usr/bin/env python3
"""Tokenize test cases with a real model's vocabulary in ikcli and in ik_llama.cpp, and compare.

For vocabularies that cannot ship with the tests (a model file's own, e.g. the Gemma 3 GGUF a
registry package carries): every case of the given .inp files (test-tokenizer-0's format, cases
separated by "\\n__ggml_vocab_test__\\n"; default: ../shared/vocab/*.inp and tests/data/vocab/*.inp)
is tokenized by ik's own llama_tokenize / llama_detokenize (extract_vocab_fixtures' oracle,
compiled against DIR/build/src/libllama.so) and by engine.tokenizer, three ways: ids without
special handling, ids with add_special + parse_special, and the detokenized text of the first.

    python scripts/check_vocab_ik.py MODEL.gguf --ik-root PATH/TO/ik_llama.cpp [--cases A.inp ...]

Prints one line per case file and the first mismatches; exits 1 when any case differs.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from extract_vocab_fixtures import Oracle, split_cases  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--ik-root", type=Path, required=True)
    ap.add_argument("--cases", nargs="*", default=None)
    a = ap.parse_args()
    cases_files = a.cases or sorted(glob.glob(str(ROOT.parent / "shared" / "vocab" / "*.inp"))
                                    + glob.glob(str(ROOT / "tests" / "data" / "vocab" / "*.inp")))
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(str(a.model))
    n_bad = n_all = 0
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        oracle = Oracle(a.ik_root, tmp)
        for inp in cases_files:
            cases = split_cases(Path(inp).read_bytes().decode("utf-8"))
            out, sp, dt = tmp / "o", tmp / "s", tmp / "d"
            oracle.run(a.model, Path(inp), out, sp, dt)
            want = [ln.split() for ln in out.read_text().splitlines()]
            want_sp = [ln.split() for ln in sp.read_text().splitlines()]
            want_dt = dt.read_text().splitlines()
            if not len(want) == len(want_sp) == len(want_dt) == len(cases):
                print(f"{os.path.basename(inp)}: ik gave {len(want)} results for {len(cases)} cases")
                n_bad += 1
                continue
            bad = []
            for i, c in enumerate(cases):
                ids = tok.encode(c, add_special=False, parse_special=False)
                if [str(t) for t in ids] != want[i]:
                    bad.append(f"case {i} {c[:30]!r}: ids {ids[:8]} vs ik {want[i][:8]}")
                ids_sp = tok.encode(c, add_special=True, parse_special=True)
                if [str(t) for t in ids_sp] != want_sp[i]:
                    bad.append(f"case {i} {c[:30]!r}: special ids {ids_sp[:8]} vs ik {want_sp[i][:8]}")
                text = tok.decode([int(t) for t in want[i]], remove_special=False, unparse_special=True)
                if text != bytes.fromhex(want_dt[i]).decode("utf-8", errors="replace"):
                    bad.append(f"case {i} {c[:30]!r}: detokenized {text[:30]!r}")
            n_all += len(cases)
            n_bad += len(bad)
            print(f"{os.path.basename(inp)}: {len(cases)} cases, {len(bad)} mismatches")
            for b in bad[:5]:
                print("   ", b)
    print(f"{a.model.name}: {n_all} cases x 3 checks, {n_bad} mismatches")
    return 1 if n_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
