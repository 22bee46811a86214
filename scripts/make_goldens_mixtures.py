#!/usr/bin/env python3
"""Record ik_llama.cpp's per-tensor type choices (llama-quantize's ftype mixtures) as test goldens.

    IK_QUANTIZE=/work/ik_build/bin/llama-quantize python scripts/make_goldens_mixtures.py [--out PATH]

For a few generated f16 models (llama with 8/16/32/80 layers, n_gqa 2/4/8, a Mixtral-style llama,
DeepSeek2 in the ik and the mainline-MLA layouts, a narrow DeepSeek2 whose matrices all fall back,
a Qwen3-MoE-shaped file) and many ftypes, runs ik's llama-quantize and keeps the type of every
tensor.  Most cases run with --dry-run and are read from its log ("converting to TYPE"), which is
what lets the very low-bit ftypes (they need an imatrix to really quantize) and the 80-layer model
be recorded cheaply; a subset is quantized for real and read back from the output GGUF, and must
agree with the dry-run log (checked here).  Cases with an imatrix use a .dat of all-ones weights
written here (only its presence matters for the choice of types).

The extra cases add the per-class type flags (--attn-q-type … --ffn-up-type, also against the
IQ1_S_R4 / IQ2_KT and IQ1 / IQ2 group rules and with --pure), --ffn-gate-inp-type on the MoE
models, and --override-kv: of hparams the rules read (n_head_kv) and, quantized for real, of
plain metadata, whose keys, GGUF value types and values in ik's output are recorded too ("kv").

Writes tests/data/golden_mixtures.json.gz (gzipped JSON: ~28 KB instead of ~650 KB): the ftype list
of llama-quantize's usage ("ftypes": number and name, in its order) and per model its
hparams (engine.quantize_plan.ModelInfo), how to rebuild it (scripts/make_test_model.py arguments),
its tensors (name, ne, source type) and per case the types, so that tests/test_quantize_mixtures.py
needs neither ik nor the model files.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gguf  # noqa: E402

import make_test_model as mtm  # noqa: E402
from engine.gguf_file import _open_one, open_model_file  # noqa: E402
from engine.quantize_plan import TYPE_ID, TYPE_NAME, ModelInfo  # noqa: E402

IK_QUANTIZE = os.environ.get("IK_QUANTIZE", "/work/ikbuild/build/bin/llama-quantize")

# the ftypes of the brief and the rest of ik's mixtures (their _R4/_R8 variants included)
CORE = ["Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_0", "IQ4_NL", "IQ4_XS", "IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K",
        "IQ6_K", "IQ4_KS", "IQ4_KSS", "IQ2_KS", "IQ5_KS"]
R4 = ["Q4_0_R8", "Q8_0_R8", "Q5_0_R4", "Q6_0_R4", "Q2_K_R4", "Q3_K_R4", "Q4_K_R4", "Q5_K_R4", "Q6_K_R4",
      "IQ4_NL_R4", "IQ4_XS_R8", "IQ2_K_R4", "IQ3_K_R4", "IQ4_K_R4", "IQ5_K_R4", "IQ4_KS_R4", "IQ5_KS_R4",
      "Q8_K_R8", "Q8_KV", "Q8_KV_R8"]
OTHER = ["IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ3_KS", "IQ3_KL", "IQ2_KL", "IQ2_XXS", "IQ2_XS", "IQ2_S",
         "IQ2_M", "IQ1_S", "IQ1_M", "IQ2_KT", "IQ3_KT", "IQ4_KT", "IQ1_KT", "IQ2_XXS_R4", "IQ2_XS_R4",
         "IQ3_XXS_R4", "IQ3_S_R4", "IQ2_M_R4", "IQ1_S_R4", "IQ1_M_R4"]
ALL = CORE + R4 + OTHER
# ftypes whose choices depend on an imatrix being given at all
IMATRIX_DEPENDENT = ["IQ3_XXS", "IQ3_XXS_R4", "IQ3_KT", "IQ4_NL", "IQ4_XS", "IQ4_KS", "IQ4_KSS", "IQ4_NL_R4",
                     "IQ4_XS_R8", "IQ4_KS_R4", "Q4_0", "Q5_0", "Q4_0_R8"]
# the ones the 8B/70B rules concern (the big models get only these)
SIZE_DEPENDENT = ["Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M",
                  "IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ5_KS", "IQ4_XS", "Q4_K_R4", "IQ3_XXS", "IQ3_M"]
# cases quantized for real (read back from the GGUF) on the models marked real=True
REAL = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_S", "Q6_K", "Q4_0", "IQ4_XS", "IQ2_K", "IQ4_KS", "IQ4_KSS", "IQ2_KS",
        "Q8_0_R8", "Q4_K_R4", "IQ4_K_R4"]

# head_dim = n_embd / n_head everywhere: else ik's hparams loading stops at its n_rot check, before
# it sets the model size (8B/70B) the rules look at.

# every per-class flag at once (type names as ggml spells them: ik's parse_ggml_type is case-sensitive)
ALL_CLASSES = ["--attn-q-type", "q8_0", "--attn-k-type", "q5_0", "--attn-v-type", "q8_0", "--attn-qkv-type", "q4_0",
               "--attn-output-type", "iq4_ks", "--ffn-gate-type", "q5_K", "--ffn-down-type", "q6_0",
               "--ffn-up-type", "iq4_nl"]
# name: (make_test_model.write_model arguments or None for a hand-built file, ftypes, real, extra cases)
MODELS: dict[str, dict[str, Any]] = {
    "llama8": dict(make=dict(arch="llama", preset="small256", n_layer=8, head_dim=64), ftypes=ALL, real=True,
                   extra={"Q4_K_M+custom": ["--custom-q", r"ffn_up=iq4_k_r4,blk\.[0-3]\.attn_q=q6_K",
                                            "--token-embedding-type", "q4_k_r4"],
                          "Q3_K_M+output": ["--output-tensor-type", "q8_0_r8"],
                          "Q4_K_M+pure": ["--pure"],
                          # a --custom-q match still wins; output.weight keeps its own rule
                          "Q4_K_M+classes": [*ALL_CLASSES, "--custom-q", r"blk\.1\.ffn_up=q8_0"],
                          "IQ3_XS+classes": ALL_CLASSES,
                          # the IQ1/IQ2 group looks only at --attn-output-type
                          "IQ2_XXS+classes": ALL_CLASSES,
                          "Q4_K_M+pure-classes": ["--pure", *ALL_CLASSES],
                          "Q8_0+kv": ["--override-kv", "general.name=str:renamed", "--override-kv",
                                      "llama.context_length=int:4096", "--override-kv", "ikcli.test.flag=bool:true",
                                      "--override-kv", "ikcli.test.scale=float:0.25", "--override-kv",
                                      "general.file_type=int:99"]}),
    "llama16-gqa4": dict(make=dict(arch="llama", preset="small256", n_layer=16, n_head=8, n_head_kv=2, head_dim=32),
                         ftypes=ALL, real=False,
                         # the hparams the rules read come with the overrides applied (n_gqa 4 -> 1)
                         extra={"IQ4_XS+kv-gqa": ["--override-kv", "llama.attention.head_count_kv=int:8"],
                                "Q3_K_S+kv-gqa": ["--override-kv", "llama.attention.head_count_kv=int:8"]}),
    "llama-moe8": dict(make=dict(arch="llama", preset="small256", n_layer=8, llama_moe=True, n_expert=8,
                                 n_ff=256, head_dim=64), ftypes=ALL, real=False,
                       extra={"IQ1_S_R4+classes": ALL_CLASSES,     # only --ffn-down-type, and not for blk.0
                              "Q4_K_M+gate-inp": ["--ffn-gate-inp-type", "q8_0", "--ffn-gate-type", "iq4_k",
                                                  "--ffn-up-type", "q5_0"]}),
    "llama70b": dict(make=dict(arch="llama", preset="small256", n_layer=80, n_head=8, n_head_kv=1, head_dim=32,
                               n_ff=256), ftypes=SIZE_DEPENDENT, real=False, extra={}),
    "llama8b": dict(make=dict(arch="llama", preset="small256", n_layer=32, head_dim=64), vocab_size=128256,
                    ftypes=SIZE_DEPENDENT, real=False, extra={}),
    "ds8": dict(make=dict(arch="deepseek2", preset="small256", n_layer=8), ftypes=ALL, real=True,
                extra={"IQ4_KS+custom": ["--custom-q", "attn_k_b=q8_0,ffn_down_exps=iq4_k,exps=iq3_k"],
                       "Q4_K_M+classes": [*ALL_CLASSES, "--ffn-gate-inp-type", "f32"],   # the routers' own type
                       "IQ2_KT+classes": ALL_CLASSES}),
    "ds-mla": dict(make=dict(arch="deepseek2", layout="mainline-mla", preset="small256", n_layer=16, n_expert=4,
                             n_expert_shared=2, n_dense_lead=1), ftypes=ALL, real=False, extra={}),
    "ds-tiny": dict(make=dict(arch="deepseek2", preset="tiny", n_layer=8, q_lora_rank=64),
                    ftypes=[f for f in CORE + R4 + OTHER if f not in ("Q8_KV", "Q8_KV_R8")], real=True, extra={}),
    "qwen3moe": dict(make=None, ftypes=ALL, real=False,
                     extra={"IQ3_XS+gate-inp": ["--ffn-gate-inp-type", "q8_0", "--ffn-gate-type", "q6_K"],
                            "IQ2_KS+gate-inp": ["--ffn-gate-inp-type", "iq4_nl", "--attn-output-type", "q8_0"]}),
}


def write_model(path: str, spec: dict) -> None:
    make = dict(spec["make"])
    arch = make.pop("arch")
    layout = make.pop("layout", "ik")
    preset = make.pop("preset")
    if "vocab_size" in spec:
        # ik's hparams take n_vocab from {arch}.vocab_size (the 8B rules look at it); the tokens stay few
        orig = mtm._common_kv

        def common_kv(gw, a, s, n_vocab, eps):
            orig(gw, a, s, spec["vocab_size"], eps)
        mtm._common_kv = common_kv
        try:
            mtm.write_model(path, arch, layout, "f16", preset, 0, 1, **make)
        finally:
            mtm._common_kv = orig
    else:
        mtm.write_model(path, arch, layout, "f16", preset, 0, 1, **make)


def write_qwen3moe(path: str, n_layer: int = 8) -> None:
    """A Qwen3-MoE-shaped file (ikcli does not run this architecture; only the names matter here)."""
    rng = np.random.default_rng(1)
    a, E, H, KV, D, X, F = "qwen3moe", 256, 8, 2, 32, 8, 256
    gw = gguf.GGUFWriter(path, a)
    n_vocab = mtm._tokenizer_kv(gw)
    for k, v in (("context_length", 256), ("embedding_length", E), ("block_count", n_layer),
                 ("feed_forward_length", 512), ("attention.head_count", H), ("attention.head_count_kv", KV),
                 ("attention.key_length", D), ("attention.value_length", D), ("expert_count", X),
                 ("expert_used_count", 2), ("expert_feed_forward_length", F), ("vocab_size", n_vocab)):
        gw.add_uint32(f"{a}.{k}", v)
    gw.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    gw.add_float32(f"{a}.rope.freq_base", 1e6)

    def mat(name, *shape):
        gw.add_tensor(name, (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float16))

    def vec(name, n):
        gw.add_tensor(name, np.ones(n, np.float32))
    mat("token_embd.weight", n_vocab, E)
    vec("output_norm.weight", E)
    mat("output.weight", n_vocab, E)
    for i in range(n_layer):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", E)
        mat(p + "attn_q.weight", H * D, E)
        mat(p + "attn_k.weight", KV * D, E)
        mat(p + "attn_v.weight", KV * D, E)
        mat(p + "attn_output.weight", E, H * D)
        vec(p + "attn_q_norm.weight", D)
        vec(p + "attn_k_norm.weight", D)
        vec(p + "ffn_norm.weight", E)
        gw.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((X, E)).astype(np.float32))
        mat(p + "ffn_gate_exps.weight", X, F, E)
        mat(p + "ffn_up_exps.weight", X, F, E)
        mat(p + "ffn_down_exps.weight", X, E, F)
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()


def write_imatrix(path: str, tensors: list) -> None:
    """A legacy .dat imatrix with all-ones weights for every matrix (ne0 * ne2 values each)."""
    entries = [(n, ne) for n, ne, _ in tensors if len(ne) >= 2 and n.endswith("weight")]
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for n, ne in entries:
            b = n.encode()
            nval = ne[0] * (ne[2] if len(ne) > 2 else 1)
            f.write(struct.pack("<i", len(b)) + b + struct.pack("<ii", 1, nval))
            f.write(np.ones(nval, np.float32).tobytes())
        f.write(struct.pack("<ii", 1, 4) + b"none")


HEAD = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+) - \[[^\]]*\], type =\s*(\S+), ")


def parse_dry_run(log: str, names: list[str]) -> list[str]:
    """Per tensor, the type in llama-quantize's log: "converting to T" or else its own type."""
    heads = list(HEAD.finditer(log))
    got: dict[str, str] = {}
    for k, m in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else len(log)
        conv = re.findall(r"converting to (\S+) \.\.", log[m.end():end])
        got[m.group(1)] = conv[-1] if conv else m.group(2)
    missing = [n for n in names if n not in got]
    if missing:
        raise RuntimeError(f"no log line for {missing[:3]}")
    return [got[n].lower() for n in names]


