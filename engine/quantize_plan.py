"""Which type each tensor gets when a model is quantized: ik_llama.cpp's llama-quantize rules.

Plain values in, a plan out (no flags, no I/O).  Follows src/llama-quantize.cpp of ik_llama.cpp:

* which tensors are quantized at all (2-D+ tensors whose name ends in "weight", except norms,
  ffn_gate_inp, position/token-type embeddings, ssm_conv1d/ssm_x/ssm_dt, attn_rel_b; output.weight
  unless leave_output);
* llama_tensor_get_type, all of it: the per-ftype mixtures (Q2_K … Q6_K, IQ1 … IQ6_K, the KS/KT/KL
  types and their _R4/_R8 ftypes): output.weight / token_embd.weight choices, the attn_v rules
  (n_gqa, n_expert, model size 8B/70B, the i_attention_wv counter and use_more_bits), attn_k* /
  attn_q* / attn_output / ffn_down / ffn_gate / ffn_up rules with the layer counters (or, for
  models with experts, the layer parsed from the name), the imatrix-dependent choices; --custom-q
  rules (first match wins) override these;
* change_type_if_necessary: 256-block types on rows that are not a multiple of 256 fall back
  (→ IQ4_NL / Q5_0 / Q6_0 / Q8_0 as in ik);
* the pure / token-embedding-type / output-tensor-type overrides of the main loop, token_embd
  never row-interleaved, and the interleaved (_R4/_R8) types' fallback to their plain type when the
  tensor's rows are not a multiple of the interleaving.

* the per-tensor-class types (--attn-q-type, --attn-k-type, --attn-v-type, --attn-qkv-type,
  --attn-output-type, --ffn-gate-type, --ffn-down-type, --ffn-up-type; `class_types`) where ik
  applies them: inside llama_tensor_get_type's branches, so they lose to the output.weight /
  token_embd rules and, in the IQ1_S_R4 / IQ1_M_R4 / IQ2_KT and IQ1 / IQ2 group branches, apply
  only where ik checks them there (ffn_down in the former, attn_output in the latter); a matching
  --custom-q rule still wins.  The substring tests decide the class as in ik: attn_q covers
  attn_qkv, attn_q_a and attn_q_b (so --attn-qkv-type never takes effect), attn_k covers attn_kv_b,
  attn_k_b and attn_kv_a_mqa, ffn_gate covers ffn_gate_exps / _shexp and ffn_gate_inp.  ik's main
  loop compares them once more with whole names such as "attn_q.weight", which no tensor has
  ("blk.0.attn_q.weight"): no effect, so nothing here either;
* --ffn-gate-inp-type (`ffn_gate_inp_type`): ffn_gate_inp tensors are quantized only when it is
  given and differs from their type; they then go through llama_tensor_get_type like any other
  tensor (the ffn_gate branch: counters, fallback notes) and get the type after it, unchecked.

Checked tensor for tensor against ik's llama-quantize (tests/test_quantize_mixtures.py).  Our
own additions: a tensor whose rows still do not fit the block size after ik's fallback gets F16
(mainline's rule) instead of ik's "Unsupported tensor size" error, and an --ffn-gate-inp-type
whose blocks do not fit the rows is a PlanError (ik aborts in ggml_row_size).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

# ggml type ids and ggml_type_name() spellings of ik_llama.cpp
_GGML = [
    ("f32", 0), ("f16", 1), ("q4_0", 2), ("q4_1", 3), ("q5_0", 6), ("q5_1", 7), ("q8_0", 8), ("q8_1", 9),
    ("q2_K", 10), ("q3_K", 11), ("q4_K", 12), ("q5_K", 13), ("q6_K", 14), ("q8_K", 15),
    ("iq2_xxs", 16), ("iq2_xs", 17), ("iq3_xxs", 18), ("iq1_s", 19), ("iq4_nl", 20), ("iq3_s", 21),
    ("iq2_s", 22), ("iq4_xs", 23), ("i8", 24), ("i16", 25), ("i32", 26), ("i64", 27), ("f64", 28),
    ("iq1_m", 29), ("bf16", 30), ("mxfp4", 39), ("q6_0", 133), ("iq1_bn", 134), ("iq2_bn", 135),
    ("iq2_k", 137), ("iq3_k", 138), ("iq4_k", 139), ("iq5_k", 140), ("iq6_k", 141), ("iq4_ks", 144),
    ("iq2_ks", 145), ("iq4_kss", 146), ("q8_KV", 151), ("iq5_ks", 152), ("iq2_kt", 153), ("iq3_kt", 154),
    ("iq4_kt", 155), ("iq3_ks", 156), ("iq2_kl", 157), ("iq1_kt", 158),
    ("q4_0_r8", 202), ("q5_0_r4", 206), ("q8_0_r8", 208), ("q2_k_r4", 210), ("q3_k_r4", 211),
    ("q4_k_r4", 212), ("q5_k_r4", 213), ("q6_k_r4", 214), ("iq2_xxs_r4", 216), ("iq2_xs_r4", 217),
    ("iq3_xxs_r4", 218), ("iq1_s_r4", 219), ("iq4_nl_r4", 220), ("iq3_s_r4", 221), ("iq2_s_r4", 222),
    ("iq4_xs_r8", 223), ("iq1_m_r4", 229), ("bf16_r16", 230), ("q6_0_r4", 233), ("iq2_bn_r4", 335),
    ("iq2_k_r4", 337), ("iq3_k_r4", 338), ("iq4_k_r4", 339), ("iq5_k_r4", 340), ("iq4_ks_r4", 344),
    ("iq5_ks_r4", 352), ("mxfp4_r8", 353), ("q8_KV_r8", 398), ("q8_k_r8", 399),
]
TYPE_ID: dict[str, int] = {n.lower(): i for n, i in _GGML}
TYPE_NAME: dict[int, str] = {i: n for n, i in _GGML}
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_K, Q6_0, BF16, IQ4_NL = 0, 1, 2, 3, 6, 7, 8, 14, 133, 30, 20
# types ik refuses to produce for a tensor without importance data ("very low-bit"; Q2_K only for Q2_K_S)
VERY_LOW_BIT = {16, 216, 17, 217, 22, 222, 19, 219, 29, 229, 158, 153}
# ftypes llama-quantize refuses without an imatrix at all
NEED_IMATRIX_FTYPES = {"IQ2_XS", "IQ2_XXS", "IQ2_S", "IQ2_XXS_R4", "Q2_K_S", "IQ2_XS_R4", "IQ1_S", "IQ1_S_R4",
                       "IQ1_M_R4", "IQ1_M"}


def imatrix_lookup(name: str, data: dict) -> str | None:
    """The imatrix entry llama-quantize uses for tensor `name` (its fallbacks: ffn_gate/up_exps ->
    ffn_gate_up_exps or ffn_up_exps, ffn_gate_up_exps -> ffn_up_exps, ffn_gate -> ffn_up,
    attn_v_b <-> attn_kv_b); None when there is none."""
    if name in data:
        return name
    alt = None
    p1, p2 = name.find("ffn_up_exps.weight"), name.find("ffn_gate_exps.weight")
    if p1 >= 0 or p2 >= 0:
        pos = p1 if p1 >= 0 else p2
        alt = name[:pos] + "ffn_gate_up_exps.weight"
        if alt not in data:
            alt = name[:pos] + "ffn_up_exps.weight"
    elif (pos := name.find("ffn_gate_up_exps.weight")) >= 0:
        alt = name[:pos] + "ffn_up_exps.weight"
    elif (pos := name.find("ffn_gate.weight")) >= 0:
        alt = name[:pos] + "ffn_up.weight"
    else:
        for a, b in ((".attn_v_b.weight", ".attn_kv_b.weight"), (".attn_kv_b.weight", ".attn_v_b.weight")):
            if (pos := name.find(a)) >= 0:
                alt = name[:pos] + b
                break
    return alt if alt is not None and alt in data else None
_INT_TYPES = {24, 25, 26, 27}
_UNQUANTIZED = {F32, F16, BF16, 28, 230} | _INT_TYPES

# examples/quantize/quantize.cpp QUANT_OPTIONS: name, llama_ftype, base ggml type (name)
FTYPES: list[tuple[str, int, str]] = [
    ("Q4_0", 2, "q4_0"), ("Q4_1", 3, "q4_1"), ("Q5_0", 8, "q5_0"), ("Q5_1", 9, "q5_1"), ("Q6_0", 135, "q6_0"),
    ("MXFP4", 38, "mxfp4"), ("MXFP4_R8", 351, "mxfp4_r8"),
    ("IQ2_XXS", 19, "iq2_xxs"), ("IQ2_XXS_R4", 219, "iq2_xxs_r4"), ("IQ2_XS", 20, "iq2_xs"),
    ("IQ2_XS_R4", 220, "iq2_xs_r4"), ("IQ2_S", 28, "iq2_xs"), ("IQ2_M", 29, "iq2_s"), ("IQ2_M_R4", 229, "iq2_s_r4"),
    ("IQ1_S", 24, "iq1_s"), ("IQ1_S_R4", 224, "iq1_s_r4"), ("IQ1_M_R4", 231, "iq1_m_r4"), ("IQ1_M", 31, "iq1_m"),
    ("IQ1_BN", 136, "iq1_bn"), ("IQ2_BN", 137, "iq2_bn"), ("IQ2_BN_R4", 337, "iq2_bn_r4"),
    ("Q2_K", 10, "q2_K"), ("Q2_K_R4", 210, "q2_k_r4"), ("Q2_K_S", 21, "q2_K"), ("IQ3_XXS", 23, "iq3_xxs"),
    ("IQ3_KT", 152, "iq3_kt"), ("IQ4_KT", 153, "iq4_kt"), ("IQ3_XXS_R4", 223, "iq3_xxs_r4"), ("IQ3_S", 26, "iq3_s"),
    ("IQ3_S_R4", 226, "iq3_s_r4"), ("IQ3_M", 27, "iq3_s"), ("Q3_K", 12, "q3_K"), ("Q3_K_R4", 211, "q3_k_r4"),
    ("IQ3_XS", 22, "iq3_s"), ("Q3_K_S", 11, "q3_K"), ("Q3_K_M", 12, "q3_K"), ("Q3_K_L", 13, "q3_K"),
    ("IQ4_NL", 25, "iq4_nl"), ("IQ4_NL_R4", 225, "iq4_nl_r4"), ("IQ4_XS_R8", 230, "iq4_xs_r8"),
    ("Q4_0_R8", 202, "q4_0_r8"), ("Q5_0_R4", 208, "q5_0_r4"), ("Q6_0_R4", 335, "q6_0_r4"), ("Q8_0_R8", 207, "q8_0_r8"),
    ("Q8_KV", 149, "q8_KV"), ("IQ4_XS", 30, "iq4_xs"), ("IQ4_KS", 145, "iq4_ks"), ("IQ4_KS_R4", 345, "iq4_ks_r4"),
    ("IQ5_KS_R4", 350, "iq5_ks_r4"), ("IQ4_KSS", 148, "iq4_kss"), ("IQ5_KS", 150, "iq5_ks"), ("IQ2_K", 138, "iq2_k"),
    ("IQ2_K_R4", 338, "iq2_k_r4"), ("IQ2_KS", 147, "iq2_ks"), ("IQ1_KT", 156, "iq1_kt"), ("IQ2_KT", 151, "iq2_kt"),
    ("IQ2_KL", 155, "iq2_kl"), ("IQ3_KS", 154, "iq3_ks"), ("IQ3_K", 139, "iq3_k"), ("IQ3_K_R4", 339, "iq3_k_r4"),
    ("IQ3_KL", 146, "iq3_k"), ("IQ4_K", 140, "iq4_k"), ("IQ4_K_R4", 340, "iq4_k_r4"), ("IQ5_K", 141, "iq5_k"),
    ("IQ5_K_R4", 341, "iq5_k_r4"), ("IQ6_K", 142, "iq6_k"), ("Q4_K", 15, "q4_K"), ("Q4_K_R4", 214, "q4_k_r4"),
    ("Q4_K_S", 14, "q4_K"), ("Q4_K_M", 15, "q4_K"), ("Q5_K", 17, "q5_K"), ("Q5_K_R4", 216, "q5_k_r4"),
    ("Q5_K_S", 16, "q5_K"), ("Q5_K_M", 17, "q5_K"), ("Q6_K", 18, "q6_K"), ("Q6_K_R4", 218, "q6_k_r4"),
    ("Q8_K_R8", 399, "q8_k_r8"), ("Q8_KV_R8", 398, "q8_KV_r8"), ("Q8_0", 7, "q8_0"),
    ("Q4_0_4_4", 33, ""), ("Q4_0_4_8", 34, ""), ("Q4_0_8_8", 35, ""),
    ("F16", 1, "f16"), ("BF16", 32, "bf16"), ("BF16_R16", 232, "bf16_r16"), ("F32", 0, "f32"), ("COPY", 0, ""),
]

# --attn-q-type … --ffn-up-type: the keys of plan_tensors' class_types (ik's params->X_type)
CLASS_TYPE_KEYS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_down", "ffn_up")

# change_type_if_necessary: 256-wide block types and where they fall back to
_FALLBACK: dict[str, str] = {}
for _n in ("iq2_xxs iq2_xxs_r4 iq2_xs iq2_xs_r4 iq2_ks iq2_s iq2_s_r4 iq3_xxs iq3_xxs_r4 iq3_s iq3_s_r4 iq1_s "
           "iq1_m q2_K q2_k_r4 q3_K q3_k_r4 iq2_k iq2_k_r4 iq2_kl iq3_ks iq3_k iq3_k_r4 iq4_kss iq4_ks iq4_ks_r4 "
           "iq4_xs_r8 iq1_kt iq2_kt iq3_kt iq4_kt iq4_xs").split():
    _FALLBACK[_n] = "iq4_nl"
for _n in "iq4_k iq4_k_r4 q4_k_r4 iq5_ks iq5_ks_r4 q4_K".split():
    _FALLBACK[_n] = "q5_0"
for _n in "iq5_k iq5_k_r4 q5_k_r4 q5_K".split():
    _FALLBACK[_n] = "q6_0"
for _n in "iq6_k q6_k_r4 q8_k_r8 q6_K".split():
    _FALLBACK[_n] = "q8_0"
_FALLBACK_IDS = {TYPE_ID[k.lower()]: TYPE_ID[v.lower()] for k, v in _FALLBACK.items()}
QK_K = 256

# ggml types by upper-case name (G.Q4_K, G.IQ4_K_R4 …) and llama_ftype ids (include/llama.h) by the
# LLAMA_FTYPE_MOSTLY_ suffix (L.Q4_K_M …): the names llama_tensor_get_type is written in
G = SimpleNamespace(**{n.upper(): i for n, i in _GGML})
L = SimpleNamespace(
    F32=0, F16=1, Q4_0=2, Q4_1=3, Q8_0=7, Q5_0=8, Q5_1=9, Q2_K=10, Q3_K_S=11, Q3_K_M=12, Q3_K_L=13,
    Q4_K_S=14, Q4_K_M=15, Q5_K_S=16, Q5_K_M=17, Q6_K=18, IQ2_XXS=19, IQ2_XS=20, Q2_K_S=21, IQ3_XS=22,
    IQ3_XXS=23, IQ1_S=24, IQ4_NL=25, IQ3_S=26, IQ3_M=27, IQ2_S=28, IQ2_M=29, IQ4_XS=30, IQ1_M=31, BF16=32,
    MXFP4=38, Q6_0=135, IQ1_BN=136, IQ2_BN=137, IQ2_K=138, IQ3_K=139, IQ4_K=140, IQ5_K=141, IQ6_K=142,
    IQ4_KS=145, IQ3_KL=146, IQ2_KS=147, IQ4_KSS=148, Q8_KV=149, IQ5_KS=150, IQ2_KT=151, IQ3_KT=152,
    IQ4_KT=153, IQ3_KS=154, IQ2_KL=155, IQ1_KT=156, Q4_0_R8=202, Q8_0_R8=207, Q5_0_R4=208, Q2_K_R4=210,
    Q3_K_R4=211, Q4_K_R4=214, Q5_K_R4=216, Q6_K_R4=218, IQ2_XXS_R4=219, IQ2_XS_R4=220, IQ3_XXS_R4=223,
    IQ1_S_R4=224, IQ4_NL_R4=225, IQ3_S_R4=226, IQ2_M_R4=229, IQ4_XS_R8=230, IQ1_M_R4=231, BF16_R16=232,
    Q6_0_R4=335, IQ2_BN_R4=337, IQ2_K_R4=338, IQ3_K_R4=339, IQ4_K_R4=340, IQ5_K_R4=341, IQ4_KS_R4=345,
    IQ5_KS_R4=350, Q8_KV_R8=398, Q8_K_R8=399)

# output.weight: the low-bit ftypes (IQ4_K when tied to token_embd, else Q5_K), the ftypes that give
# a tied output IQ5_K, and the types that are kept as they are (else Q6_K)
_OUT_LOW = {L.IQ2_XXS, L.IQ2_XS, L.IQ3_XXS, L.IQ1_S, L.IQ2_S, L.IQ2_M, L.IQ1_M, L.IQ2_K, L.IQ3_K, L.IQ2_KS,
            L.IQ3_K_R4, L.IQ3_KS, L.IQ2_K_R4, L.IQ3_XXS_R4, L.IQ2_KL, L.IQ2_M_R4, L.IQ1_S_R4, L.IQ1_M_R4,
            L.IQ2_KT, L.IQ3_KT, L.IQ1_KT}
_OUT_IQ5K_TIED = {L.IQ3_S, L.IQ3_M, L.IQ3_KL, L.IQ4_XS, L.IQ3_S_R4, L.IQ4_KS, L.IQ4_KSS, L.IQ4_KS_R4}
_OUT_KEEP = {G.Q8_0, G.Q8_0_R8, G.IQ6_K, G.Q6_K_R4, G.Q8_K_R8, G.Q8_KV, G.Q8_KV_R8}
# ftypes with their own attn_v / ffn_down / attn_output branch before the per-tensor-class rules
_IQ2_GROUP = {L.IQ2_XXS, L.IQ2_XS, L.IQ1_S, L.IQ2_S, L.IQ2_M, L.IQ1_M, L.IQ2_KS, L.IQ2_XXS_R4, L.IQ2_XS_R4,
              L.IQ2_M_R4}
# attn_v of models with n_gqa >= 4 (one step up)
_GQA4_BUMP = {G.Q2_K: G.IQ3_S, G.IQ3_XXS: G.IQ3_S, G.Q2_K_R4: G.IQ3_K_R4, G.IQ3_XXS_R4: G.IQ3_K_R4,
              G.Q3_K: G.Q4_K, G.IQ3_S: G.Q4_K, G.IQ3_K: G.IQ4_K, G.IQ3_KS: G.IQ4_KS, G.IQ2_KL: G.IQ4_KS,
              G.IQ3_S_R4: G.Q4_K_R4, G.Q3_K_R4: G.Q4_K_R4, G.Q4_K: G.Q5_K, G.IQ4_XS: G.Q5_K, G.IQ4_NL: G.Q5_K,
              G.IQ4_K: G.IQ5_K, G.IQ4_KS: G.IQ5_K, G.IQ4_NL_R4: G.Q5_K, G.IQ4_XS_R8: G.Q5_K, G.Q5_K: G.Q6_K,
              G.IQ5_K: G.IQ6_K, G.IQ5_KS: G.IQ6_K}
# attn_output: Q5_K for these ftypes in models with >= 4 experts; the dense models' choices
_AO_MOE_Q5K = {L.Q2_K, L.IQ3_XS, L.IQ3_XXS, L.Q3_K_S, L.Q3_K_M, L.IQ4_NL, L.Q4_K_S, L.Q4_K_M, L.IQ3_S, L.IQ3_M,
               L.IQ4_XS, L.IQ4_K, L.IQ4_KSS, L.IQ4_KS, L.IQ4_KS_R4, L.IQ5_KS, L.IQ5_KS_R4, L.IQ2_K, L.IQ3_K,
               L.IQ3_KL, L.Q4_K_R4, L.IQ4_NL_R4, L.IQ4_XS_R8, L.Q3_K_R4, L.IQ3_KT, L.IQ3_KS, L.Q2_K_R4,
               L.IQ4_K_R4, L.IQ3_K_R4, L.IQ2_K_R4, L.IQ3_XXS_R4, L.IQ3_S_R4}
_AO_DENSE = {L.Q2_K: G.Q3_K, L.IQ3_XXS: G.IQ3_S, L.IQ3_XXS_R4: G.IQ3_K_R4, L.Q3_K_M: G.Q4_K, L.Q3_K_L: G.Q5_K,
             L.IQ3_M: G.IQ4_K, L.IQ2_K: G.IQ3_K, L.IQ2_K_R4: G.IQ3_K_R4, L.IQ3_KL: G.IQ4_KS}
_QKV = {L.Q3_K_M: G.Q4_K, L.Q3_K_L: G.Q4_K, L.IQ3_M: G.IQ4_K, L.Q4_K_M: G.Q5_K, L.Q5_K_M: G.Q6_K}
# interleaved_properties: row-interleaved type -> (its plain type, rows per group)
INTERLEAVED: dict[int, tuple[int, int]] = {
    G.Q4_0_R8: (G.Q4_0, 8), G.Q5_0_R4: (G.Q5_0, 4), G.Q6_0_R4: (G.Q6_0, 4), G.Q8_0_R8: (G.Q8_0, 8),
    G.Q2_K_R4: (G.Q2_K, 4), G.Q3_K_R4: (G.Q3_K, 4), G.Q4_K_R4: (G.Q4_K, 4), G.Q5_K_R4: (G.Q5_K, 4),
    G.Q6_K_R4: (G.Q6_K, 4), G.IQ2_XXS_R4: (G.IQ2_XXS, 4), G.IQ2_XS_R4: (G.IQ2_XS, 4), G.IQ2_S_R4: (G.IQ2_S, 4),
    G.IQ3_XXS_R4: (G.IQ3_XXS, 4), G.IQ3_S_R4: (G.IQ3_S, 4), G.IQ4_XS_R8: (G.IQ4_XS, 8),
    G.IQ4_NL_R4: (G.IQ4_NL, 4), G.IQ1_S_R4: (G.IQ1_S, 4), G.IQ1_M_R4: (G.IQ1_M, 4), G.IQ2_BN_R4: (G.IQ2_BN, 4),
    G.IQ2_K_R4: (G.IQ2_K, 4), G.IQ3_K_R4: (G.IQ3_K, 4), G.IQ4_K_R4: (G.IQ4_K, 4), G.IQ4_KS_R4: (G.IQ4_KS, 4),
    G.IQ5_KS_R4: (G.IQ5_KS, 4), G.IQ5_K_R4: (G.IQ5_K, 4), G.MXFP4_R8: (G.MXFP4, 8), G.Q8_KV_R8: (G.Q8_KV, 8),
    G.Q8_K_R8: (G.Q8_0, 8), G.BF16_R16: (G.BF16, 16)}


class PlanError(ValueError):
    """A bad type name, rule or plan; str() is one line."""


def type_names() -> str:
    return ", ".join(n for n, _ in _GGML)


def ftype_names() -> str:
    return ", ".join(n for n, _, _ in FTYPES)


@dataclass(frozen=True)
class FType:
    name: str       # e.g. "Q8_0"
    ftype: int      # llama_ftype (general.file_type)
    base: int       # default ggml type id (-1: none we know)

    @property
    def rules_implemented(self) -> bool:
        """Whether ik's per-tensor mixture for this ftype is implemented (all are)."""
        return self.base >= 0


