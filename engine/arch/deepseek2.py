"""The `deepseek2` architecture (DeepSeek-V2/V2-Lite/V2.5/V3/R1): multi-head latent attention + MoE.

Per token, K and V are compressed into a latent c = norm(W_kv_a x) (kv_lora_rank values) plus
one rope key k_pe shared by all heads.  The attention modes (`-mla`, DESIGN.md):

* 0: decompress c through W_kv_b into per-head K (nope | rope) and V; cache those.
* 1..3: cache only the rows [c | k_pe].  Attending in latent space absorbs W_k_b into the query
  (q_lat = W_k_b[h] q_nope[h]) and W_v_b into the output (o[h] = W_v_b[h] (softmax . c)), so
  keys are [c | k_pe] and values are c — a view of the key rows.  `-mla 2/3` with flash
  attention decompress the cache again for prompt processing (>= 128 tokens, as in
  ik_llama.cpp), where that is cheaper; `-mla 1` without flash attention also keeps c
  transposed (kv^T); `-mla 2` generates with plain (materialized) latent attention and
  `-mla 1/3` with flash attention on the 576/512 latent heads.

GGUF layouts: `attn_kv_b` (+ `attn_k_b`/`attn_v_b`) in ik files, only `attn_kv_b` in old
mainline files (W_k_b / W_v_b are derived at load), only `attn_k_b`/`attn_v_b` in new-mainline
files (W_kv_b is rebuilt when a mode needs it).
"""
from __future__ import annotations

import numpy as np

from quant.matmul import dequantize, quantize_tensor
from quant.tensor import QTensor, f32_qtensor
from quant.types import BF16, F16, F32, Q8_0, type_info

from ..attention import causal_attention, split_heads_for_decompression
from ..ffn import MoEWeights, ffn_silu, moe_ffn
from ..gguf_file import ModelFileError
from ..hparams import HParams, rope_attn_factor, yarn_kq_scale
from ..kv_cache import KVCache, LayerCache
from ..linear import matmul, matmul_heads
from ..ops import contiguous, empty_like_side, heads_with_shared, rms_norm
from ..rope import apply_rope
from .common import (Head, RunOptions, UBatch, cached_attention, check_moe_shapes, rope_tables, rotate_key_rows,
                     shift_rope_tables)

PP_DECOMPRESS_MIN_TOKENS = 128   # ik_llama.cpp's threshold for decompressed prompt processing (-mla 2/3)


def rebuild_kv_b(k_b: np.ndarray, v_b: np.ndarray, n_head: int, nope: int, n_v: int, lora: int) -> np.ndarray:
    """W_kv_b (n_head·(nope+v), lora) from k_b (n_head, lora, nope) and v_b (n_head, v, lora)."""
    k_b = k_b.reshape(n_head, lora, nope)
    v_b = v_b.reshape(n_head, n_v, lora)
    out = np.empty((n_head, nope + n_v, lora), dtype=np.float32)
    out[:, :nope, :] = k_b.transpose(0, 2, 1)
    out[:, nope:, :] = v_b
    return out.reshape(n_head * (nope + n_v), lora)


def per_head(w: QTensor, x: np.ndarray) -> np.ndarray:
    """y[t, h] = W[h] x[t, h] for W (H, N, K) and x (T, H, K): one batched call over all heads."""
    return matmul_heads(w, x)


