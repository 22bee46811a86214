"""Model hyper-parameters read from GGUF metadata (the `{arch}.*` keys), with llama.cpp's defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .gguf_file import ModelFileError, ModelFile

SUPPORTED_ARCHS = ("llama", "deepseek2", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "glm4moe", "gemma3", "gpt-oss",
                   "llama4")
NEOX_ROPE_ARCHS = ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "glm4moe", "gemma3", "gpt-oss")     # rotate (i, i + n_rot/2) pairs, as llama_rope_type says

# expert_gating_func values in GGUF
GATING_SOFTMAX = 1
GATING_SIGMOID = 2
GATING_SOFTMAX_WEIGHT = 3    # gpt-oss: top-k of the raw logits, softmax over the chosen ones


@dataclass
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    rms_eps: float
    # RoPE
    n_rot: int
    rope_freq_base: float
    rope_freq_scale: float          # 1/factor
    rope_scaling: str               # none | linear | yarn
    n_ctx_orig_yarn: int
    yarn_ext_factor: float
    yarn_attn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    rope_yarn_log_mul: float
    rope_neox: bool
    # DeepSeek-2 (MLA + MoE)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_expert_shared: int = 0
    n_ff_exp: int = 0
    n_layer_dense_lead: int = 0
    expert_weights_scale: float = 1.0
    expert_weights_norm: bool = False
    expert_gating_func: int = GATING_SOFTMAX
    yarn_ext_factor_file: float = -1.0   # the GGUF's own values (ext factor negative: absent), for --rope-scaling
    rope_freq_scale_file: float = 1.0
    n_nextn: int = 0                     # NextN / MTP layers at the end (glm4moe): loaded by nobody
    n_swa: int = 0                       # sliding window of the local layers (gemma3)
    n_moe_layer_step: int = 0            # llama4: layer il is a MoE layer iff (il + 1) % step == 0

    @property
    def n_embd_head_qk_nope(self) -> int:
        return self.n_embd_head_k - self.n_rot


def _need(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise ModelFileError(f"{path}: missing required metadata key '{key}'")
    return meta[key]


# the `{arch}.*` keys read as counts / sizes, and as real numbers: a value of another type is
# a one-line error naming the key, not an IndexError / ZeroDivisionError further down
_INT_KEYS = ("embedding_length", "block_count", "context_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length",
             "attention.key_length_mla", "attention.value_length_mla", "rope.dimension_count", "vocab_size",
             "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_count",
             "expert_shared_feed_forward_length", "leading_dense_block_count", "attention.q_lora_rank",
             "attention.kv_lora_rank", "nextn_predict_layers", "attention.sliding_window", "expert_gating_func",
             "rope.scaling.original_context_length", "interleave_moe_layer_step")
_POSITIVE = ("embedding_length", "block_count", "attention.head_count")
_PER_LAYER = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")   # may be arrays
_REAL_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor", "rope.scale_linear",
              "rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_beta_fast",
              "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_log_multiplier", "expert_weights_scale")


def _check_types(meta: dict, arch: str, path: str) -> None:
    def bad(key: str, want: str, v: Any) -> ModelFileError:
        shown = repr(v) if not isinstance(v, list) or len(v) < 8 else f"an array of {len(v)}"
        return ModelFileError(f"{path}: metadata key '{arch}.{key}' must be {want}, got {shown}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    n_layer = meta.get(f"{arch}.block_count")
    for key in _INT_KEYS:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            continue
        if isinstance(v, list) and key in _PER_LAYER:
            if not v or not all(is_int(x) for x in v) or (is_int(n_layer) and len(v) != n_layer):
                raise bad(key, f"an integer or an array of {n_layer} integers (one per layer)", v)
            if len(set(v)) > 1:
                raise ModelFileError(f"{path}: metadata key '{arch}.{key}' differs between layers ({v[:8]}...): "
                                     f"per-layer sizes are not supported")
            v = v[0]
        if not is_int(v) or v < 0 or (key in _POSITIVE and v == 0):
            raise bad(key, "a positive integer" if key in _POSITIVE else "a non-negative integer", v)
    for key in _REAL_KEYS:
        v = meta.get(f"{arch}.{key}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise bad(key, "a number", v)


def _check_relations(hp: HParams, arch: str, path: str) -> None:
    """Sizes that must agree with each other (a damaged value would fail deep in the forward)."""
    def bad(what: str) -> ModelFileError:
        return ModelFileError(f"{path}: inconsistent {arch} hyper-parameters: {what}")
    if hp.n_head_kv < 1 or hp.n_head % hp.n_head_kv:
        raise bad(f"{hp.n_head} attention heads are not a multiple of {hp.n_head_kv} kv heads")
    if hp.n_rot % 2 or not 0 < hp.n_rot <= max(hp.n_embd_head_k, 1) or hp.n_embd_head_k < 1 or hp.n_embd_head_v < 1:
        raise bad(f"rope.dimension_count {hp.n_rot} for heads of {hp.n_embd_head_k}/{hp.n_embd_head_v} values")


def read_hparams(mf: ModelFile) -> HParams:
    meta, path = mf.meta, mf.path
    arch = mf.arch
    if not arch:
        raise ModelFileError(f"{path}: no general.architecture key (vocabulary-only or corrupt file?)")
    if arch not in SUPPORTED_ARCHS:
        from .gguf_scan import printable
        raise ModelFileError(f"{path}: unknown model architecture '{printable(arch)}' "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    _check_types(meta, arch, path)

    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        return _need(meta, f"{arch}.{key}", path)

    n_embd = int(need("embedding_length"))
    n_layer = int(need("block_count"))
    n_head = g("attention.head_count")
    if isinstance(n_head, list):
        n_head = n_head[0]
    n_head = int(n_head if n_head is not None else need("attention.head_count"))
    n_head_kv = g("attention.head_count_kv", n_head)
    if isinstance(n_head_kv, list):
        n_head_kv = n_head_kv[0]
    n_head_kv = int(n_head_kv)
    n_ff = g("feed_forward_length", 0)
    if isinstance(n_ff, list):
        n_ff = n_ff[0]
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(g("vocab_size", len(tokens) if tokens else 0))
    if n_vocab == 0:
        emb = mf.get("token_embd.weight")
        n_vocab = emb.ne[1] if emb is not None else 0
    k_len = int(g("attention.key_length", n_embd // n_head))
    v_len = int(g("attention.value_length", n_embd // n_head))
    # new mainline MLA layout stores the latent sizes as key/value_length and the per-head
    # decompressed sizes under *_mla
    if g("attention.key_length_mla") is not None:
        k_len = int(g("attention.key_length_mla"))
        v_len = int(g("attention.value_length_mla", v_len))
        if arch == "deepseek2":
            n_head_kv = n_head
    n_rot = int(g("rope.dimension_count", k_len))
    rope_scaling = str(g("rope.scaling.type", "linear"))
    factor = float(g("rope.scaling.factor", 0.0) or g("rope.scale_linear", 0.0) or 0.0)
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    if rope_scaling == "none":
        freq_scale = 1.0
    n_ctx_train = int(g("context_length", 2048))
    hp = HParams(
        arch=arch, n_vocab=n_vocab, n_ctx_train=n_ctx_train, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=k_len, n_embd_head_v=v_len,
        n_ff=int(n_ff or 0), rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        n_rot=n_rot, rope_freq_base=float(g("rope.freq_base", 10000.0)), rope_freq_scale=freq_scale,
        rope_scaling=rope_scaling,
        n_ctx_orig_yarn=int(g("rope.scaling.original_context_length", n_ctx_train) or n_ctx_train),
        yarn_ext_factor=float(g("rope.scaling.yarn_ext_factor", -1.0)),
        yarn_attn_factor=float(g("rope.scaling.attn_factor", 1.0)),
        yarn_beta_fast=float(g("rope.scaling.yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(g("rope.scaling.yarn_beta_slow", 1.0)),
        rope_yarn_log_mul=float(g("rope.scaling.yarn_log_multiplier", 0.0)),
        rope_neox=arch in NEOX_ROPE_ARCHS,
    )
    hp.yarn_ext_factor_file = hp.yarn_ext_factor
    _check_relations(hp, arch, path)
    hp.rope_freq_scale_file = 1.0 if factor == 0.0 else 1.0 / factor
    if hp.yarn_ext_factor < 0:
        hp.yarn_ext_factor = 1.0 if rope_scaling == "yarn" else 0.0
    hp.n_expert = int(g("expert_count", 0) or 0)
    hp.n_expert_used = int(g("expert_used_count", 0) or 0)
    if hp.n_expert_used > hp.n_expert:
        raise ModelFileError(f"{path}: inconsistent {arch} hyper-parameters: expert_used_count {hp.n_expert_used} > "
                             f"expert_count {hp.n_expert}")
    hp.n_ff_exp = int(g("expert_feed_forward_length", 0) or 0)
    hp.n_nextn = int(g("nextn_predict_layers", 0) or 0)
    hp.n_swa = int(g("attention.sliding_window", 0) or 0)
    if arch in ("gemma3", "gpt-oss") and hp.n_swa <= 0:
        raise ModelFileError(f"{path}: {arch} model without a positive attention.sliding_window")
    if arch == "llama4":       # ik requires both keys (and a positive step)
        hp.n_moe_layer_step = int(need("interleave_moe_layer_step"))
        hp.n_ff_exp = int(need("expert_feed_forward_length"))
        if hp.n_moe_layer_step <= 0 or hp.n_expert <= 0 or hp.n_expert_used <= 0:
            raise ModelFileError(f"{path}: llama4 model needs a positive interleave_moe_layer_step, expert_count "
                                 f"and expert_used_count")
    if arch == "glm4moe":      # DeepSeek-V3's router and expert keys; sigmoid unless the file says
        hp.n_expert_shared = int(g("expert_shared_count", 0) or 0)
        hp.n_layer_dense_lead = int(g("leading_dense_block_count", 0) or 0)
        hp.expert_weights_scale = float(need("expert_weights_scale"))
        hp.expert_weights_norm = bool(g("expert_weights_norm", False))
        gf = int(g("expert_gating_func", 0) or 0)
        hp.expert_gating_func = gf if gf in (GATING_SOFTMAX, GATING_SIGMOID) else GATING_SIGMOID
        if not 0 <= hp.n_nextn < hp.n_layer:
            raise ModelFileError(f"{path}: nextn_predict_layers {hp.n_nextn} for {hp.n_layer} layers")
    if arch == "deepseek2":
        hp.q_lora_rank = int(g("attention.q_lora_rank", 0) or 0)
        hp.kv_lora_rank = int(need("attention.kv_lora_rank"))
        hp.n_expert_shared = int(g("expert_shared_count", 0))
        hp.n_ff_exp = int(g("expert_feed_forward_length", 0))
        hp.n_layer_dense_lead = int(g("leading_dense_block_count", 0))
        hp.expert_weights_scale = float(g("expert_weights_scale", 1.0))
        hp.expert_weights_norm = bool(g("expert_weights_norm", False))
        gf = int(g("expert_gating_func", 0) or 0)
        hp.expert_gating_func = gf if gf in (GATING_SOFTMAX, GATING_SIGMOID) else GATING_SOFTMAX
        if hp.n_layer_dense_lead < hp.n_layer and (hp.n_expert <= 0 or hp.n_expert_used <= 0):
            raise ModelFileError(f"{path}: deepseek2 model without expert_count / expert_used_count")
    return hp


ROPE_SCALINGS = ("none", "linear", "yarn")


def override_rope(hp: HParams, ro: Any) -> None:
    """Apply --rope-* / --yarn-* (engine.config.RopeOverrides) as ik's context does: a set value
    wins over the model's, 'none' never scales, the YaRN extrapolation mix follows the scaling
    type in force unless given, and --yarn-attn-factor multiplies the model's RoPE attention
    factor."""
    if ro.scaling and ro.scaling not in ROPE_SCALINGS:
        raise ValueError(f"unknown RoPE scaling '{ro.scaling}' (use none, linear or yarn)")
    if ro.freq_base != 0.0:
        hp.rope_freq_base = ro.freq_base
    if ro.scaling:
        hp.rope_scaling = ro.scaling
    hp.rope_freq_scale = ro.freq_scale if ro.freq_scale != 0.0 else hp.rope_freq_scale_file
    if hp.rope_scaling == "none":
        hp.rope_freq_scale = 1.0
    if ro.orig_ctx != 0:
        hp.n_ctx_orig_yarn = ro.orig_ctx
    ext = ro.ext_factor if ro.ext_factor >= 0 else hp.yarn_ext_factor_file
    hp.yarn_ext_factor = ext if ext >= 0 else (1.0 if hp.rope_scaling == "yarn" else 0.0)
    if ro.attn_factor >= 0:
        hp.yarn_attn_factor *= ro.attn_factor
    if ro.beta_fast >= 0:
        hp.yarn_beta_fast = ro.beta_fast
    if ro.beta_slow >= 0:
        hp.yarn_beta_slow = ro.beta_slow


def yarn_kq_scale(hp: HParams) -> float:
    """Attention scale; DeepSeek's YaRN folds mscale² into it (llama.cpp discussion 7416)."""
    if hp.arch != "deepseek2":
        return 1.0 / math.sqrt(hp.n_embd_head_k)
    mscale = hp.yarn_attn_factor * (1.0 + hp.rope_yarn_log_mul * math.log(1.0 / hp.rope_freq_scale))
    return mscale * mscale / math.sqrt(hp.n_embd_head_k)


def rope_attn_factor(hp: HParams) -> float:
    """The `mscale` handed to RoPE (DeepSeek pre-divides what YaRN multiplies back in)."""
    if hp.arch == "deepseek2":
        return 1.0 / (1.0 + 0.1 * math.log(1.0 / hp.rope_freq_scale))
    return hp.yarn_attn_factor