def run_ik(args: list[str]) -> str:
    r = subprocess.run([IK_QUANTIZE, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-quantize {' '.join(args)} failed:\n{(r.stdout + r.stderr)[-2000:]}")
    if "XXXXXXXXXX" in r.stdout + r.stderr:    # ik's hparams loading threw: its choices would be partial
        raise RuntimeError(f"llama-quantize {' '.join(args)}: the model's hparams did not load")
    return r.stdout + r.stderr


def kv_of(reader, keys: list[str]) -> dict:
    """The given keys of a GGUF file (engine.gguf_file's reader) as [GGUF value type name, value]."""
    return {k: [gguf.GGUFValueType(reader.kv_types[k][0]).name, reader.meta[k]] for k in keys if k in reader.meta}


def record(key: str, spec: dict, tmp: str) -> dict:
    src = os.path.join(tmp, f"{key}.gguf")
    if spec["make"] is None:
        write_qwen3moe(src)
    else:
        write_model(src, spec)
    mf = open_model_file(src)
    tensors = [(e.name, [int(x) for x in e.ne], int(e.qtype)) for e in mf.tensors.values()]
    names = [t[0] for t in tensors]
    mi = ModelInfo.from_meta(mf.meta)
    imat = os.path.join(tmp, f"{key}.dat")
    write_imatrix(imat, tensors)
    cases: dict[str, dict] = {}
    todo = [(f, f, []) for f in spec["ftypes"]]
    todo += [(f + "+imatrix", f, ["--imatrix", imat]) for f in IMATRIX_DEPENDENT if f in spec["ftypes"]]
    todo += [(c, c.split("+")[0], a) for c, a in spec["extra"].items()]
    for case, ftype, extra in todo:
        out = os.path.join(tmp, "out.gguf")
        base = ["--ignore-imatrix-rules", *extra]
        log = run_ik(["--dry-run", *base, src, out, ftype, "2"])
        types = parse_dry_run(log, names)
        via = "dry-run"
        kv = None
        if spec["real"] and (ftype in REAL or "--override-kv" in extra) and "--imatrix" not in extra:
            run_ik([*base, src, out, ftype, "2"])
            r = _open_one(out)
            real = [TYPE_NAME[int(t.qtype)].lower() for t in r.ik_tensors]
            if [t.name for t in r.ik_tensors] != names or real != types:
                diff = [(n, a, b) for n, a, b in zip(names, types, real) if a != b]
                raise RuntimeError(f"{key} {case}: dry-run log and GGUF disagree: {diff[:5]}")
            if "--override-kv" in extra:
                keys = [a.split("=")[0] for p, a in zip(extra, extra[1:]) if p == "--override-kv"]
                kv = {"keys": list(r.meta), "values": kv_of(r, keys)}
            del r
            os.unlink(out)
            via = "gguf"
        for t in types:
            if t not in TYPE_ID:
                raise RuntimeError(f"unknown type name {t}")
        cases[case] = {"ftype": ftype, "args": extra if "--imatrix" not in extra else ["--imatrix"],
                       "via": via, "types": " ".join(types)}
        if kv is not None:
            cases[case]["kv"] = kv
        print(f"{key:14s} {case:18s} {via}", flush=True)
    return {"make": spec["make"], "vocab_size": spec.get("vocab_size"),
            "meta": {k: getattr(mi, k) for k in ("arch", "n_layer", "n_expert", "n_head", "n_head_kv", "n_vocab",
                                                 "n_embd")},
            "tensors": tensors, "cases": cases}


def ik_ftypes() -> list:
    """The "Allowed quantization types" of llama-quantize's usage: [llama_ftype or None (COPY), name]."""
    r = subprocess.run([IK_QUANTIZE], capture_output=True, text=True)
    text = r.stdout.split("Allowed quantization types:", 1)[1]
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s+(\d+)\s+or\s+(\S+)\s+:", line) or re.match(r"^ {10}(\S+)\s+:", line)
        if m:
            out.append([int(m.group(1)), m.group(2)] if m.lastindex == 2 else [None, m.group(1)])
    if len(out) < 80 or out[-1] != [None, "COPY"]:
        raise RuntimeError(f"unexpected llama-quantize usage text ({len(out)} types)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "golden_mixtures.json.gz"))
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    a = ap.parse_args()
    res = {"source": f"ik_llama.cpp {IK_QUANTIZE} (scripts/make_goldens_mixtures.py)", "ftypes": ik_ftypes(),
           "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for key in a.models:
            res["models"][key] = record(key, MODELS[key], tmp)
    # mtime=0: the same goldens give the same bytes
    with open(a.out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(json.dumps(res, separators=(",", ":")).encode() + b"\n")
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes)")


if __name__ == "__main__":
    main()