def parse_ftype(s: str) -> FType:
    """llama-quantize's try_parse_ftype: a name (any case) or a llama_ftype number."""
    key = s.strip().upper()
    hit = next((f for f in FTYPES if f[0] == key), None)
    if hit is None and re.fullmatch(r"[+-]?\d+", key):
        hit = next((f for f in FTYPES if f[1] == int(key) and f[0] != "COPY"), None)
    if hit is None:
        raise PlanError(f"invalid ftype '{s}'; valid types: {ftype_names()}")
    name, ft, base = hit
    return FType(name, ft, TYPE_ID[base.lower()] if base else -1)


def parse_type(s: str) -> int:
    """A ggml type name as ggml_type_name() spells it (any case)."""
    t = TYPE_ID.get(s.strip().lower())
    if t is None:
        raise PlanError(f"invalid type '{s}'; valid types: {type_names()}")
    return t


@dataclass(frozen=True)
class CustomRule:
    pattern: str
    regex: re.Pattern
    qtype: int


def parse_custom_rules(text: str, comments: bool = False) -> list[CustomRule]:
    """`regex=type,regex=type,…`; newlines separate rules too; with comments, `#` starts one (files)."""
    rules: list[CustomRule] = []
    for line in text.splitlines():
        if comments and "#" in line:
            line = line[:line.index("#")]
        for item in line.split(","):
            item = item.strip()
            if not item:
                continue
            pattern, eq, tname = item.rpartition("=")
            if not eq or not pattern:
                raise PlanError(f"invalid custom quantization rule '{item}': expected regex=type")
            t = TYPE_ID.get(tname.strip().lower())
            if t is None:
                raise PlanError(f"invalid quantization type '{tname}' in custom rule '{item}'; valid types: {type_names()}")
            try:
                rx = re.compile(pattern.strip())
            except re.error as e:
                raise PlanError(f"invalid regex in custom rule '{item}': {e}") from None
            rules.append(CustomRule(pattern.strip(), rx, t))
    return rules


