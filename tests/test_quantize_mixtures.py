"""ik_llama.cpp's ftype mixtures: engine.quantize_plan against the types ik's llama-quantize chose.

tests/data/golden_mixtures.json.gz (scripts/make_goldens_mixtures.py) holds, for generated models
(llama 8/16/32/80 layers, a Mixtral-style llama, DeepSeek2 ik and mainline-MLA layouts, a narrow
DeepSeek2 whose matrices all fall back, a Qwen3-MoE-shaped file), the type ik gave every tensor for
each ftype (with and without an imatrix, plus --custom-q / --pure / type-override cases, the
per-class --attn-*-type / --ffn-*-type flags, --ffn-gate-inp-type and --override-kv of an hparam).
The plan must give the same type to every tensor.  Two models are also rebuilt and run through
`ikcli quantize --dry-run`, which checks the hparams read from the file (n_gqa, n_expert, …).
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from conftest import cli
from engine import quantize_plan as qp
from engine.gguf_file import parse_kv_override
from ikcli.quantize_cmd import _block_size

GOLD = json.loads(gzip.decompress((Path(__file__).parent / "data" / "golden_mixtures.json.gz").read_bytes()))
MODELS = GOLD["models"]
CASES = [(m, c) for m in MODELS for c in MODELS[m]["cases"]]


# --override-kv keys of the hparams ModelInfo holds (the golden cases override only these)
_HPARAM_KEYS = {"attention.head_count_kv": "n_head_kv", "attention.head_count": "n_head", "block_count": "n_layer",
                "expert_count": "n_expert", "vocab_size": "n_vocab", "embedding_length": "n_embd"}


def plan_case(model: dict, case: dict) -> list[str]:
    """Our types for a golden case (its llama-quantize arguments applied to plan_tensors)."""
    args, kw = list(case["args"]), {}
    rules = []
    meta = dict(model["meta"])
    classes = {}
    while args:
        a = args.pop(0)
        if a == "--imatrix":
            kw["has_imatrix"] = True
        elif a == "--pure":
            kw["pure"] = True
        elif a == "--custom-q":
            rules += qp.parse_custom_rules(args.pop(0))
        elif a == "--token-embedding-type":
            kw["token_embd_type"] = qp.parse_type(args.pop(0))
        elif a == "--output-tensor-type":
            kw["output_type"] = qp.parse_type(args.pop(0))
        elif a == "--ffn-gate-inp-type":
            kw["ffn_gate_inp_type"] = qp.parse_type(args.pop(0))
        elif a.startswith("--") and a.endswith("-type") and a[2:-5].replace("-", "_") in qp.CLASS_TYPE_KEYS:
            classes[a[2:-5].replace("-", "_")] = qp.parse_type(args.pop(0))
        elif a == "--override-kv":
            key, kind, value = parse_kv_override(args.pop(0))
            field = _HPARAM_KEYS.get(key.removeprefix(meta["arch"] + "."))
            if field is not None:                  # the others do not reach the rules
                meta[field] = value
        else:
            raise AssertionError(f"unexpected argument {a}")
    mi = qp.ModelInfo(**meta)
    plans, _ = qp.plan_tensors([(n, tuple(ne), t) for n, ne, t in model["tensors"]], qp.parse_ftype(case["ftype"]),
                               mi, rules=rules, block_size=_block_size, class_types=classes, **kw)
    return [qp.TYPE_NAME[p.new_type].lower() for p in plans]


@pytest.mark.parametrize("model,case", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_mixture_matches_ik(model, case):
    m = MODELS[model]
    want = m["cases"][case]["types"].split()
    got = plan_case(m, m["cases"][case])
    bad = [(t[0], w, g) for t, w, g in zip(m["tensors"], want, got) if w != g]
    assert not bad, f"{len(bad)} of {len(want)} tensors differ (tensor, ik, ours): {bad[:8]}"


def test_goldens_exercise_the_rules():
    """The goldens are not trivial: layer-dependent choices, fallbacks and interleaved row fallbacks occur."""
    ds = MODELS["ds8"]["cases"]
    names = [t[0] for t in MODELS["ds8"]["tensors"]]
    qkm = dict(zip(names, ds["Q4_K_M"]["types"].split()))
    assert qkm["blk.0.ffn_down.weight"] == "q6_k" and qkm["blk.2.ffn_down_exps.weight"] == "q4_k"
    assert qkm["blk.3.ffn_down_exps.weight"] == "q6_k"    # use_more_bits(3, 8)
    assert qkm["blk.1.attn_kv_b.weight"] == "q8_0" and qkm["output.weight"] == "q6_k"
    ll = MODELS["llama8"]
    names = [t[0] for t in ll["tensors"]]
    r8 = dict(zip(names, ll["cases"]["Q8_0_R8"]["types"].split()))
    assert r8["output.weight"] == "q8_0"                 # 265 rows: not a multiple of 8
    assert r8["blk.0.attn_q.weight"] == "q8_0_r8"
    tiny = MODELS["ds-tiny"]["cases"]["IQ2_KS"]["types"].split()
    assert "iq2_ks" not in tiny and "iq4_nl" in tiny      # 64-wide: all fall back


def _dry_run_types(out: str) -> dict[str, str]:
    got = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+)\s+\[[^\]]*\]\s+(\S+)(?: -> (\S+))?\s", line)
        if m:
            got[m.group(1)] = (m.group(3) or m.group(2)).lower()
    return got


@pytest.mark.parametrize("model,ftypes", [("llama8", ["Q4_K_M", "IQ4_KSS", "Q3_K_L"]),
                                          ("ds8", ["Q4_K_M", "IQ2_KS", "Q6_K_R4"])])
def test_cli_dry_run_matches_ik(make_model, tmp_path, capsys, model, ftypes):
    m = MODELS[model]
    make = dict(m["make"])
    src = make_model(**make)
    for ftype in ftypes:
        code, out, err = cli(capsys, "quantize", "--dry-run", src, str(tmp_path / "o.gguf"), ftype)
        assert code == 0, err
        assert "not implemented" not in err
        got = _dry_run_types(out)
        want = dict(zip([t[0] for t in m["tensors"]], m["cases"][ftype]["types"].split()))
        assert got == want, [(n, want[n], got.get(n)) for n in want if got.get(n) != want[n]][:8]


def test_expert_layer_from_name_errors():
    """With experts ik takes the layer from the name and refuses names without one / out of range."""
    mi = qp.ModelInfo("deepseek2", 4, 8, 4, 4, 265, 256)
    with pytest.raises(qp.PlanError, match="Failed to determine layer for tensor foo.ffn_down.weight"):
        qp.plan_tensors([("foo.ffn_down.weight", (256, 256), 1)], qp.parse_ftype("Q4_K_M"), mi)
    with pytest.raises(qp.PlanError, match=r"Bad layer 9 .* Must be in \[0, 4\)"):
        qp.plan_tensors([("blk.9.ffn_down.weight", (256, 256), 1)], qp.parse_ftype("Q4_K_M"), mi)
