"""The KV cache of one context: cells (one per cached token) holding K/V rows in a GGML type.

A cell has a position; cells are kept compact and in insertion order, so cell i of every
layer's store holds the same token.  Removing a range of positions (`seq_rm`) moves the later
cells down; their positions (and so their RoPE) are unchanged.  Attention masks with the
cells' positions: a query at position p sees the cells whose position is <= p.

What a layer stores depends on the attention mode (DESIGN.md, MLA):
* standard heads (`-mla 0`, non-MLA models): K rows of n_head_kv*dk and V rows of
  n_head_kv*dv values, in type_k / type_v;
* latent (`-mla 1..3`): one row of kv_lora_rank + n_rot values per token, [c | k_pe]; V is
  a view of its first kv_lora_rank values (rows of 512 inside rows of 576), so there is no
  separate V store.  Only `-mla 1` without flash attention adds a transposed copy of c
  (kv^T, lora x n_ctx), because that mode multiplies with it directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quant import reference

from .device import to_host
from quant.types import BF16, F16, F32, Q4_0, Q6_0, Q8_0, type_info

# -ctk / -ctv names (llama.cpp spelling, lower case) -> GGML type ids.  ik also takes iq4_nl, whose
# row quantizer (ggml's quantize_row_iq4_nl) ikcli does not have.
CACHE_TYPES = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0, "q4_0": Q4_0, "q6_0": Q6_0,
               **{n: type_info(n).id for n in ("q4_1", "q5_0", "q5_1", "q8_kv")}}
FLOAT_TYPES = frozenset({F32, F16, BF16})


def cache_type_name(qtype: int) -> str:
    """ggml's type name, as ik's log prints it (lower case, but for q8_KV)."""
    n = type_info(qtype).name.lower()
    return "q8_KV" if n == "q8_kv" else n


class RowStore:
    """n_ctx rows of `width` values in GGML type `qtype`: data is (n_ctx, row_bytes) uint8.

    A row is width // unit units of `unit` values (a K or V head; default the whole row), each
    quantized as a row of its own: for a type with per-row metadata (Q8_KV: one f32 scale and
    the quants' sum) every head carries its own, as in ik's cache, whose K tensor has a row per
    head and cell.  For block types the units change nothing."""

    device = "CPU"          # engine.cuda_backend.DeviceRowStore: the same rows in GPU memory

    def __init__(self, n_ctx: int, width: int, qtype: int, unit: int | None = None) -> None:
        ti = type_info(qtype)
        unit = width if unit is None else unit
        if width % ti.block_size or unit % ti.block_size or width % unit:
            raise ValueError(f"a {cache_type_name(qtype)} cache needs heads that are a multiple of {ti.block_size} "
                             f"values; these have {unit}")
        self.n_ctx, self.width, self.qtype, self.unit = n_ctx, width, qtype, unit
        self.data = np.zeros((n_ctx, width // unit * ti.row_bytes(unit)), dtype=np.uint8)

    @classmethod
    def from_f32(cls, x: np.ndarray) -> "RowStore":
        """A read-only F32 store over the rows of x (n, width), without copying a contiguous x."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], -1)
        s = cls.__new__(cls)
        s.n_ctx, s.width, s.qtype, s.unit = x.shape[0], x.shape[1], F32, x.shape[1]
        s.data = x.view(np.uint8)
        return s

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def write(self, i0: int, x: np.ndarray) -> None:
        """Rows [i0, i0 + len(x)) = x (t, width) f32, converted / quantized to the store's type."""
        t = x.shape[0]
        x = np.ascontiguousarray(to_host(x), dtype=np.float32).reshape(t, self.width)
        if self.qtype == F32:
            self.data[i0:i0 + t] = x.view(np.uint8)
        elif self.qtype == F16:           # converted in place: no f16 temporary per token
            self.data[i0:i0 + t].view(np.float16)[...] = x
        else:
            units = x.reshape(t * (self.width // self.unit), self.unit)
            self.data[i0:i0 + t] = reference.quantize_row(units, self.qtype).reshape(t, -1)

    def read(self, n: int, out: np.ndarray | None = None, first: int = 0) -> np.ndarray:
        """Rows [first, first + n) as f32 (n, width) (written into out when given)."""
        from quant.kernels import F16_TO_F32, QK, dequant_rows
        from quant.kernels import tag
        rows = self.data[first:first + n]
        if self.qtype == F32:
            return rows.view(np.float32)
        if out is None:
            out = np.empty((n, self.width), dtype=np.float32)
        if n:   # F16 too: NumPy's f16 -> f32 copy is scalar (4096 DeepSeek latent rows: 5.4 ms, 0.28 here)
            per = self.width // self.unit             # the units of a row lie one after the other
            dequant_rows(self.data.reshape(-1), tag(self.qtype), self.data.shape[1] // per,
                         np.arange(first * per, (first + n) * per, dtype=np.int64), self.unit, QK, F16_TO_F32,
                         out.reshape(n * per, self.unit))
        return out

    def move(self, src: np.ndarray, dst0: int) -> None:
        """Rows src (ascending cell indices >= dst0) go to dst0, dst0+1, ..."""
        self.data[dst0:dst0 + len(src)] = self.data[src]


class TransposedStore:
    """kv^T of `-mla 1` without flash attention: (width, n_ctx) in a float type (host memory only)."""

    device = "CPU"

    def __init__(self, n_ctx: int, width: int, qtype: int) -> None:
        if qtype not in FLOAT_TYPES:
            raise ValueError("the transposed kv^T cache of -mla 1 without flash attention must be f16, bf16 or f32")
        self.n_ctx, self.width, self.qtype = n_ctx, width, qtype
        self.data = np.zeros((width, n_ctx), dtype=np.float32 if qtype == F32 else np.uint16)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def write(self, i0: int, x: np.ndarray) -> None:
        t = x.shape[0]
        xt = np.ascontiguousarray(to_host(x), dtype=np.float32).T
        if self.qtype == F32:
            self.data[:, i0:i0 + t] = xt
        elif self.qtype == F16:
            self.data[:, i0:i0 + t] = xt.astype(np.float16).view(np.uint16)
        else:
            self.data[:, i0:i0 + t] = reference.f32_to_bf16_bits(xt).reshape(xt.shape)

    def read(self, n: int) -> np.ndarray:
        """(width, n) f32."""
        d = self.data[:, :n]
        if self.qtype == F32:
            return d
        if self.qtype == F16:
            return d.view(np.float16).astype(np.float32)
        return reference.bf16_bits_to_f32(np.ascontiguousarray(d)).reshape(d.shape)

    def move(self, src: np.ndarray, dst0: int) -> None:
        self.data[:, dst0:dst0 + len(src)] = self.data[:, src]


@dataclass
class LayerCache:
    k: RowStore                        # standard K rows, or the latent [c | k_pe] rows
    v: RowStore | None = None          # standard V rows (None for latent caches)
    vt: TransposedStore | None = None  # kv^T (-mla 1 without flash attention only)

    def stores(self):
        return [s for s in (self.k, self.v, self.vt) if s is not None]


class KVCache:
    """Cells [0, n) are valid; pos[i] is the position of cell i."""

    def __init__(self, n_ctx: int, layers: list[LayerCache], latent: bool = False) -> None:
        self.n_ctx = n_ctx
        self.layers = layers
        self.latent = latent
        self.pos = np.zeros(n_ctx, dtype=np.int32)
        self.n = 0

    @classmethod
    def standard(cls, n_ctx: int, shapes: list[tuple[int, int, int]], type_k: int = F16, type_v: int = F16) -> "KVCache":
        """shapes: per layer (n_head_kv, dk, dv)."""
        return cls(n_ctx, [LayerCache(RowStore(n_ctx, h * dk, type_k, dk), RowStore(n_ctx, h * dv, type_v, dv))
                           for h, dk, dv in shapes])

    @classmethod
    def mla(cls, n_ctx: int, n_layer: int, kv_lora_rank: int, n_rot: int, cache_type: int,
            vt_type: int | None = None) -> "KVCache":
        """Latent rows of kv_lora_rank + n_rot; vt_type adds the transposed c (mla 1, no FA)."""
        return cls(n_ctx, [LayerCache(RowStore(n_ctx, kv_lora_rank + n_rot, cache_type), None,
                                      TransposedStore(n_ctx, kv_lora_rank, vt_type) if vt_type is not None else None)
                           for _ in range(n_layer)], latent=True)

    # ---- sizes, for the log ----------------------------------------------------------
    def size_bytes(self) -> tuple[int, int]:
        """(bytes of K-side stores, bytes of V-side stores: V rows or kv^T)."""
        k = sum(L.k.nbytes for L in self.layers)
        v = sum((L.v.nbytes if L.v is not None else 0) + (L.vt.nbytes if L.vt is not None else 0)
                for L in self.layers)
        return k, v

    # ---- cells -----------------------------------------------------------------------
    def clear(self) -> None:
        self.n = 0

    def next_pos(self) -> int:
        return int(self.pos[:self.n].max()) + 1 if self.n else 0

    def reserve(self, pos: np.ndarray) -> int:
        """Claim len(pos) cells for positions `pos`; returns the first cell index."""
        t = len(pos)
        if self.n + t > self.n_ctx:
            raise ValueError(f"the KV cache is full: {self.n} cells used + {t} new tokens > n_ctx = {self.n_ctx}")
        i0 = self.n
        self.pos[i0:i0 + t] = pos
        self.n += t
        return i0

    def seq_rm(self, p0: int = 0, p1: int = -1) -> int:
        """Drop the cells with p0 <= pos < p1 (p1 < 0: no upper end); returns how many went."""
        n = self.n
        p = self.pos[:n]
        hi = np.iinfo(np.int32).max if p1 < 0 else p1
        drop = (p >= max(p0, 0)) & (p < hi)
        if not drop.any():
            return 0
        keep = np.nonzero(~drop)[0]
        first = int(np.argmax(drop))             # cells before the first dropped one stay put
        tail = keep[keep > first]
        for L in self.layers:
            for s in L.stores():
                s.move(tail, first)
        self.pos[first:first + len(tail)] = self.pos[tail]
        self.n = first + len(tail)
        return int(drop.sum())