@dataclass
class TensorPlan:
    name: str
    ne: tuple            # GGML order
    src_type: int
    new_type: int
    quantize: bool       # False: copied as is (or repacked, below)
    notes: list[str] = field(default_factory=list)   # log lines (custom type, fallback …)
    repack: bool = False  # --repack: the same blocks rewritten in new_type's _R4/_R8 layout


@dataclass
class ModelInfo:
    arch: str = ""
    n_layer: int = 0
    n_expert: int = 0
    n_head: int = 0          # of layer 0 (ik's n_head(0))
    n_head_kv: int = -1      # of layer 0; -1: as n_head (no key)
    n_vocab: int = 0
    n_embd: int = 0

    @property
    def n_gqa(self) -> int:
        kv = self.n_head if self.n_head_kv < 0 else self.n_head_kv
        return self.n_head // kv if kv > 0 else 0

    @property
    def model_type(self) -> str:
        """ik's model.type where it is 8B or 70B (the only sizes the rules look at), else ''."""
        a, n = self.arch, self.n_layer
        if a == "llama" and self.n_expert != 8:
            if n == 32:
                return "3B" if self.n_vocab == 49152 else "7B" if self.n_vocab < 40000 else "8B"
            if n == 36:
                return "8B"
            if n == 80:
                return "65B" if self.n_head == (self.n_head if self.n_head_kv < 0 else self.n_head_kv) else "70B"
        elif a in ("deci", "qwen2", "qwen2vl", "olmo") and n == 80:
            return "70B"
        elif a in ("qwen3", "qwen3vl") and n == 36:
            return "4B" if self.n_embd == 2560 else "8B"
        elif (a, n) in (("cohere2", 32), ("mistral3", 34)):
            return "8B"
        return ""

    @classmethod
    def from_meta(cls, meta: dict) -> "ModelInfo":
        """The hparams llama_tensor_get_type reads, from GGUF metadata (ik's llm_load_hparams keys)."""
        arch = str(meta.get("general.architecture", ""))

        def first(key: str, default: int) -> int:
            v = meta.get(f"{arch}.{key}", default)
            if isinstance(v, (list, tuple)):          # per-layer arrays: layer 0
                v = v[0] if len(v) else default
            try:
                return int(v)
            except (TypeError, ValueError):
                return default
        n_vocab = first("vocab_size", -1)
        if n_vocab < 0:
            toks = meta.get("tokenizer.ggml.tokens")
            n_vocab = len(toks) if isinstance(toks, (list, tuple)) else 0
        return cls(arch=arch, n_layer=first("block_count", 0), n_expert=first("expert_count", 0),
                   n_head=first("attention.head_count", 0), n_head_kv=first("attention.head_count_kv", -1),
                   n_vocab=n_vocab, n_embd=first("embedding_length", 0))


