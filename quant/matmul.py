"""Public entry points: matmul / get_rows / dequantize / quantize_tensor on QTensors.

matmul(w, x) computes x @ W.T for f32 activations x (n, cols) and weights W (rows, cols)
stored in any supported GGML type, reading the packed weight bytes in place:

* few tokens (n < many_tokens(qtype): any number for every integer type on CPUs with
  AVX512-VNNI; without it 8 for Q8_0/Q4_0 and their _R8 forms, 96 for the block types of
  quant.simd_blocks, any number for the _R4 types with kernels of their own; 16 for
  F16/BF16): x is quantized once to int8 + f32 scale per 32 (with int sums per 32 or 16) and
  the block rows are dotted with it using integer block sums (quant.simd, quant.simd_blocks,
  quant.simd_r4; from quant.kernels.GEMM_MIN tokens on, quant.simd_gemm's integer GEMM on
  16-row tiles; F16 / BF16 rows are decoded row by row and dotted in f32), parallel over
  output rows (numba prange).
* many tokens: a tile of rows (about TILE_BYTES of f32) is decoded into a reusable scratch
  buffer and multiplied with BLAS (numpy matmul), tile after tile; at no point is more
  than one tile of the weight matrix held in f32.  Cost grows slowly with n.
* F32 weights go to BLAS directly (the strided view of the bytes is already a matrix).

The crossovers were measured on a Zen 4 core (4096 x 4096): Q8_0 few-token costs ~2 ms
per token, the tile path ~13 ms + ~0.35 ms per token.

Weights may be non-contiguous views (one expert of a 3-D memory-mapped tensor, rows
spaced further apart than their length): only the byte span from the first to the last
row is viewed, never copied, as long as each row is one contiguous run of bytes.  One
exception: products of a few rows take Q8_0 / Q4_0 matrices of short rows (<= SHORT_ROWS
values) in their _R8 form, repacked once into a copy kept on the tensor (_short_rows_form).

Threads: everything runs in numba's pool.  The tile path's BLAS calls are made by the pool's
threads themselves (quant.gemm, one serial OpenBLAS call per thread) where numpy's BLAS allows
it, and set_num_threads(n) then keeps OpenBLAS at one thread: two pools on the same cores
busy-wait against each other (quant.blas_threads).  Without a callable BLAS the tiles are
decoded in parallel and handed to numpy's matmul, and OpenBLAS gets n threads.  quant.kernels
sets numba's OpenMP wait policy (PASSIVE with a spin) before the pool starts, which only works
if quant is imported before numba runs its first parallel function.  TILE_DEQUANT_THREADS can
cap the numba threads used by the tile path.

Mixture-of-experts entry points (ggml's mul_mat_id and ik_llama.cpp's fused moe_up_gate):
matmul_id(w, x, ids, x_rows) multiplies a 3-D expert tensor with P (expert, activation row)
pairs and moe_up_gate(gate, up, ...) returns silu(gate . x) * (up . x) for such pairs, each
in one call for all pairs.  Pairs are grouped by expert; an expert with fewer than
many_tokens(type) pairs goes to one integer/float kernel call shared by all such experts
(the weight row base depends on the pair's expert), the others go expert by expert through
the tile + BLAS path.  Activation rows are quantized once, whatever the number of pairs
and tensors using them.  up_gate(gate, up, x) is the same fused op for 2-D (dense) weights;
matmul_heads(w, x) is a product batched over heads (w (H, rows, cols), x (T, H, cols)), the
pairs (h, t * H + h) of matmul_id.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple

import numba
import numpy as np

from . import gemm as G
from . import kernels as K
from .blas_threads import get_blas_threads, set_blas_threads
from . import reference
from .tensor import QTensor, f32_qtensor
from . import registry
from .types import BF16, F16, F32, Q8_0, interleaved_form, type_info
from .typetag import QType
from .kernels import tag

MANY_TOKENS = 16          # from this many activation rows on, use dequantized tiles + BLAS
_MANY_TOKENS_INT = 8      # ... and this many for Q8_0 / Q4_0 without VNNI or AVX2 (see many_tokens)
_MANY_TOKENS_BLOCKS = 96  # ... for the block types of quant.simd_blocks without VNNI or AVX2
TILE_BYTES = 4 << 20      # target size of the f32 scratch tile
# Numba threads that decode a tile (None: all of numba's).  Decoding is ~1-2 % of the work
# of a many-token matmul; see the module docstring on thread pools fighting.
TILE_DEQUANT_THREADS: int | None = None

# every type whose rows quant.kernels.decode_row decodes; types without integer dot kernels
# (F16, BF16, IQ4_KSS) go through the f32-decode paths (matvec_float, tiles + BLAS)
_SUPPORTED = registry.COMPUTE_TYPES
# quant.simd's types: per-32 int activation sums (their row dots), the f32 per-16 ones only for
# quant.simd_gemm, which packs them too
_Q8_SIMD = frozenset(t for t, r in registry.TRAITS.items() if r.act == registry.ACT_Q8_32)
# the types whose GEMM reads one activation scale per 256 values (ik's Q8_K; registry.ACT_Q8_256)
_Q8_K = frozenset(t for t, r in registry.TRAITS.items() if r.act == registry.ACT_Q8_256)
_ELEM = {F32: 4, F16: 2, BF16: 2}   # alignment the kernels' views need (1 byte for block types)


def set_num_threads(n: int, blas: int | None = None) -> None:
    """Threads for matmul: numba's pool gets n, numpy's OpenBLAS gets `blas` (default: 1 where
    quant.gemm runs the GEMMs inside numba's pool, else n).

    numba.set_num_threads is per calling thread; the BLAS setting is process-wide.
    """
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))
    set_blas_threads(int((1 if G.available() else n) if blas is None else blas))


def get_num_threads() -> tuple[int, int | None]:
    """(numba threads, BLAS threads or None when numpy's BLAS is not OpenBLAS)."""
    return numba.get_num_threads(), get_blas_threads()


def has_interleaved_kernel(qtype: int) -> bool:
    """Whether an _R4/_R8 type has kernels of its own (faster than its plain type's); the others
    are computed by unpacking their rows to the plain type first."""
    tr = registry.TRAITS.get(int(qtype))
    return tr is not None and tr.info.interleave > 0 and tr.dot != registry.DOT_UNPACK


def supported(qtype: int) -> bool:
    """True when matmul / get_rows / dequantize handle this type id (quantize_tensor: see quant.reference)."""
    return int(qtype) in _SUPPORTED


def _check(qtype: int) -> None:
    if not supported(qtype):
        raise NotImplementedError(f"no kernels for tensor type {type_info(qtype).name}")


class _View(NamedTuple):
    """A weight tensor in the kernels' calling convention: expert e, row r starts at byte
    e * estride + r * stride of buf (estride = 0 for a 2-D tensor)."""
    buf: np.ndarray
    estride: int
    stride: int
    n_expert: int
    rows: int
    cols: int
    row_bytes: int
    qtype: int
    tag: QType      # what the kernels get: compiled for this type only (quant.typetag)


def _view(w: QTensor, few: bool = False) -> _View:
    """A 2-D (rows, row_bytes) or 3-D (expert, rows, row_bytes) tensor as one byte buffer, not
    copied unless a row is not one contiguous run of bytes, or a spacing is negative or
    misaligned for the type's elements.  few: the form for products of a few activation rows
    (_short_rows_form).  Kept on the QTensor: token generation calls ~100 matmuls per token and
    building the view cost ~20 us each (2.5 ms a token on the 1B model)."""
    key = "_few_view" if few else "_kernel_view"
    v = w.__dict__.get(key)
    if v is None or v[0] is not w.data:
        v = (w.data, _short_rows_form(_view(w)) if few else _make_view(w))
        w.__dict__[key] = v
    return v[1]


# Products of a few activation rows (generation) multiply Q8_0 / Q4_0 matrices whose rows hold at
# most this many values in their _R8 form, repacked once into the tensor's few-row view (a copy
# in memory: DeepSeek's per-head attn_k_b, 128 values a row, and attn_v_b, 512).  The plain row
# dots pay a reduction and a store per row, which short rows do not amortize; the _R8 kernels
# finish 8 rows together.  scripts/bench_matmul.py, one token, one thread: Q8_0 8192 x 128 43
# against Q8_0_R8 87 GFLOP/s, Q4_0 42 / 96, Q8_0 2048 x 512 64 / 112.  Only with VNNI, where this
# was measured.  Many-row products keep the plain view: the GEMM is as fast on it, and the
# tensors made per call (row_block's, in prompt attention) are not repacked each time.  The
# K-quant / IQK types with _R4 kernels go the same way: DeepSeek's attn_v_b (16 heads x 128 x
# 512) in IQ4_K took 135 us a token call at two threads (4.4 GB/s), IQ4_K_R4 33-45 us.
SHORT_ROWS = 512
_SHORT_R8 = {t: f.id for t in registry.TRAITS if (f := interleaved_form(t)) is not None
             and has_interleaved_kernel(f.id)}      # plain type id -> its _R4 / _R8 type id


# 32-value blocks of one f16 scale d whose values are d times an integer level within int8
# (Q5_0: -16..15, Q6_0: -32..31, IQ4_NL: its table, -127..113): their short rows become Q8_0_R8
# rows holding the same values exactly (each level stored as an int8 under the same d).  DeepSeek's
# attn_k_b falls back to such a type where 128-value rows rule out the 256-blocks; its one-token
# product, 16 heads x 512 x 128 in Q5_0, took 109 us against Q8_0's 31 (one thread; 128 heads
# 791 against 221): the generic block dots pay a reduction and a store per 4-block row.  ik's
# default mixtures and the seeds' recipes keep attn_k_b in Q8_0; --pure files and recipes that
# put attention in a K-quant / IQK type reach these fallbacks.
_EXACT_IN_Q8_0 = frozenset(type_info(n).id for n in ("Q5_0", "Q6_0", "IQ4_NL"))


def _exact_q8_0(rows: np.ndarray, qtype: int, cols: int) -> np.ndarray | None:
    """rows (n, row_bytes) of a type of _EXACT_IN_Q8_0 as Q8_0 rows with the same values (d kept,
    level = value / d), or None where a value is not d times an int8 (a corrupt scale)."""
    n, nb = rows.shape[0], cols // 32
    d16 = np.ascontiguousarray(rows.reshape(n, nb, -1)[:, :, :2]).view(np.float16)[:, :, 0]
    vals = get_rows(QTensor(rows, qtype, (n, cols)), np.arange(n)).reshape(n, nb, 32)
    q = np.empty((n, nb, 32), np.int8)
    if not K.int8_levels(vals, d16.astype(np.float32), q):
        return None
    out = np.empty((n, nb, 34), np.uint8)
    out[:, :, :2] = d16.view(np.uint8).reshape(n, nb, 2)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(n, nb * 34)


def _short_rows_form(v: _View) -> _View:
    qt = Q8_0 if v.qtype in _EXACT_IN_Q8_0 else v.qtype
    r8 = _SHORT_R8.get(qt)
    if r8 is None or not K.HAS_SHORT_R8 or v.cols > SHORT_ROWS or v.rows % type_info(r8).interleave or v.rows == 0:
        return v
    from .interleaved import repack
    n = v.n_expert * v.rows
    rows = np.lib.stride_tricks.as_strided(v.buf, shape=(v.n_expert, v.rows, v.row_bytes),
                                           strides=(v.estride, v.stride, 1)).reshape(n, v.row_bytes)
    if qt != v.qtype:
        rows = _exact_q8_0(np.ascontiguousarray(rows), v.qtype, v.cols)
        if rows is None:
            return v
    raw = repack(rows, qt, n, v.cols, r8)
    shape = (v.n_expert, v.rows, v.cols) if v.n_expert > 1 else (v.rows, v.cols)
    return _make_view(QTensor(raw.reshape(*shape[:-1], raw.shape[-1]), r8, shape))


def _make_view(w: QTensor) -> _View:
    _check(w.qtype)
    w = plain_if_no_kernel(w)
    data = w.data
    if data.ndim not in (2, 3):
        raise ValueError(f"expected weights of shape (rows, row_bytes) or (experts, rows, row_bytes), "
                         f"got data of shape {data.shape}")
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    d3 = data if data.ndim == 3 else data[None]
    ne, rows, rb = d3.shape
    cols = w.cols
    if rb != type_info(w.qtype).row_bytes(cols):
        raise ValueError(f"row of {rb} bytes does not hold {cols} {type_info(w.qtype).name} values")
    el = _ELEM.get(w.qtype, 1)
    es = d3.strides[0] if ne > 1 else 0
    stride = d3.strides[1] if rows > 1 else rb
    if d3.strides[2] != 1 or stride < rb or es < 0 or stride % el or es % el or \
            d3.__array_interface__["data"][0] % el:
        d3 = np.ascontiguousarray(d3)
        es, stride = (rows * rb if ne > 1 else 0), rb
    span = (ne - 1) * es + (rows - 1) * stride + rb if rows and ne else 0
    if d3.flags.c_contiguous:        # the usual case, ~10x cheaper than as_strided
        buf = K.readonly(d3.reshape(-1))
    else:
        buf = np.lib.stride_tricks.as_strided(d3, shape=(span,), strides=(1,), writeable=False)
    return _View(buf, int(es), int(stride), int(ne), int(rows), int(cols), int(rb), int(w.qtype), tag(w.qtype))


def plain_if_no_kernel(w: QTensor) -> QTensor:
    """An _R4/_R8 tensor without kernels of its own (Q2_K_R4, Q3_K_R4, IQ4_NL_R4, IQ4_XS_R8,
    Q8_K_R8) as its plain type's rows, unpacked (a new QTensor; any other tensor: w itself):
    the plain type's integer kernels, and the same activation rounding as the plain type on
    every path.  The engine calls it at load (engine.model), so models never pay it on first
    use; matmul's views call it for other callers (the view keeps the result)."""
    from .interleaved import plain_type, unpack_fast
    ti = type_info(w.qtype)
    if not ti.interleave or has_interleaved_kernel(w.qtype) or w.data.ndim not in (2, 3):
        return w
    nrows = w.data.size // w.data.shape[-1]
    raw = np.ascontiguousarray(w.data).reshape(nrows, -1)
    if w.cols % type_info(plain_type(w.qtype)).block_size:   # IQ1_S_R4 rows not whole IQ1_S blocks: f32
        return f32_qtensor(registry.traits(w.qtype).dequantize(raw, nrows * w.cols, w.cols).reshape(w.shape))
    raw = unpack_fast(raw, w.qtype, nrows, w.cols)
    return QTensor(raw.reshape(*w.data.shape[:-1], raw.shape[-1]), plain_type(w.qtype), w.shape)


def _expert(v: _View, e: int) -> _View:
    """Expert e of a view as a 2-D view (a slice of the same buffer)."""
    o = e * v.estride
    span = (v.rows - 1) * v.stride + v.row_bytes if v.rows else 0
    return v._replace(buf=v.buf[o:o + span], estride=0, n_expert=1)


def _need_2d(w: QTensor) -> None:
    if w.data.ndim != 2:
        raise ValueError(f"expected a 2-D weight (rows, row_bytes), got data of shape {w.data.shape}; "
                         "select an expert first (w[i])")


def _rows_view(w: QTensor) -> tuple[np.ndarray, int, int, int, int]:
    """(buf, stride, rows, cols, qtype) of a 2-D weight tensor in the kernels' calling convention
    (qtype: the view's, the plain type for an unpacked _R4/_R8 tensor)."""
    _need_2d(w)
    v = _view(w)
    return v.buf, v.stride, v.rows, v.cols, v.qtype


def _as_act(x: np.ndarray, cols: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"activations must be (n, {cols}), got {x.shape}")
    return x


def many_tokens(qtype: int) -> int:
    """Number of activation rows from which matmul switches to the tile + BLAS path.

    With AVX512-VNNI or AVX2 every integer type never switches: from quant.kernels.GEMM_MIN rows on
    its kernels run quant.simd_gemm's integer GEMM (one thread, 4096 x 4096, n = 512: 71-77 ms
    against 191-197 for the tiles with VNNI; AVX2, Zen 3: Q4_K 197 against 254, README).  The
    rest is for CPUs with neither: there the _R4 kernels still beat the tiles
    at every count (2 threads, n = 512: 84 vs 126 ms for Q4_K_R4, 80 vs 128 for IQ2_K_R4), and
    the plain block types' row dots break even with the tiles near 96 rows (one thread, int vs
    tiles: Q4_K 21.3 vs 28.0 ms at 48, 46.4 vs 44.7 at 96; Q6_K 24.3 vs 31.5 and 44.5 vs 46.8;
    IQ4_K 21.6 vs 33.4 and 48.7 vs 49.5).  A MoE prompt of 512 tokens gives each of 64 experts
    ~48.  Q8_0 / Q4_0 below GEMM_MIN keep quant.simd's row dots: one thread, 4096^2, n = 8 / 11,
    5.1 / 6.8 ms (Q4_0 4.7 / 6.2) against 13.5 / 15.7 (14.3 / 17.0) for the tiles."""
    tr = registry.TRAITS[qtype]
    if tr.dot == registry.DOT_R4 or (K.HAS_GEMM and tr.integer_dot):
        return 1 << 62
    if tr.dot == registry.DOT_BLOCK:
        return _MANY_TOKENS_BLOCKS
    return _MANY_TOKENS_INT if tr.dot == registry.DOT_Q8 else MANY_TOKENS


def tile_rows(cols: int, rows: int) -> int:
    """Rows per f32 scratch tile in the many-token path (a multiple of 16, 16..512)."""
    t = TILE_BYTES // (4 * max(cols, 1))
    t = max(16, min(512, t)) // 16 * 16
    return min(t, rows) if rows else 16


def matmul(w: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x @ W.T for x of shape (n, cols): returns (n, rows) f32 (written into `out` if given)."""
    _need_2d(w)
    v = _view(w, len(x) < K.GEMM_MIN)
    x = _as_act(x, v.cols)
    n = x.shape[0]
    if out is None:
        out = np.empty((n, v.rows), dtype=np.float32)
    elif out.shape != (n, v.rows) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {(n, v.rows)}, got {out.dtype} {out.shape}")
    if n == 0 or v.rows == 0:
        return out
    target = out if out.flags.c_contiguous else np.empty((n, v.rows), dtype=np.float32)

    if v.qtype == F32:
        G.gemm(x, _f32_matrix(v), target)
    elif n < many_tokens(v.qtype) and _fused_act(v.qtype, x, n):
        K.matvec_act(v.tag, v.buf, v.estride, v.stride, v.buf, v.estride, v.stride, False, v.rows, v.cols, K.QK,
                     K.F16_TO_F32, x, v.qtype not in _Q8_SIMD, _NO_ROWS, _ONE_GROUP, _GB[n], target, target)
    elif n < many_tokens(v.qtype):
        _few_pairs(v, None, _act(v.qtype, x), _ONE_GROUP, np.array([0, n], np.int64), target)
    else:
        with _tile_threads():
            _tiles(v, _round_act(v.qtype, x), target)
    if target is not out:
        out[...] = target
    return out


_ONE_GROUP = np.zeros(1, dtype=np.int64)   # ge of a plain matmul: every pair uses expert 0
_GB = [np.array([0, n], np.int64) for n in range(64)]   # its gb for n tokens
_NO_ROWS = np.zeros(0, dtype=np.int64)      # matvec_act: pair k takes activation row k
_FUSED_ACT_MAX = 65536      # activation values quantized on the calling thread (as _quantize_act)


def _fused_act(qt: int, x: np.ndarray, n_pairs: int) -> bool:
    """Whether a product of these activations goes through K.matvec_act (quantization and row
    dots in one compiled call): an integer type, few pairs (no expert reaches the GEMM), a small x.
    The caller has checked that the row dots are the path for that many pairs (many_tokens: a
    CPU without VNNI or AVX2 hands Q8_0 from 8 rows, the block types from 96, to the tiles).  The
    activation arrays matvec_act makes are _act's for these types (no GEMM: per-16 sums except
    for the Q8_0 / Q4_0 family, no c16)."""
    return qt in K.INT_DOT_TYPES and n_pairs < min(K.GEMM_MIN, len(_GB)) and x.size < _FUSED_ACT_MAX


def _f32_matrix(v: _View) -> np.ndarray:
    """An F32 tensor's (single expert) rows as a strided f32 matrix view of the bytes (a reshape
    when the rows are packed: as_strided cost ~5 us per router product of a token)."""
    f = v.buf.view(np.float32)
    if v.stride == v.row_bytes and f.size == v.rows * v.cols:
        return f.reshape(v.rows, v.cols)
    return np.lib.stride_tricks.as_strided(f, shape=(v.rows, v.cols), strides=(v.stride, 4), writeable=False)


def _quantize_act(x: np.ndarray, sums16: bool = True, ints16: bool = True, tile: bool = False,
                  per256: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x (n, cols) -> (q, s, bs, b16, c16): int8 values, one scale per 32 (ik_llama.cpp's Q8_2 rule,
    see kernels; per256: its Q8_K rule, one scale per 256 written to each of its 32s), and
    activation sums: bs = the int32 sum of each 32 values, or with sums16 and
    ints16 (the block types' per-16 scales, level offsets and mins) of each 16; b16 = with
    sums16 the sum of each 16 times its scale (f32), else an (n, 0) array; c16 = with sums16 and
    tile (some expert gets GEMM_MIN pairs) -128 times the int sum of each 16 (the tile GEMM's,
    quant.simd_gemm), else an (n, 0) array (a generated token makes none)."""
    q = np.empty(x.shape, dtype=np.int8)
    s = np.empty((x.shape[0], x.shape[1] // K.QK), dtype=np.float32)
    bs = np.empty((x.shape[0], x.shape[1] // (16 if sums16 and ints16 else K.QK)), dtype=np.int32)
    # parallel only for big inputs: in token generation the pool has usually gone to sleep, and the
    # parallel call for an MLA per-head product (16 heads x 128 values) averaged ~27 us in the 1B
    # model (cProfile), the serial one ~3.6 us
    b16 = np.empty((x.shape[0], x.shape[1] // 16 if sums16 else 0), dtype=np.float32)
    c16 = np.empty((x.shape[0], x.shape[1] // 16 if sums16 and tile else 0), dtype=np.int32)
    qk = 256 if per256 else K.QK
    if x.size < 65536:
        K.quantize_act_q8_serial(x, qk, q, s, bs, b16, c16)
    elif sums16:
        K.quantize_act_q8_sums(x, qk, q, s, bs, b16, c16)
    else:
        K.quantize_act_q8(x, qk, q, s, bs)
    return q, s, bs, b16, c16


def _act(qt: int, x: np.ndarray, n_pairs: int | None = None) -> tuple[np.ndarray, ...]:
    """The few-pair kernels' activations: (q, s, bs, b16, c16) for the integer types, (x,) for the
    others.  Q8_0 / Q4_0 keep per-32 int sums (quant.simd) and get the f32 per-16 ones when
    enough pairs (n_pairs: the most that one expert gets; default: the rows of x) come to reach
    quant.simd_gemm.  The types of ik's Q8_K GEMM get one scale per 256 values when the GEMM runs
    (the few-pair kernels read the same layout; the GEMM then scales once per 256: a 4096^2
    IQ4_XS product of 512 rows ~10 % faster)."""
    if qt not in K.INT_DOT_TYPES:
        return (x,)
    tile = (x.shape[0] if n_pairs is None else n_pairs) >= K.GEMM_MIN
    if qt in _Q8_SIMD:
        return _quantize_act(x, tile, False, tile)
    return _quantize_act(x, tile=tile, per256=tile and qt in _Q8_K)


def _round_act(qt: int, x: np.ndarray, act: tuple[np.ndarray, ...] = ()) -> np.ndarray:
    """The tile path's activations: Q8-rounded for the integer types (see _q8_rounded; act: x's
    _act, if already computed), else x."""
    return _q8_rounded(x, act or None) if qt in K.INT_DOT_TYPES else x


def _few_pairs(va: _View, vb: _View | None, act: tuple[np.ndarray, ...], ge: np.ndarray,
               gb: np.ndarray, out: np.ndarray) -> None:
    """Integer / float dot kernels for pairs gb[g]:gb[g+1] of expert ge[g]; act and out have
    one row per pair (vb given: out = silu(a . x) * (b . x))."""
    fused = vb is not None
    vb = vb if fused else va
    outb = np.empty_like(out) if fused else out     # the kernels' scratch for b's products
    geo = (va.buf, va.estride, va.stride, vb.buf, vb.estride, vb.stride, fused, va.rows, va.cols,
           K.QK, K.F16_TO_F32)
    kern = K.matvec_int if va.qtype in K.INT_DOT_TYPES else K.matvec_float
    kern(va.tag, *geo, *act, ge, gb, out, outb)


def _q8_rounded(x: np.ndarray, qs: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
    """x after a round trip through the Q8 activation blocks of the few-token path
    (qs: x already quantized).

    GGML multiplies Q8_0 / Q4_0 weights with activations quantized this way; doing the same
    before BLAS makes a token's result independent of the batch it came in. Measured with it:
    perplexities within 0.2% of ik_llama.cpp's (-mla 0) on the random Q8_0/Q4_0 models of
    scripts/compare_perplexity.py, except the chaotic 26-layer Lite one (1.8%, README).
    """
    q, s = (_quantize_act(x, False) if qs is None else qs)[:2]
    return (q.reshape(x.shape[0], -1, K.QK).astype(np.float32) * s[:, :, None]).reshape(x.shape)


@contextmanager
def _tile_threads() -> Iterator[None]:
    """Numba threads for tile decoding (TILE_DEQUANT_THREADS) while the block runs."""
    nt = numba.get_num_threads()
    try:
        numba.set_num_threads(nt if TILE_DEQUANT_THREADS is None else max(1, min(nt, TILE_DEQUANT_THREADS)))
        yield
    finally:
        numba.set_num_threads(nt)


def _tiles(v: _View, x: np.ndarray, out: np.ndarray) -> None:
    """out = x @ W.T for a single-expert view, W decoded tile by tile (x already rounded): in
    numba's pool where quant.gemm can call BLAS there (one parallel region for the whole
    product), else tiles decoded in parallel and handed to numpy's matmul."""
    tr = tile_rows(v.cols, v.rows)
    if G.available() and out.flags.c_contiguous and x.flags.c_contiguous:
        G.gemm_tiles(v.buf, v.tag, v.stride, v.rows, v.cols, K.F16_TO_F32, x, out,
                     max(16, tr // max(1, numba.get_num_threads()) // 16 * 16), K.QK)
        return
    tile = np.empty((tr, v.cols), dtype=np.float32)
    ids = np.arange(v.rows, dtype=np.int64)
    for r0 in range(0, v.rows, tr):
        r1 = min(v.rows, r0 + tr)
        t = tile[:r1 - r0]
        K.dequant_rows(v.buf, v.tag, v.stride, ids[r0:r1], v.cols, K.QK, K.F16_TO_F32, t)
        np.matmul(x, t.T, out=out[:, r0:r1])


def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u in place of g, the same f32 operations as engine.ops.silu then *=."""
    with np.errstate(over="ignore"):       # exp(-g) -> inf for g < -88: silu -> -0
        g /= np.float32(1.0) + np.exp(-g)
    g *= u
    return g


def matmul_id(w: QTensor, x: np.ndarray, ids: np.ndarray, x_rows: np.ndarray) -> np.ndarray:
    """Pair p of (expert ids[p], activation row x_rows[p]): out[p] = W[ids[p]] @ x[x_rows[p]].

    w: (n_expert, rows, cols) (a 2-D tensor counts as one expert); x: (n_x, cols) f32;
    returns (P, rows) f32.  Only experts that appear in ids are read.
    """
    return _mul_id(w, None, x, ids, x_rows)


def matmul_heads(w: QTensor, x: np.ndarray) -> np.ndarray:
    """y[t, h] = W[h] @ x[t, h] for W (H, rows, cols) and x (T, H, cols): a product batched over
    heads (DeepSeek's absorbed attn_k_b / attn_v_b); returns (T, H, rows) f32.  One token goes
    to the pair kernels directly, head h as pair h (matmul_id's plan for that case, without its
    grouping pass and gathers: ~14 us a call in token generation); more tokens are matmul_id's
    pairs (h, row t * H + h)."""
    T, H, cols = x.shape
    v = _view(w, T == 1)
    if v.n_expert != H:
        raise ValueError(f"{H} heads of activations for a weight of {v.n_expert} heads")
    x2 = _as_act(x.reshape(T * H, cols), v.cols)
    if T == 1 and H < len(_RANGES) and v.qtype in K.INT_DOT_TYPES and _fused_act(v.qtype, x2, 1):
        out = np.empty((H, v.rows), dtype=np.float32)
        K.matvec_act(v.tag, v.buf, v.estride, v.stride, v.buf, v.estride, v.stride, False, v.rows, v.cols, K.QK,
                     K.F16_TO_F32, x2, v.qtype not in _Q8_SIMD, _NO_ROWS, _RANGES[H], _RANGES[H + 1], out, out)
        return out.reshape(1, H, v.rows)
    ids = np.tile(_RANGES[H] if H < len(_RANGES) else np.arange(H, dtype=np.int64), T)
    return _mul_id(w, None, x2, ids, np.arange(T * H, dtype=np.int64)).reshape(T, H, v.rows)


_RANGES = [np.arange(n, dtype=np.int64) for n in range(257)]   # ge / gb of matmul_heads' one-token plan


def moe_up_gate(gate: QTensor, up: QTensor, x: np.ndarray, ids: np.ndarray,
                x_rows: np.ndarray) -> np.ndarray:
    """silu(gate[ids[p]] @ x[x_rows[p]]) * (up[ids[p]] @ x[x_rows[p]]) for every pair p, in one
    call: activations quantized once; on the kernel path a work item computes a run of gate
    rows and the same up rows for its pairs and applies SiLU*mul itself; on the tile path
    each expert's gate and up products share the gathered activations.

    Same values as matmul_id(gate, ...) and matmul_id(up, ...) combined with NumPy's silu
    (bitwise on the tile path and for F32; within an ulp of exp on the kernel path).
    Falls back to the two separate products when gate and up differ in type.
    """
    vg, vu = _view(gate), _view(up)
    if vg.qtype != vu.qtype:
        return _silu_mul(_mul_id(gate, None, x, ids, x_rows), _mul_id(up, None, x, ids, x_rows))
    if (vg.n_expert, vg.rows, vg.cols) != (vu.n_expert, vu.rows, vu.cols):
        raise ValueError(f"gate {gate.shape} and up {up.shape} differ in shape")
    return _mul_id(gate, up, x, ids, x_rows)


def up_gate(gate: QTensor, up: QTensor, x: np.ndarray) -> np.ndarray:
    """silu(x @ G.T) * (x @ U.T) for 2-D weights (a dense SiLU MLP's first half), fused as in
    moe_up_gate.  A few rows go to the pair kernels directly (moe_up_gate's plan for one expert,
    without its grouping pass: ~8 us a call in generation)."""
    x = np.asarray(x)
    n = x.shape[0]
    if gate.data.ndim == 2 and up.data.ndim == 2 and n < len(_GB):
        vg, vu = _view(gate, True), _view(up, True)
        if vg.qtype == vu.qtype and (vg.rows, vg.cols) == (vu.rows, vu.cols) and vg.qtype in K.INT_DOT_TYPES:
            x = _as_act(x, vg.cols)
            if n and vg.rows and _fused_act(vg.qtype, x, n):
                out = np.empty((n, vg.rows), dtype=np.float32)
                K.matvec_act(vg.tag, vg.buf, vg.estride, vg.stride, vu.buf, vu.estride, vu.stride, True, vg.rows,
                             vg.cols, K.QK, K.F16_TO_F32, x, vg.qtype not in _Q8_SIMD, _NO_ROWS, _ONE_GROUP, _GB[n],
                             out, np.empty_like(out))
                return out
    return moe_up_gate(gate, up, x, np.zeros(n, np.int64), np.arange(n, dtype=np.int64))


def _mul_id(wa: QTensor, wb: QTensor | None, x: np.ndarray, ids: np.ndarray,
            x_rows: np.ndarray) -> np.ndarray:
    """matmul_id (wb None) or the fused up/gate product (wb: up) for pairs (ids, x_rows).  The
    pair kernels read the tensors' few-row views (_short_rows_form; with VNNI every pair goes to
    them, the GEMM of an expert's many pairs included), the tile path the plain ones."""
    va, vb = _view(wa), None if wb is None else _view(wb)
    x = _as_act(x, va.cols)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    x_rows = np.ascontiguousarray(x_rows, dtype=np.int64).reshape(-1)
    if ids.shape != x_rows.shape:
        raise ValueError(f"{ids.size} expert ids but {x_rows.size} activation rows")
    P = ids.size
    out = np.empty((P, va.rows), dtype=np.float32)
    if P == 0 or va.rows == 0:
        return out
    # F32 goes to BLAS straight on the bytes whatever the count; other types by pair count
    many = 1 if va.qtype == F32 else many_tokens(va.qtype)
    try:
        order, counts, few, ge, gb, rows_identity, order_identity = K.group_pairs(ids, x_rows, va.n_expert, x.shape[0], many)
    except IndexError as e:
        lim = va.n_expert if "expert" in str(e) else x.shape[0]
        raise IndexError(f"{e} 0..{lim - 1}") from None
    if few == P and _fused_act(va.qtype, x, int(counts.max())):   # a generated token's experts, per-head products
        po = order[:few]
        rows = _NO_ROWS if rows_identity and few == x.shape[0] else x_rows[po]
        identity = order_identity
        res = out if identity else np.empty((few, va.rows), dtype=np.float32)
        fa = _view(wa, True)
        fb = fa if wb is None else _view(wb, True)
        K.matvec_act(fa.tag, fa.buf, fa.estride, fa.stride, fb.buf, fb.estride, fb.stride, wb is not None,
                     fa.rows, fa.cols, K.QK, K.F16_TO_F32, x, fa.qtype not in _Q8_SIMD, rows, ge, gb, res,
                     np.empty_like(res) if wb is not None else res)
        if not identity:
            out[po] = res
        return out
    # every activation row quantized once; the per-16 sums of Q8_0 / Q4_0 only when one expert
    # gets enough pairs for the GEMM
    # the few-row form may be another type's (_short_rows_form), with activation blocks of its own:
    # x is then quantized for it, and for the plain type only when pairs go to the tiles too
    fa = _view(wa, True) if few else None
    own = fa is not None and fa.qtype != va.qtype and registry.traits(fa.qtype).act != registry.traits(va.qtype).act
    act_x = () if va.qtype == F32 or (own and few == P) else _act(va.qtype, x, int(counts.max()))
    if few:
        po = order[:few]                            # the few-pair pairs, grouped by expert
        act = _act(fa.qtype, x, int(counts.max())) if own else act_x
        if not (rows_identity and few == x.shape[0]):
            act = tuple(_gather(a, x_rows[po]) for a in act)   # one row per pair
        identity = few == P and order_identity
        res = out if identity else np.empty((few, va.rows), dtype=np.float32)
        _few_pairs(fa, None if wb is None else _view(wb, True), act, ge, gb, res)
        if not identity:
            if res.size >= _PARALLEL_COPY:
                K.scatter_rows(res, po, out)
            else:
                out[po] = res
    if few < P:
        xr = _round_act(va.qtype, x, act_x)
        with _tile_threads():
            # order[few:] holds the other experts' pairs, grouped, experts ascending
            start = few
            for e in np.flatnonzero(counts >= many):
                pe = order[start:start + counts[e]]
                start += counts[e]
                xe = xr[x_rows[pe]]
                y = _product(_expert(va, e), xe)
                out[pe] = y if vb is None else _silu_mul(y, _product(_expert(vb, e), xe))
    return out


_PARALLEL_COPY = 1 << 16     # elements from which row gathers / scatters run in numba's pool


def _gather(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """a[rows] (rows of a 2-D array), in the pool when big."""
    if rows.size * a.shape[1] < _PARALLEL_COPY:
        return a[rows]
    out = np.empty((rows.size, a.shape[1]), dtype=a.dtype)
    K.gather_rows(a, rows, out)
    return out


def _product(v: _View, x: np.ndarray) -> np.ndarray:
    """x @ W.T for one expert on the BLAS side: F32 directly, other types tile by tile."""
    y = np.empty((x.shape[0], v.rows), dtype=np.float32)
    if v.qtype == F32:
        return G.gemm(x, _f32_matrix(v), y)
    _tiles(v, x, y)
    return y


def get_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W as f32, shape ids.shape + (cols,) (embedding lookup)."""
    buf, stride, rows, cols, qtype = _rows_view(w)
    ids = np.asarray(ids)
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= rows):
        raise IndexError(f"row id out of range 0..{rows - 1}")
    out = np.empty((flat.size, cols), dtype=np.float32)
    if flat.size and registry.traits(qtype).matmul_scale != 1.0:
        # the kernels' decoders carry ik's matmul factor; a lookup is ik's dequantize_row (get_rows)
        K.dequant_rows_unscaled(buf, tag(qtype), stride, flat, cols, K.QK, K.F16_TO_F32, out)
    elif flat.size:
        K.dequant_rows(buf, tag(qtype), stride, flat, cols, K.QK, K.F16_TO_F32, out)
    return out.reshape(*ids.shape, cols)


def dequantize(w: QTensor) -> np.ndarray:
    """The whole tensor as f32 of shape w.shape (meant for small tensors and tests)."""
    _check(w.qtype)
    cols = w.cols
    data = w.data.reshape(-1, w.data.shape[-1])
    flat = QTensor(data, w.qtype, (data.shape[0], cols))
    return get_rows(flat, np.arange(data.shape[0])).reshape(w.shape)


def quantize_tensor(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> QTensor:
    """Quantize f32 values of shape (..., cols) with ggml's reference rules (see quant.reference),
    with an importance matrix (cols,) if given.

    The QTensor keeps x's shape; its data is a fresh (..., row_bytes) uint8 array.
    """
    _check(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("cannot quantize a scalar")
    raw = reference.quantize(x, qtype, imatrix)
    return QTensor.from_raw(raw, qtype, x.shape)


def compile_kernels(w: QTensor) -> None:
    """Run w's type once through every product path a model takes (one token; a few; a GEMM's or a
    tile's worth; plain, per-expert and fused up/gate) on its first rows, so that Numba compiles
    its kernels (or loads them from its cache) now rather than inside the first timed pass."""
    e = w[0] if len(w.shape) == 3 else w
    rows = min(e.rows, 16)
    small = QTensor(e.data[:rows], e.qtype, (rows, e.cols))
    many = many_tokens(e.qtype)
    counts = {1, 2, min(K.GEMM_MIN, 64)} | ({many} if many < 1 << 20 else set())
    counts.add(min(G.SMALL_WORK // (rows * e.cols) + 1, 4096))     # float weights: the threaded BLAS call
    x = np.random.default_rng(0).standard_normal((max(counts), e.cols)).astype(np.float32)
    for n in sorted(counts):
        matmul(small, x[:n])
        one = np.zeros(n, dtype=np.int64)
        matmul_id(small, x[:n], one, np.arange(n, dtype=np.int64))
        moe_up_gate(small, small, x[:n], one, np.arange(n, dtype=np.int64))
