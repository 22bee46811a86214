"""Pieces shared by the architectures: the token embedding, the output head, RoPE tables."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quant.matmul import get_rows
from quant.tensor import QTensor

from ..attention import standard_attention
from ..hparams import HParams
from ..linear import matmul      # observed: imatrix --process-output / -lsim record the output tensor
from ..ops import all_finite, contiguous, empty_like_side, host, rms_norm, take_rows, to_side_of
from ..rope import rope_cos_sin


@dataclass
class Segment:
    """Tokens [t0, t1) of a micro-batch belong to the sequence cached in `cache`, cells cell0..."""
    cache: object           # KVCache
    cell0: int
    t0: int
    t1: int


@dataclass
class UBatch:
    tokens: np.ndarray      # int32 (T,)
    pos: np.ndarray         # int32 (T,) positions in the sequence
    out_rows: np.ndarray    # indices into tokens whose logits are wanted
    cell0: int = 0          # KV cache cells [cell0, cell0 + T) are this batch's
    # several sequences in one batch (the server's slots): matmuls run over all tokens, the
    # cache writes and attention per segment.  None: one sequence, the forward's `cache`.
    segments: list[Segment] | None = None

    def segs(self, cache) -> list[Segment]:
        return self.segments if self.segments is not None else [Segment(cache, self.cell0, 0, len(self.tokens))]


@dataclass
class RunOptions:
    """How to compute (results agree across these within float tolerance)."""
    flash_attn: bool = True
    mla: int = 0                 # DeepSeek attention mode (0 for other architectures)
    amb_bytes: int = 0           # K*Q / decompressed K,V scratch cap (0: no user cap)
    fused_moe: bool = True
    ser: tuple[int, float] = (-1, 0.0)
    # the output rows' normed final hidden states (llama.cpp's result_norm: what embeddings pool)
    # instead of their logits (llama_set_embeddings)
    embeddings: bool = False


class Head:
    """Token embedding in, final norm and output projection out."""

    def __init__(self, tok_embd: QTensor, output_norm: np.ndarray, output: QTensor, eps: float) -> None:
        self.tok_embd, self.output_norm, self.output, self.eps = tok_embd, output_norm, output, eps
        # a constant of the first layer (set at load): the embeddings go where that layer is, once,
        # as ggml copies a split's input once (else its norm and its residual add would each copy them)
        self.first_layer_const: np.ndarray | None = None

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        x = get_rows(self.tok_embd, tokens.astype(np.int64))
        return x if self.first_layer_const is None else to_side_of(x, self.first_layer_const)

    def logits(self, x: np.ndarray, rows: np.ndarray, opts: RunOptions | None = None) -> np.ndarray:
        """The logits of x's `rows`, or with opts.embeddings their normed hidden states (n_embd wide)."""
        h = rms_norm(take_rows(x, rows), self.output_norm, self.eps)
        if opts is not None and opts.embeddings:
            return host(h)
        if not all_finite(h):            # else quantizing the activations for the output would hide it
            raise FloatingPointError("the hidden state reached the output layer with NaN or infinite values")
        return host(matmul(self.output, h))


def cached_attention(ub: UBatch, cache, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     kq_scale: float, opts: RunOptions, window: int = 0,
                     sinks: np.ndarray | None = None, chunk: int = 0) -> np.ndarray:
    """Layer il of a standard (K rows, V rows) cache: this micro-batch's k (T, Hkv, dk) and
    v (T, Hkv, dv) written into the cache of each sequence segment, then q (T, H, dk) attends over
    it (window: a sliding window; sinks: gpt-oss's per-head sink logits; chunk: llama4's chunked
    attention).  Returns (T, H, dv)."""
    T, H, dk = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    a = empty_like_side((T, H, dv), q)
    for sg in ub.segs(cache):
        lc, sl = sg.cache.layers[il], slice(sg.t0, sg.t1)
        lc.k.write(sg.cell0, k[sl].reshape(sg.t1 - sg.t0, -1))
        lc.v.write(sg.cell0, v[sl].reshape(sg.t1 - sg.t0, -1))
        a[sl] = standard_attention(contiguous(q[sl]), lc, sg.cache.n, hkv, dk, dv, sg.cache.pos,
                                   ub.pos[sl], kq_scale, opts.flash_attn, opts.amb_bytes, window=window, sinks=sinks,
                                   chunk=chunk)
    return a