def _n_dims(ne: tuple) -> int:
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def is_quantized_type(t: int) -> bool:
    return t not in _UNQUANTIZED


def _should_quantize(name: str, ne: tuple, src: int, leave_output: bool, ffn_gate_inp_type: int | None = None) -> bool:
    if src in _INT_TYPES or not name.endswith("weight") or _n_dims(ne) < 2:
        return False
    if "_norm.weight" in name or (leave_output and name == "output.weight"):
        return False
    if "ffn_gate_inp.weight" in name and ffn_gate_inp_type in (None, src):   # the routers: only on request
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(s in name for s in ("ssm_conv1d", "ssm_x.weight", "ssm_dt.weight", "attn_rel_b.weight"))


def _change_type_if_necessary(t: int, nx: int, ny: int, notes: list[str], block_size) -> int:
    if t in _FALLBACK_IDS and nx % QK_K:
        nt = _FALLBACK_IDS[t]
        notes.append(f"change_type_if_necessary : tensor cols {nx} x {ny} are not divisible by {QK_K}, "
                     f"required for {TYPE_NAME[t]} - using fallback quantization {TYPE_NAME[nt]}")
        t = nt
    bs = block_size(t)
    if bs and nx % bs:
        notes.append(f"change_type_if_necessary : tensor cols {nx} x {ny} are not divisible by {bs}, "
                     f"required for {TYPE_NAME[t]} - using fallback quantization f16")
        t = F16
    return t


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    """ik's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _layer_info(counter: int, n_layer: int, n_expert: int, name: str) -> tuple[int, int]:
    """ik's layer_info: the counter for dense models; with experts the layer from the name (experts'
    tensors need not come in layer order)."""
    if n_expert > 1:
        m = re.match(r"blk\.\s*([+-]?\d+)", name)
        if m is None:
            raise PlanError(f"Failed to determine layer for tensor {name}")
        counter = int(m.group(1))
        if counter < 0 or counter >= n_layer:
            raise PlanError(f"Bad layer {counter} for tensor {name}. Must be in [0, {n_layer})")
    return counter, n_layer


def _output_type(new_type: int, nx: int, F: int, mi: ModelInfo, has_output: bool) -> int:
    """output.weight (token_embd.weight when tied) without --output-tensor-type."""
    if mi.arch == "falcon" or nx % QK_K:
        return G.Q8_0
    if F in _OUT_LOW:
        return G.IQ4_K if not has_output else G.Q5_K
    if F in (L.IQ2_XXS_R4, L.IQ2_XS_R4):
        return G.IQ4_K_R4 if not has_output else G.Q5_K_R4
    if F in _OUT_IQ5K_TIED and not has_output:
        return G.IQ5_K
    if new_type not in _OUT_KEEP:
        return G.Q6_K
    return new_type


def _token_embd_type(new_type: int, F: int) -> int:
    """token_embd.weight (untied) without --token-embedding-type."""
    if F in (L.IQ2_XXS, L.IQ2_XS, L.IQ1_S, L.IQ1_M, L.IQ2_XXS_R4, L.IQ2_XS_R4, L.IQ1_S_R4, L.IQ1_M_R4):
        return G.Q2_K
    if F in (L.IQ2_S, L.IQ2_M, L.IQ2_M_R4, L.IQ3_XXS, L.IQ3_KT):
        return G.IQ3_S
    if F == L.IQ3_XXS_R4:
        return G.IQ3_K
    if F in (L.IQ1_BN, L.IQ2_BN, L.IQ2_BN_R4):
        return G.IQ4_NL
    return new_type


def _iq1_r4_or_iq2_kt(new_type: int, name: str, F: int, mi: ModelInfo, st: dict, ov: dict) -> int:
    """The IQ1_S_R4 / IQ1_M_R4 and IQ2_KT mixtures (same shape, different types)."""
    r4 = F != L.IQ2_KT
    hi, mid, lo = (G.IQ4_K_R4, G.IQ3_K_R4, G.Q2_K_R4) if r4 else (G.IQ4_K, G.IQ3_K, G.Q2_K)
    q4k = G.Q4_K_R4 if r4 else G.Q4_K
    nx, gqa = mi.n_expert, mi.n_gqa
    if "attn_v.weight" in name:
        new_type = hi if nx >= 4 or gqa >= 4 else mid if gqa >= 2 else lo
        st["i_attention_wv"] += 1
    elif nx >= 8 and "attn_k" in name:
        new_type = q4k
    elif nx >= 8 and any(f"blk.0.ffn_{w}" in name for w in ("down", "gate", "up")):
        new_type = mid
    elif nx >= 8 and "attn_q" in name:
        new_type = q4k
    elif "attn_qkv.weight" in name:
        new_type = G.IQ2_K_R4 if r4 else G.IQ3_K
    elif "_shexp.weight" in name:
        new_type = hi
    elif "ffn_down" in name:
        i, n = _layer_info(st["i_ffn_down"], mi.n_layer, max(1, nx), name)
        if "ffn_down" in ov:
            new_type = ov["ffn_down"]
        elif i < n // 8:
            new_type = lo if r4 else G.IQ3_K
        st["i_ffn_down"] += 1
    elif "attn_output.weight" in name:
        new_type = (G.Q5_K_R4 if r4 else G.Q5_K) if nx >= 4 else (G.IQ2_K_R4 if r4 else G.IQ3_K)
    return new_type


def _iq2_group(new_type: int, name: str, F: int, mi: ModelInfo, st: dict, ov: dict) -> int:
    """The IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S / IQ2_M / IQ2_KS mixtures (+ their _R4); of the
    class types ik looks only at attn_output's here."""
    more = F in (L.IQ2_S, L.IQ2_M, L.IQ2_M_R4)      # IQ2_S and IQ2_M get IQ3_S where the others get Q2_K
    nx, gqa = mi.n_expert, mi.n_gqa
    if "attn_v.weight" in name:
        new_type = (G.IQ4_K if gqa >= 4 or nx >= 4 else G.IQ3_K if gqa >= 2 or nx >= 2
                    else G.IQ3_S if more else G.Q2_K)
        st["i_attention_wv"] += 1
    elif nx >= 8 and ("attn_k" in name or "attn_q" in name):
        new_type = G.Q4_K
    elif "attn_qkv.weight" in name:
        new_type = G.IQ3_XXS if more else G.IQ2_K
    elif "ffn_down" in name:
        # the plain counter here, also for experts (ik does not use layer_info in this group)
        if st["i_ffn_down"] < mi.n_layer // 8:
            new_type = G.IQ3_S if more else G.Q2_K
        st["i_ffn_down"] += 1
    elif "attn_output.weight" in name:
        if "attn_output" in ov:
            new_type = ov["attn_output"]
        elif nx >= 4:
            new_type = G.Q5_K
        elif F in (L.IQ1_S, L.IQ1_M):
            new_type = G.IQ2_K
        elif more:
            new_type = G.IQ3_S
    return new_type


