"""Which type each tensor gets when a model is quantized: ik_llama.cpp's llama-quantize rules.

Plain values in, a plan out (no flags, no I/O).  Follows src/llama-quantize.cpp of ik_llama.cpp:

* which tensors are quantized at all (2-D+ tensors whose name ends in "weight", except norms,
  ffn_gate_inp, position/token-type embeddings, ssm_conv1d/ssm_x/ssm_dt, attn_rel_b; output.weight
  unless leave_output);
* llama_tensor_get_type, as far as it concerns the legacy base types (Q4_0 … Q8_0, Q6_0):
  output.weight (or token_embd.weight when the model has no output.weight) → Q8_0 when its rows
  are not a multiple of 256 (or arch falcon), else Q6_K unless the base is Q8_0; attn_v / attn_k*
  → Q8_0 for models with >= 4 experts; --custom-q rules (first match wins) override these;
* change_type_if_necessary: 256-block types on rows that are not a multiple of 256 fall back
  (→ IQ4_NL / Q5_0 / Q6_0 / Q8_0 as in ik);
* the pure / token-embedding-type / output-tensor-type overrides of the main loop.

Not implemented (documented gaps): the per-ftype mixtures of the k-quant / IQ ftypes (Q4_K_M,
IQ3_M, IQ2_KS …: only the generic rules above are applied and a warning says so), the 70B
attn_v rule, the imatrix-dependent rules (imatrix is not supported yet), the per-tensor-class
flags (--attn-q-type …) and interleaved (_R4/_R8) row-count fallbacks.  Our own addition: a
tensor whose rows still do not fit the block size after ik's fallback gets F16 (mainline's rule)
instead of ik's "Unsupported tensor size" error.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    ("iq5_ks_r4", 352), ("q8_KV_r8", 398), ("q8_k_r8", 399),
]
TYPE_ID: dict[str, int] = {n.lower(): i for n, i in _GGML}
TYPE_NAME: dict[int, str] = {i: n for n, i in _GGML}
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_K, Q6_0, BF16, IQ4_NL = 0, 1, 2, 3, 6, 7, 8, 14, 133, 30, 20
_INT_TYPES = {24, 25, 26, 27}
_UNQUANTIZED = {F32, F16, BF16, 28, 230} | _INT_TYPES

# examples/quantize/quantize.cpp QUANT_OPTIONS: name, llama_ftype, base ggml type (name)
FTYPES: list[tuple[str, int, str]] = [
    ("Q4_0", 2, "q4_0"), ("Q4_1", 3, "q4_1"), ("Q5_0", 8, "q5_0"), ("Q5_1", 9, "q5_1"), ("Q6_0", 135, "q6_0"),
    ("MXFP4", 38, "mxfp4"), ("MXFP4_R8", -1, ""),
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
# ftypes whose base type is one of these have all of ik's per-tensor rules implemented here
_RULES_DONE = {"q4_0", "q4_1", "q5_0", "q5_1", "q6_0", "q8_0", "f16", "bf16", "f32"}

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
        return self.base >= 0 and TYPE_NAME[self.base].lower() in _RULES_DONE


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
    quantize: bool       # False: copied as is
    notes: list[str] = field(default_factory=list)   # log lines (custom type, fallback …)


@dataclass
class ModelInfo:
    arch: str = ""
    n_layer: int = 0
    n_expert: int = 0


def _n_dims(ne: tuple) -> int:
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def is_quantized_type(t: int) -> bool:
    return t not in _UNQUANTIZED


def _should_quantize(name: str, ne: tuple, src: int, leave_output: bool) -> bool:
    if src in _INT_TYPES or not name.endswith("weight") or _n_dims(ne) < 2:
        return False
    if "_norm.weight" in name or (leave_output and name == "output.weight"):
        return False
    if "ffn_gate_inp.weight" in name:       # ik: only with --ffn-gate-inp-type (not supported here)
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


def _get_type(new_type: int, name: str, ne: tuple, ft: FType, mi: ModelInfo, has_output: bool,
              output_type: int | None, rules: list[CustomRule], notes: list[str]) -> int:
    """llama_tensor_get_type for the rules that concern the base types implemented here."""
    custom = next((r.qtype for r in rules if r.regex.search(name)), None)
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        if output_type is not None:
            new_type = output_type
        elif mi.arch == "falcon" or ne[0] % QK_K:
            new_type = Q8_0
        elif new_type not in (Q8_0, 208, 141, 214, 399, 151, 398):
            new_type = Q6_K
    elif name == "token_embd.weight":
        pass                                  # ftype-specific choices only for IQ1/IQ2/IQ3_XXS/BN ftypes
    elif "attn_v.weight" in name:
        if mi.n_expert >= 4:
            new_type = Q8_0
    elif "attn_k" in name:
        if mi.n_expert >= 4:
            new_type = Q8_0
    if custom is not None:
        new_type = custom
        notes.append(f"Using custom type {TYPE_NAME[new_type]} for tensor {name}")
    return new_type


def plan_tensors(tensors: list[tuple[str, tuple, int]], ft: FType, mi: ModelInfo, *, pure: bool = False,
                 leave_output: bool = False, output_type: int | None = None, token_embd_type: int | None = None,
                 rules: list[CustomRule] | None = None, block_size=None) -> tuple[list[TensorPlan], int]:
    """The per-tensor types of llama_model_quantize_internal; returns (plans, number of fallbacks).

    tensors: (name, ne in GGML order, source type id) in file order.  block_size(type id) -> int or
    None gives the block size of a type (None: unknown, no check).
    """
    rules = rules or []
    block_size = block_size or (lambda t: None)
    has_output = any(n == "output.weight" for n, _, _ in tensors)
    plans: list[TensorPlan] = []
    n_fallback = 0
    for name, ne, src in tensors:
        notes: list[str] = []
        q = ft.base >= 0 and ft.name != "COPY" and _should_quantize(name, ne, src, leave_output)
        new_type = src
        if q:
            new_type = ft.base
            ny = ne[1] if len(ne) > 1 else 1
            if pure:
                new_type = _change_type_if_necessary(new_type, ne[0], ny, notes, block_size)
            elif is_quantized_type(ft.base):
                new_type = _get_type(new_type, name, ne, ft, mi, has_output, output_type, rules, notes)
                new_type = _change_type_if_necessary(new_type, ne[0], ny, notes, block_size)
            if token_embd_type is not None and name == "token_embd.weight":
                new_type = token_embd_type
            if output_type is not None and name == "output.weight":
                new_type = output_type
            if any(n.startswith("change_type") for n in notes):
                n_fallback += 1
            q = new_type != src
        plans.append(TensorPlan(name, tuple(ne), src, new_type if q else src, q, notes))
    return plans, n_fallback


def format_shape(ne: tuple) -> str:
    """llama_format_tensor_shape: four dims, %5d each."""
    dims = list(ne) + [1] * (4 - len(ne))
    return ", ".join(f"{d:5d}" for d in dims)