def rope_tables(hp: HParams, pos: np.ndarray, attn_factor: float, freq_factors: np.ndarray | None = None):
    return rope_cos_sin(pos, hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.yarn_ext_factor,
                        attn_factor, hp.n_ctx_orig_yarn, hp.yarn_beta_fast, hp.yarn_beta_slow, freq_factors)


def check_moe_shapes(path: str, prefix: str, m, n_expert: int, n_embd: int) -> None:
    """The expert tensors of one layer agree with each other and with the hyper-parameters
    (ModelFileError naming the tensor): router (X, E), gate / up (X, F, E), down (X, E, F)."""
    from ..gguf_file import ModelFileError
    X, E = n_expert, n_embd
    F = m.gate.shape[1] if len(m.gate.shape) == 3 else -1
    want = {"ffn_gate_inp": (m.router, (X, E)), "ffn_gate_exps": (m.gate, (X, F, E)),
            "ffn_up_exps": (m.up, (X, F, E)), "ffn_down_exps": (m.down, (X, E, F))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ModelFileError(f"{path}: tensor '{prefix}{name}.weight' has shape {list(reversed(t.shape))}, "
                                 f"expected {list(reversed(shape))}")


# ---- context shift (llama-server's --context-shift) -----------------------------------------

def shift_rope_tables(hp: HParams, n: int, delta: int, freq_factors: np.ndarray | None = None):
    """cos / sin of a rotation by `delta` positions, without YaRN's magnitude factor (the cached
    keys already carry it once): RoPE angles are linear in the position, so rotating a key cached
    at p by delta gives exactly the key at p + delta."""
    import math
    f = 1.0 / (1.0 + 0.1 * math.log(1.0 / hp.rope_freq_scale)) if hp.yarn_ext_factor != 0.0 else 1.0
    return rope_tables(hp, np.full(n, delta, dtype=np.int64), f, freq_factors)


def rotate_key_rows(store, c0: int, c1: int, n_heads: int, head_dim: int, r0: int, n_rot: int, cos, sin,
                    neox: bool) -> None:
    """Rotate the RoPE part (values r0 .. r0 + n_rot of each head) of cache rows [c0, c1) in place
    (read as f32, rotated, written back in the store's type, as ggml's K shift does)."""
    from ..device import to_host
    from ..rope import apply_rope
    if c1 <= c0:
        return
    rows = np.array(to_host(store.read(c1))[c0:c1], dtype=np.float32).reshape(c1 - c0, n_heads, head_dim)
    part = np.ascontiguousarray(rows[:, :, r0:r0 + n_rot])
    apply_rope(part, cos, sin, neox)
    rows[:, :, r0:r0 + n_rot] = part
    store.write(c0, rows.reshape(c1 - c0, -1))


def context_shift(arch, cache, n_keep: int, n_discard: int) -> int:
    """Drop the cells at positions [n_keep, n_keep + n_discard) and move the later ones down by
    n_discard positions, their keys re-rotated (arch.shift_keys).  Returns the cells dropped."""
    n_before = cache.n
    gone = cache.seq_rm(n_keep, n_keep + n_discard)
    moved = np.nonzero(cache.pos[:cache.n] >= n_keep + n_discard)[0]
    if len(moved):
        c0, c1 = int(moved[0]), int(moved[-1]) + 1        # cells stay in position order
        arch.shift_keys(cache, c0, c1, -n_discard)
        cache.pos[c0:c1] -= n_discard
    assert cache.n == n_before - gone
    return gone