def _attn_v_type(new_type: int, F: int, mi: ModelInfo, st: dict, has_imatrix: bool, ov: dict) -> int:
    gqa, big = mi.n_gqa, mi.model_type in ("8B", "70B") and mi.n_vocab >= 127999
    i = st["i_attention_wv"]
    if "attn_v" in ov:
        new_type = ov["attn_v"]                # the counter still advances
    elif mi.n_expert >= 4:
        new_type = G.Q8_0
    elif mi.model_type == "70B":
        # 8 heads share attn_v: more bits cost little
        if new_type in (G.Q3_K, G.Q4_K):
            new_type = G.Q5_K
        if new_type == G.IQ3_K:
            new_type = G.IQ5_K
    elif F == L.Q2_K:
        new_type = G.Q4_K if gqa >= 4 else G.Q3_K
    elif F == L.IQ2_K:
        new_type = G.IQ4_K if gqa >= 2 else G.IQ3_K
    elif F == L.IQ2_K_R4:
        new_type = G.IQ4_K_R4 if gqa >= 2 else G.IQ3_K_R4
    elif F == L.Q2_K_S and gqa >= 4:
        new_type = G.Q4_K
    elif F == L.Q2_K_R4 and gqa >= 4:
        new_type = G.Q4_K_R4
    elif F == L.IQ3_XXS:
        new_type = G.Q4_K if gqa >= 4 else G.IQ3_K if gqa >= 2 else G.IQ3_XXS if has_imatrix else G.IQ3_S
    elif F == L.IQ3_KT:
        new_type = G.IQ4_K if gqa >= 4 else G.IQ3_K
    elif F == L.IQ4_KT:
        new_type = G.IQ5_K if gqa >= 4 else G.IQ4_K
    elif F == L.IQ3_XXS_R4:
        new_type = G.Q4_K_R4 if gqa >= 4 else G.IQ3_K_R4 if gqa >= 2 or not has_imatrix else G.IQ3_XXS_R4
    elif F in (L.IQ3_XS, L.IQ3_S, L.IQ3_K) and gqa >= 2:
        new_type = G.IQ4_K
    elif F in (L.IQ3_S_R4, L.IQ3_K_R4) and gqa >= 2:
        new_type = G.IQ4_K_R4
    elif F in (L.IQ3_KS, L.IQ2_KL) and gqa >= 2:
        new_type = G.IQ4_KS
    elif F in (L.IQ3_KL, L.IQ3_M):
        new_type = G.IQ5_K if gqa >= 2 else G.IQ4_K
    elif F == L.Q3_K_M:
        new_type = G.Q5_K if i < 2 else G.Q4_K
    elif F == L.Q3_K_L:
        new_type = G.Q5_K
    elif F in (L.IQ4_NL, L.IQ4_XS, L.IQ4_NL_R4, L.IQ4_XS_R8, L.IQ4_KS, L.IQ4_KSS, L.IQ4_K, L.IQ4_K_R4) and gqa >= 2:
        new_type = G.IQ5_K
    elif F == L.IQ4_KS_R4 and gqa >= 2:
        new_type = G.IQ5_K_R4
    elif F in (L.Q4_K_M, L.Q5_K_M) and _use_more_bits(i, st["n_attention_wv"]):
        new_type = G.Q6_K
    elif F in (L.Q4_K_S, L.Q4_K_R4) and i < 4:
        new_type = G.Q5_K
    elif F == L.Q5_K_S:
        if big:
            new_type = G.Q6_K
    elif F in (L.IQ5_K, L.IQ5_KS):
        if big:
            new_type = G.IQ6_K
    elif gqa >= 4 and not (mi.arch == "dflash-draft" and F in (L.Q4_K_M, L.Q5_K_M)):
        new_type = _GQA4_BUMP.get(new_type, new_type)
    st["i_attention_wv"] += 1
    return new_type