class DeepSeek2Arch:
    def __init__(self, hp: HParams, w, log, mla: int = 3) -> None:
        self.hp, self.w, self.log = hp, w, log
        E, H = hp.n_embd, hp.n_head
        dk, dv, rope, lora = hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot, hp.kv_lora_rank
        self.nope = nope = dk - rope
        emb = w.matrix("token_embd.weight", (hp.n_vocab, E))
        out = w.matrix("output.weight", (hp.n_vocab, E)) if w.has("output.weight") else emb
        self.head = Head(emb, w.vector("output_norm.weight", E), out, hp.rms_eps)
        self.has_q_lora = w.has("blk.0.attn_q_a.weight")
        self.layers = []
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            L: dict = {"attn_norm": w.vector(p + "attn_norm.weight", E)}
            if self.has_q_lora:
                ql = w.entry(p + "attn_q_a.weight").ne[1]
                L["wq_a"] = w.matrix(p + "attn_q_a.weight", (ql, E))
                L["q_a_norm"] = w.vector(p + "attn_q_a_norm.weight", ql)
                L["wq_b"] = w.matrix(p + "attn_q_b.weight", (H * dk, ql))
            else:
                L["wq"] = w.matrix(p + "attn_q.weight", (H * dk, E))
            L["wkv_a"] = w.matrix(p + "attn_kv_a_mqa.weight", (lora + rope, E))
            L["kv_a_norm"] = w.vector(p + "attn_kv_a_norm.weight", lora)
            has_kv_b = w.has(p + "attn_kv_b.weight")
            has_kv_split = w.has(p + "attn_k_b.weight") and w.has(p + "attn_v_b.weight")
            if not has_kv_b and not has_kv_split:
                raise ModelFileError(f"{w.mf.path}: missing tensor '{p}attn_kv_b.weight' (and no attn_k_b/attn_v_b to rebuild it)")
            if has_kv_b:
                L["wkv_b"] = w.matrix(p + "attn_kv_b.weight", (H * (nope + dv), lora))
            if has_kv_split:
                L["wk_b"] = self._head_matrix(p + "attn_k_b.weight", (H, lora, nope))
                L["wv_b"] = self._head_matrix(p + "attn_v_b.weight", (H, dv, lora))
            L["wo"] = w.matrix(p + "attn_output.weight", (E, H * dv))
            L["ffn_norm"] = w.vector(p + "ffn_norm.weight", E)
            if i < hp.n_layer_dense_lead:
                L["gate"] = w.matrix(p + "ffn_gate.weight")
                L["up"] = w.matrix(p + "ffn_up.weight")
                L["down"] = w.matrix(p + "ffn_down.weight")
            else:
                L["moe"] = MoEWeights(
                    w.matrix(p + "ffn_gate_inp.weight", (hp.n_expert, E)),
                    w.optional_vector(p + "exp_probs_b.bias"),
                    w.matrix(p + "ffn_gate_exps.weight"), w.matrix(p + "ffn_up_exps.weight"),
                    w.matrix(p + "ffn_down_exps.weight"))
                check_moe_shapes(w.mf.path, p, L["moe"], hp.n_expert, E)
                if hp.n_expert_shared > 0:
                    L["sh_gate"] = w.matrix(p + "ffn_gate_shexp.weight")
                    L["sh_up"] = w.matrix(p + "ffn_up_shexp.weight")
                    L["sh_down"] = w.matrix(p + "ffn_down_shexp.weight")
            self.layers.append(L)
        self.kq_scale = yarn_kq_scale(hp)
        self.attn_factor = rope_attn_factor(hp)
        self.prepare(mla)

    def _head_matrix(self, name: str, shape: tuple[int, int, int]) -> QTensor:
        """attn_k_b / attn_v_b as (n_head, rows, cols): 2-D in ik files, 3-D in new mainline, same bytes."""
        e = self.w.entry(name)
        if int(np.prod(e.shape)) != int(np.prod(shape)) or e.shape[-1] != shape[-1]:
            raise ModelFileError(f"{self.w.mf.path}: tensor '{name}' has shape {list(e.ne)}, "
                                 f"expected {shape[2]} x {shape[1] * shape[0]}")
        # the label is the operand's name in ik's graph (what llama-imatrix records): a 2-D file tensor is
        # reshaped there ("… (reshaped)"; W_v_b's view is renamed "wv_b-N", which it does not record)
        return QTensor(QTensor.from_raw(e.raw, e.qtype, shape).data, e.qtype, shape,
                       name if len(e.shape) == 3 else (f"{name} (reshaped)" if "attn_k_b" in name else ""))

    # ---- tensors some modes need and some files lack -----------------------------------
    def prepare(self, mla: int) -> None:
        """Derive what mode `mla` needs: W_kv_b (modes 0, 2, 3) or W_k_b / W_v_b (modes 1..3)."""
        hp = self.hp
        H, dv, lora, nope = hp.n_head, hp.n_embd_head_v, hp.kv_lora_rank, self.nope
        need_kv_b, need_split = mla != 1, mla != 0
        n_split = sum(1 for L in self.layers if need_split and "wk_b" not in L)
        if n_split:
            self.log(f"============ llm_prepare_mla: need to compute {n_split} wk_b/wv_b tensors")
        n_kv_b = 0
        for i, L in enumerate(self.layers):
            p = f"blk.{i}."
            if need_split and "wk_b" not in L:
                kvb = L["wkv_b"]
                full = dequantize(kvb).reshape(H, nope + dv, lora)
                # ik_llama.cpp: W_k_b in Q8_0 when W_kv_b is quantized, else in W_kv_b's type
                t = kvb.qtype if kvb.qtype in (F32, F16, BF16) else Q8_0
                if nope % type_info(t).block_size:
                    t = F32
                L["wk_b"] = quantize_tensor(np.ascontiguousarray(full[:, :nope, :].transpose(0, 2, 1)), t)
                L["wk_b"].name = p + "attn_k_b.weight"     # ik's name for the derived 3-D tensors (imatrix records them)
                rb = kvb.data.shape[-1]
                L["wv_b"] = QTensor(np.ascontiguousarray(kvb.data.reshape(H, nope + dv, rb)[:, nope:, :]),
                                    kvb.qtype, (H, dv, lora), p + "attn_v_b.weight")
                for name, tw in (("attn_k_b", L["wk_b"]), ("attn_v_b", L["wv_b"])):
                    self.log(f"Computed {p}{name}.weight as {tw.shape[2]} x {tw.shape[1]} x {tw.shape[0]} of type "
                             f"{type_info(tw.qtype).name.lower()} and stored in buffer CPU")
            if need_kv_b and "wkv_b" not in L:
                kb, vb = dequantize(L["wk_b"]), dequantize(L["wv_b"])
                L["wkv_b"] = f32_qtensor(rebuild_kv_b(kb, vb, H, nope, dv, lora))
                self.w.extra[p + "attn_kv_b.weight"] = L["wkv_b"]
                n_kv_b += 1
        if n_kv_b:
            self.log(f"llm_load_tensors: computed attn_kv_b for {n_kv_b} layers from attn_k_b and attn_v_b "
                     f"(f32, {lora} x {H * (nope + dv)})")

    def make_cache(self, n_ctx: int, opts: RunOptions, type_k: int, type_v: int) -> KVCache:
        hp = self.hp
        self.prepare(opts.mla)
        if opts.mla == 0:
            return KVCache.standard(n_ctx, [(hp.n_head, hp.n_embd_head_k, hp.n_embd_head_v)] * hp.n_layer,
                                    type_k, type_v)
        # one latent row per token; its type follows ik_llama.cpp (type_v only for -mla 2/3 without FA)
        row_type = type_k if (opts.flash_attn or opts.mla == 1) else type_v
        vt_type = type_v if (opts.mla == 1 and not opts.flash_attn) else None
        return KVCache.mla(n_ctx, hp.n_layer, hp.kv_lora_rank, hp.n_rot, row_type, vt_type)

    def shift_keys(self, cache: KVCache, c0: int, c1: int, delta: int) -> None:
        """Re-rotate the cached keys of cells [c0, c1) by delta positions (context shift): the k_pe
        tail of latent rows, or the rope part of each head of -mla 0's K rows; c and V have no RoPE."""
        hp = self.hp
        cos, sin = shift_rope_tables(hp, c1 - c0, delta)
        for lc in cache.layers:
            if cache.latent:
                rotate_key_rows(lc.k, c0, c1, 1, hp.kv_lora_rank + hp.n_rot, hp.kv_lora_rank, hp.n_rot, cos, sin, False)
            else:
                rotate_key_rows(lc.k, c0, c1, hp.n_head, hp.n_embd_head_k, self.nope, hp.n_rot, cos, sin, False)

    # ---- forward -----------------------------------------------------------------------
    def attention(self, L: dict, h: np.ndarray, ub: UBatch, cos, sin, cache: KVCache, il: int,
                  opts: RunOptions) -> np.ndarray:
        hp = self.hp
        T, H = h.shape[0], hp.n_head
        dk, dv, rope, lora, nope = hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot, hp.kv_lora_rank, self.nope
        if self.has_q_lora:
            q = matmul(L["wq_b"], rms_norm(matmul(L["wq_a"], h), L["q_a_norm"], hp.rms_eps))
        else:
            q = matmul(L["wq"], h)
        q = q.reshape(T, H, dk)
        apply_rope(q[:, :, nope:], cos, sin, False)              # in place: the rope part of each head
        # the latent cache row [norm(c) | rope(k_pe)], made in kvr itself
        kvr = matmul(L["wkv_a"], h)
        c = rms_norm(contiguous(kvr[:, :lora]), L["kv_a_norm"], hp.rms_eps)
        row = kvr.reshape(T, 1, lora + rope)
        apply_rope(row[:, :, lora:], cos, sin, False)
        k_pe = row[:, :, lora:]
        row = row.reshape(T, lora + rope)
        a = empty_like_side((T, H, dv), q)
        if opts.mla == 0:
            kv = matmul(L["wkv_b"], c).reshape(T, H, nope + dv)
            k = empty_like_side((T, H, dk), kv)
            k[:, :, :nope] = kv[:, :, :nope]
            k[:, :, nope:] = k_pe
            a = cached_attention(ub, cache, il, q, k, kv[:, :, nope:], self.kq_scale, opts)
        else:
            row[:, :lora] = c
            for sg in ub.segs(cache):
                lc, sl, n = sg.cache.layers[il], slice(sg.t0, sg.t1), sg.t1 - sg.t0
                lc.k.write(sg.cell0, row[sl])
                if lc.vt is not None:
                    lc.vt.write(sg.cell0, c[sl])
                qs = contiguous(q[sl])
                if opts.mla >= 2 and opts.flash_attn and n >= PP_DECOMPRESS_MIN_TOKENS:
                    a[sl] = self._attend_decompressed(L, qs, lc, sg.cache.n, sg.cache.pos, ub.pos[sl], opts)
                else:
                    a[sl] = self._attend_latent(L, qs, lc, sg.cache.n, sg.cache.pos, ub.pos[sl], opts)
        return matmul(L["wo"], a.reshape(T, H * dv))

    def _attend_decompressed(self, L: dict, q: np.ndarray, lc: LayerCache, n_kv: int, cell_pos: np.ndarray,
                             q_pos: np.ndarray, opts: RunOptions) -> np.ndarray:
        """Prompt processing of -mla 2/3: expand the cached latents to per-head K/V, flash-attend."""
        from ..flash_attn import flash_attn_rows
        hp = self.hp
        T, H, dk = q.shape
        dv, lora, nope = hp.n_embd_head_v, hp.kv_lora_rank, self.nope
        cached = lc.k.read(n_kv)
        c_all = contiguous(cached[:, :lora])
        k_pe = contiguous(cached[:, lora:])
        wkv_b = L["wkv_b"]
        per = nope + dv
        hs = split_heads_for_decompression(H, H * per * n_kv * 4, opts.amb_bytes)
        out = empty_like_side((T, H, dv), q)
        for h0 in range(0, H, hs):
            h1 = min(H, h0 + hs)
            w_part = wkv_b.row_block(h0 * per, h1 * per)
            kv = matmul(w_part, c_all).reshape(n_kv, h1 - h0, per)
            k = heads_with_shared(kv, nope, k_pe)
            v = kv[:, :, nope:]              # (flash_attn_rows makes its one copy)
            out[:, h0:h1] = flash_attn_rows(contiguous(q[:, h0:h1]), k, v, cell_pos[:n_kv], q_pos, self.kq_scale)
        return out

    def _attend_latent(self, L: dict, q: np.ndarray, lc: LayerCache, n_kv: int, cell_pos: np.ndarray,
                       q_pos: np.ndarray, opts: RunOptions) -> np.ndarray:
        """Attention in latent space: keys [c | k_pe] (576), values c (512), W_k_b / W_v_b absorbed."""
        hp = self.hp
        T, H, dk = q.shape
        lora, rope, nope = hp.kv_lora_rank, hp.n_rot, self.nope
        ql = empty_like_side((T, H, lora + rope), q)
        ql[:, :, :lora] = per_head(L["wk_b"], contiguous(q[:, :, :nope]))
        ql[:, :, lora:] = q[:, :, nope:]
        if opts.flash_attn and opts.mla in (1, 3):
            from ..flash_attn import flash_attn
            lat = flash_attn(ql, lc.k, None, n_kv, 1, lora + rope, lora, cell_pos[:n_kv], q_pos, self.kq_scale)
        else:
            kc = lc.k.read(n_kv)
            v = lc.vt.read(n_kv).T if lc.vt is not None else kc[:, :lora]
            lat = causal_attention(ql, kc.reshape(n_kv, 1, lora + rope), v.reshape(n_kv, 1, lora),
                                   cell_pos[:n_kv], q_pos, self.kq_scale, opts.amb_bytes)
        return per_head(L["wv_b"], lat)

    def forward(self, ub: UBatch, cache: KVCache, opts: RunOptions) -> np.ndarray:
        hp = self.hp
        cos, sin = rope_tables(hp, ub.pos, self.attn_factor)
        x = self.head.embed(ub.tokens)
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], hp.rms_eps)
            x = x + self.attention(L, h, ub, cos, sin, cache, il, opts)
            h = rms_norm(x, L["ffn_norm"], hp.rms_eps)
            if "moe" in L:
                y = moe_ffn(h, L["moe"], hp.n_expert_used, hp.expert_gating_func, hp.expert_weights_norm,
                            hp.expert_weights_scale, fused=opts.fused_moe, ser=opts.ser)
                if "sh_gate" in L:      # not +=: a GPU shared expert's sum then stays on the GPU
                    y = y + ffn_silu(h, L["sh_gate"], L["sh_up"], L["sh_down"])
            else:
                y = ffn_silu(h, L["gate"], L["up"], L["down"])
            x = x + y
        return self.head.logits(x, ub.out_rows, opts)