def _ffn_down_type(new_type: int, name: str, F: int, mi: ModelInfo, st: dict, has_imatrix: bool, ov: dict) -> int:
    i, n = _layer_info(st["i_ffn_down"], mi.n_layer, max(1, mi.n_expert), name)   # checked also with ov
    falcon, first = mi.arch == "falcon", i < n // 8
    if "ffn_down" in ov:
        new_type = ov["ffn_down"]
    elif F == L.Q2_K:
        new_type = G.Q3_K
    elif F == L.Q2_K_S:
        if first:
            new_type = G.Q4_K
    elif F == L.Q2_K_R4:
        if first:
            new_type = G.Q4_K_R4
    elif F == L.IQ3_XXS and not has_imatrix:
        new_type = G.Q4_K if first else G.Q3_K
    elif F == L.IQ3_KT and not has_imatrix:
        new_type = G.IQ4_K if first else G.IQ3_K
    elif F == L.IQ3_XXS_R4 and not has_imatrix:
        new_type = G.Q4_K_R4 if first else G.IQ3_K_R4
    elif F == L.Q3_K_M:
        new_type = (G.Q5_K if i < n // 16 else G.Q4_K if not falcon or _use_more_bits(i, n) else G.Q3_K)
    elif F == L.IQ3_M and (first or (mi.n_expert >= 4 and _use_more_bits(i, n))):
        new_type = G.IQ4_K
    elif F == L.Q3_K_L:
        new_type = G.Q4_K if falcon else G.Q5_K
    elif F == L.IQ3_KL:
        new_type = G.IQ4_KS if _use_more_bits(i, n) else G.IQ3_K
    elif F == L.Q4_K_M:
        if falcon:
            new_type = G.Q6_K if i < n // 16 else G.Q5_K if _use_more_bits(i, n) else G.Q4_K
        elif _use_more_bits(i, n):
            new_type = G.Q6_K
    elif first and not has_imatrix and F in (L.IQ4_NL, L.IQ4_XS, L.IQ4_KS, L.IQ4_KSS, L.IQ4_NL_R4, L.IQ4_XS_R8):
        new_type = G.Q5_K
    elif F == L.IQ4_KS_R4 and first and not has_imatrix:
        new_type = G.Q5_K_R4
    elif F == L.Q5_K_M and _use_more_bits(i, n):
        new_type = G.Q6_K
    elif F in (L.Q4_K_S, L.Q4_K_R4) and not falcon and first:
        new_type = G.Q5_K
    elif F in (L.Q4_0, L.Q5_0) and has_imatrix and first:
        # ik guards the first ffn_down layers of Q4_0 / Q5_0, only with an imatrix (Q4_1/Q5_1 need one)
        new_type = G.Q4_1 if F == L.Q4_0 else G.Q5_1
    elif F == L.Q4_0_R8 and has_imatrix and first:
        new_type = G.IQ4_NL_R4
    st["i_ffn_down"] += 1
    return new_type


def _attn_output_type(new_type: int, F: int, mi: ModelInfo, ov: dict) -> int:
    if "attn_output" in ov:
        return ov["attn_output"]
    if mi.arch == "falcon":
        return G.Q4_K if F == L.Q3_K_L else new_type
    if mi.n_expert >= 4:
        if F in _AO_MOE_Q5K:
            return G.Q5_K
        return G.IQ4_KS if F == L.IQ2_KL else new_type
    if F == L.IQ3_KT:
        return G.IQ3_K if mi.n_gqa >= 4 else new_type
    return _AO_DENSE.get(F, new_type)


def _gate_up_type(new_type: int, name: str, key: str, F: int, mi: ModelInfo, st: dict, ov: dict) -> int:
    """ffn_gate / ffn_up (key: the state counter, "i_" + the class_types key)."""
    i, n = _layer_info(st[key], mi.n_layer, max(1, mi.n_expert), name)
    if key[2:] in ov:
        new_type = ov[key[2:]]
    elif F == L.IQ3_XS and n // 8 <= i < 7 * n // 8:
        new_type = G.IQ3_XXS
    elif F == L.IQ3_KL and _use_more_bits(i, n):
        new_type = G.IQ4_KS
    st[key] += 1
    return new_type


def _get_type(new_type: int, name: str, ne: tuple, ft: FType, mi: ModelInfo, has_output: bool,
              output_type: int | None, rules: list[CustomRule], notes: list[str],
              has_imatrix: bool = False, state: dict | None = None, token_embd_type: int | None = None,
              class_types: dict | None = None) -> int:
    """llama_tensor_get_type: the type of one tensor for ftype `ft` (all of ik's mixtures).

    state: ik's quantize_state_internal counters, kept across the tensors of one model in file order
    (plan_tensors sets n_attention_wv); has_imatrix: an importance matrix was given at all;
    class_types: the --attn-q-type … --ffn-up-type types by CLASS_TYPE_KEYS key."""
    ov = class_types or {}
    st = state if state is not None else {}
    for k in ("i_attention_wv", "i_ffn_down", "i_ffn_gate", "i_ffn_up", "n_attention_wv"):
        st.setdefault(k, 0)
    F = ft.ftype
    custom = next((r.qtype for r in rules if r.regex.search(name)), None)
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        new_type = output_type if output_type is not None else _output_type(new_type, ne[0], F, mi, has_output)
    elif name in ("token_embd.weight", "per_layer_token_embd.weight"):
        if token_embd_type is not None and name == "token_embd.weight":
            new_type = token_embd_type
        else:
            new_type = _token_embd_type(new_type, F)
    elif F in (L.IQ1_S_R4, L.IQ1_M_R4, L.IQ2_KT):
        new_type = _iq1_r4_or_iq2_kt(new_type, name, F, mi, st, ov)
    elif F in _IQ2_GROUP:
        new_type = _iq2_group(new_type, name, F, mi, st, ov)
    elif "attn_v.weight" in name:
        new_type = _attn_v_type(new_type, F, mi, st, has_imatrix, ov)
    elif "attn_k" in name:                     # also attn_kv_a_mqa, attn_kv_b, attn_k_b
        if "attn_k" in ov:
            new_type = ov["attn_k"]
        elif mi.n_expert >= 4:
            new_type = G.Q8_0                  # cheap for MoE models
        elif F == L.IQ3_XS:
            new_type = G.IQ3_XXS
        elif F in (L.IQ3_XXS, L.IQ3_XXS_R4):
            new_type = G.IQ2_S
    elif "attn_q" in name:                     # also attn_q_a, attn_q_b and (shadowing ik's own branch) attn_qkv
        big = mi.model_type in ("8B", "70B") and mi.n_vocab >= 127999
        if "attn_q" in ov:
            new_type = ov["attn_q"]
        elif F == L.IQ3_XS:
            new_type = G.IQ3_XXS
        elif F in (L.IQ3_XXS, L.IQ3_XXS_R4):
            new_type = G.IQ2_S
        elif F == L.Q5_K_S:
            new_type = G.Q4_K if big else new_type
        elif F == L.IQ5_K:
            new_type = G.IQ4_K if big else new_type
        elif F == L.IQ5_KS:
            new_type = G.IQ4_KS if big else new_type
    elif "ffn_down" in name:                   # also ffn_down_exps, ffn_down_shexp
        new_type = _ffn_down_type(new_type, name, F, mi, st, has_imatrix, ov)
    elif "attn_output.weight" in name:
        new_type = _attn_output_type(new_type, F, mi, ov)
    elif "attn_qkv.weight" in name:            # unreachable in ik too ("attn_q" matches first); kept as ik has it
        new_type = ov.get("attn_qkv", _QKV.get(F, new_type))
    elif "ffn_gate" in name:                   # also ffn_gate_inp (quantized only with --ffn-gate-inp-type)
        new_type = _gate_up_type(new_type, name, "i_ffn_gate", F, mi, st, ov)
    elif "ffn_up" in name:
        new_type = _gate_up_type(new_type, name, "i_ffn_up", F, mi, st, ov)
    if custom is not None:
        new_type = custom
        notes.append(f"Using custom type {TYPE_NAME[new_type]} for tensor {name}")
    return new_type


def _not_interleaved(t: int, notes: list[str]) -> int:
    """Token embeddings are looked up by row: never a row-interleaved type."""
    if t in INTERLEAVED:
        notes.append(f"Token embeddings cannot be quantized with row-interleaved quants: changed {TYPE_NAME[t]} "
                     f"to {TYPE_NAME[INTERLEAVED[t][0]]}")
        return INTERLEAVED[t][0]
    return t


def plan_tensors(tensors: list[tuple[str, tuple, int]], ft: FType, mi: ModelInfo, *, pure: bool = False,
                 leave_output: bool = False, output_type: int | None = None, token_embd_type: int | None = None,
                 rules: list[CustomRule] | None = None, block_size=None,
                 has_imatrix: bool = False, class_types: dict | None = None,
                 ffn_gate_inp_type: int | None = None) -> tuple[list[TensorPlan], int]:
    """The per-tensor types of llama_model_quantize_internal; returns (plans, number of fallbacks).

    tensors: (name, ne in GGML order, source type id) in file order.  block_size(type id) -> int or
    None gives the block size of a type (None: unknown, no check).  has_imatrix: an importance
    matrix is given (ik's rules differ for a few types).  class_types: --attn-q-type … --ffn-up-type
    by CLASS_TYPE_KEYS key (type ids); ffn_gate_inp_type: --ffn-gate-inp-type.
    """
    unknown = set(class_types or {}) - set(CLASS_TYPE_KEYS)
    if unknown:
        raise PlanError(f"unknown tensor class {sorted(unknown)[0]!r}; known: {', '.join(CLASS_TYPE_KEYS)}")
    rules = rules or []
    block_size = block_size or (lambda t: None)
    has_output = any(n == "output.weight" for n, _, _ in tensors)
    plans: list[TensorPlan] = []
    n_fallback = 0
    # ik counts attn_v / attn_qkv over all tensors before the loop (use_more_bits of Q4_K_M/Q5_K_M)
    state: dict = {"n_attention_wv": sum("attn_v.weight" in n or "attn_qkv.weight" in n for n, _, _ in tensors)}
    for name, ne, src in tensors:
        notes: list[str] = []
        q = ft.base >= 0 and ft.name != "COPY" and _should_quantize(name, ne, src, leave_output, ffn_gate_inp_type)
        new_type = src
        if q:
            new_type = ft.base
            ny = ne[1] if len(ne) > 1 else 1
            if pure:
                new_type = _change_type_if_necessary(new_type, ne[0], ny, notes, block_size)
            elif is_quantized_type(ft.base):
                new_type = _get_type(new_type, name, ne, ft, mi, has_output, output_type, rules, notes,
                                     has_imatrix, state, token_embd_type, class_types)
                new_type = _change_type_if_necessary(new_type, ne[0], ny, notes, block_size)
                if name in ("token_embd.weight", "per_layer_token_embd.weight"):
                    new_type = _not_interleaved(new_type, notes)
            if token_embd_type is not None and name == "token_embd.weight":
                new_type = token_embd_type
            if output_type is not None and name == "output.weight":
                new_type = output_type
            if ffn_gate_inp_type is not None and "ffn_gate_inp.weight" in name:
                new_type = ffn_gate_inp_type          # after the rules and their fallback: not re-checked
                bs = block_size(new_type)
                if bs and ne[0] % bs:
                    raise PlanError(f"--ffn-gate-inp-type {TYPE_NAME[new_type]}: tensor {name} has rows of "
                                    f"{ne[0]}, not a multiple of its block size {bs}")
            if name == "token_embd.weight":
                new_type = _not_interleaved(new_type, notes)
            if any(n.startswith("change_type") for n in notes):
                n_fallback += 1
            q = new_type != src
            # row-interleaved types need whole groups of rows, else the plain type (decided after the
            # "same type: copy" test, as in ik)
            if q and new_type in INTERLEAVED and ny % INTERLEAVED[new_type][1]:
                new_type = INTERLEAVED[new_type][0]
        plans.append(TensorPlan(name, tuple(ne), src, new_type if q else src, q, notes))
    return plans, n_fallback


# ik_llama.cpp never repacks the token embedding (its rows are looked up, not multiplied)
NO_REPACK = ("token_embd.weight", "per_layer_token_embd.weight")


def plan_repack(tensors: list[tuple[str, tuple, int]], patterns: list[str]) -> list[TensorPlan]:
    """llama-quantize --repack: every tensor with an _R4/_R8 form whose row count is a multiple
    of its group (and, with patterns, whose name one of the regexes finds) is rewritten in that
    form without re-quantizing; the others are copied."""
    from quant.simd import cpu_features
    from quant.types import BF16, interleaved_form
    # ik repacks BF16 into BF16_R16 only when built with AVX512-BF16 (-march=native on such a CPU)
    bf16_r16 = "+avx512bf16" in cpu_features()
    try:
        rx = [re.compile(p) for p in patterns]
    except re.error as e:
        raise PlanError(f"invalid regex in --repack-pattern: {e}") from None
    plans = []
    for name, ne, src in tensors:
        rows = math.prod(ne[1:]) if len(ne) > 1 else 1
        ti = interleaved_form(src) if src in TYPE_NAME and _n_dims(ne) >= 2 and (src != BF16 or bf16_r16) else None
        ok = (ti is not None and name not in NO_REPACK and ne[1] % ti.interleave == 0 and rows
              and (not rx or any(r.search(name) for r in rx)))
        plans.append(TensorPlan(name, ne, src, ti.id if ok else src, False, repack=bool(ok)))
    return plans


def repacked_ftype(ftype: int) -> FType | None:
    """The ftype of a repacked model (ik's repacked_ftype): X -> X_R4 / X_R8 where that exists."""
    hit = next((f for f in FTYPES if f[1] == ftype and f[0] != "COPY"), None)
    if hit is None:
        return None
    for suffix in ("_R4", "_R8"):
        try:
            return parse_ftype(hit[0] + suffix)
        except PlanError:
            pass
    return parse_ftype(hit[0])


def format_shape(ne: tuple) -> str:
    """llama_format_tensor_shape: four dims, %5d each."""
    dims = list(ne) + [1] * (4 - len(ne))
    return ", ".join(f"{d:5d}" for d in dims)
