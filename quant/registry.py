"""The type registry: one record per tensor type, like ggml's type_traits.

A record (TypeTraits) binds what the rest of ikcli needs to know about a type:
- its layout (quant.types.TypeInfo);
- the family module that holds its NumPy reference codecs;
- its Numba row decoder (quant.kernels switches on the family);
- its dot kernel and the activation form that kernel reads;
- its integer-GEMM packing (quant.simd_gemm).

The registry is the only module that knows every family.  It sits above them:

    types, numeric
      -> floats, kquants_fast, kquants, legacy, iqk, iqk_quantize, iquants, ktquants, interleaved,
         iq1_r4_quantize                                                     (families, quantizers)
      -> simd, simd_blocks, simd_r4, simd_gemm                               (dot kernels)
      -> registry -> kernels -> matmul, reference                            (users)

Adding a type means adding its layout to quant.types, its codecs to a family module (which
lists it in TYPES), and, for integer kernels, a record in simd_blocks / simd_r4.  Every set of
type ids the engine uses (COMPUTE_TYPES, INT_DOT_TYPES, ...) is derived here.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np

from . import (floats, iq1_r4_quantize, iqk, iqk_quantize, interleaved, iquants, iquants_quantize, kquants,
               kquants_fast, ktquants, legacy)
from .simd_blocks import BLOCK_DOTS, GEMM_ONLY
from .simd_gemm import WEAVE
from .simd_r4 import R4_DOTS
from .types import ALL_TYPES, TypeInfo, type_info

Rows = np.ndarray          # f32 (nrows, n_per_row)

# the dot kernel a type's matmuls run (quant.kernels dispatches on these)
DOT_F32 = "f32"            # rows decoded to f32 (F32 straight to BLAS)
DOT_Q8 = "q8"              # quant.simd's integer row dots: Q8_0, Q4_0 and their _R8 forms
DOT_BLOCK = "block"        # quant.simd_blocks' integer row dots
DOT_R4 = "r4"              # quant.simd_r4's 4-row group dots
DOT_UNPACK = "unpack"      # an _R4/_R8 layout without kernels: unpacked to its plain type at load

# the activation forms those kernels read (quant.matmul makes them once per matmul)
ACT_F32 = "f32"
ACT_Q8_32 = "q8 per 32, int sums per 32"                 # ik's Q8_2 / Q8_0_X4 role
ACT_Q8_16 = "q8 per 32, int and f32 sums per 16"         # ik's Q8_K role (bsums)
# the same layout, but from quant.kernels.GEMM_MIN pairs one scale per 256 values (ik's Q8_K rule,
# for the types ik's GEMM multiplies with Q8_K: BlockDot.act256; an _R4 type takes its plain type's)
ACT_Q8_256 = "q8 per 32 or, for a GEMM, per 256; int and f32 sums per 16"


@dataclass(frozen=True)
class Family:
    """A family module's codecs, uniform over its types (see the module docstrings)."""
    module: ModuleType
    quantize: Callable[[Rows, int, np.ndarray | None], np.ndarray] | None   # ggml_quantize_chunk
    quantize_row: Callable[[np.ndarray, int], np.ndarray] | None           # quantize_row_*_ref
    dequantize: Callable[[np.ndarray, int, int], np.ndarray] | None        # the reference decoder

    @property
    def name(self) -> str:
        return self.module.__name__.rsplit(".", 1)[-1]


FAMILIES = (
    Family(floats, floats.quantize, floats.quantize_row, floats.dequantize),
    Family(legacy, legacy.quantize, legacy.quantize_row, legacy.dequantize),
    Family(kquants, kquants.quantize, kquants.quantize_row, kquants.dequantize),
    Family(iqk, iqk_quantize.quantize, None, iqk.dequantize),      # IQK: no row _ref quantizer in ik
    Family(iquants, iquants_quantize.quantize, None, iquants.dequantize),
    Family(ktquants, ktquants.quantize, None, ktquants.dequantize),
)


@dataclass(frozen=True)
class TypeTraits:
    info: TypeInfo
    family: str | None                     # quant module of its codecs (None: layout only)
    # f32 rows (nrows, n_per_row), imatrix (n_per_row,) or None -> flat bytes (ggml_quantize_chunk)
    quantize: Callable[[Rows, np.ndarray | None], np.ndarray] | None
    # the same bytes from Numba kernels (quant.kquants_fast); fast_imatrix: also with an imatrix
    quantize_fast: Callable[[Rows, np.ndarray | None], np.ndarray] | None
    fast_imatrix: bool
    # f32 values (any shape) -> flat bytes of ggml's quantize_row_<type>_ref (KV cache, from_float)
    quantize_row: Callable[[np.ndarray], np.ndarray] | None
    # flat bytes, n values, values per row (interleaved types: whole groups) -> flat f32
    dequantize: Callable[[np.ndarray, int, int | None], np.ndarray] | None
    decodes: bool                          # quant.kernels decodes its rows (the engine computes with it)
    dot: str | None                        # DOT_*: the kernel of its matmuls
    act: str | None                        # ACT_*: what that kernel reads
    gemm: int                              # quant.simd_gemm packing (WEAVE: 0 plain, 4 _R4, 8 _R8), -1 none
    # the factor ik's matmul kernels apply to the row scale (IQ2_KT 1.05, IQ3_KT 1.01): the engine's
    # decoders and dots include it; `dequantize` (ik's dequantize_row, its get_rows) does not
    matmul_scale: float = 1.0
    needs_imatrix: bool = False            # its quantizer requires an importance matrix (ggml_quantize_requires_imatrix)

    @property
    def id(self) -> int:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def integer_dot(self) -> bool:
        return self.dot in (DOT_Q8, DOT_BLOCK, DOT_R4)


def _plain_record(ti: TypeInfo, fam: Family | None) -> TypeTraits:
    t = ti.id
    fast = None
    if t in kquants_fast.FAST_TYPES:
        fast = (lambda x, im, t=t: kquants_fast.quantize(x, t, im))
    # an internal compute form (quant.types) is never written
    q = None if fam is None or fam.quantize is None or ti.internal else (lambda x, im, f=fam.quantize, t=t: f(x, t, im))
    qr = None if fam is None or fam.quantize_row is None or ti.internal else (lambda x, f=fam.quantize_row, t=t: f(x, t))
    dq = None
    if fam is not None and fam.dequantize is not None:    # types with per-row metadata read rows of npr
        dq = (lambda raw, n, npr=None, f=fam.dequantize, t=t: f(raw, t, n, npr)) if ti.row_meta else \
            (lambda raw, n, npr=None, f=fam.dequantize, t=t: f(raw, t, n))
    if t in GEMM_ONLY:
        dot, act = DOT_Q8, ACT_Q8_32
    elif t in BLOCK_DOTS:
        dot, act = DOT_BLOCK, (ACT_Q8_256 if BLOCK_DOTS[t].act256 else ACT_Q8_16)
    elif fam is not None:
        dot, act = DOT_F32, ACT_F32
    else:
        dot = act = None
    # kquants_fast has no Q4_0 imatrix fit: that one stays on the NumPy reference
    return TypeTraits(ti, fam.name if fam else None, q, fast, t != legacy.Q4_0_ID, qr, dq,
                      fam is not None, dot, act, WEAVE.get(t, -1), ktquants.MATMUL_SCALE.get(t, 1.0),
                      t in iquants.REQUIRES_IMATRIX)


def _interleaved_record(ti: TypeInfo, plain: dict[int, TypeTraits]) -> TypeTraits:
    t = ti.id
    base = plain.get(interleaved.plain_type(t))

    def quantize_plain(x: Rows, qt: int, im: np.ndarray | None) -> np.ndarray:
        if im is None and plain[qt].needs_imatrix:     # ik's _R4 quantizers run without one
            return iquants_quantize.quantize(x, qt, None, require_imatrix=False)
        return plain[qt].quantize(x, im)

    def dequantize_plain(raw: np.ndarray, qt: int, n: int) -> np.ndarray:
        return plain[qt].dequantize(raw, n, n)

    def dq(raw: np.ndarray, n: int, npr: int | None = None) -> np.ndarray:
        npr = n // ti.interleave if npr is None else npr
        if npr <= 0 or n % (npr * ti.interleave):
            raise ValueError(f"{ti.name}: {n} values are not whole groups of {ti.interleave} rows of {npr}")
        return interleaved.dequantize(raw, t, n // npr, npr, dequantize_plain).reshape(-1)

    if t in R4_DOTS:
        # its plain type's activations (ACT_Q8_16 / ACT_Q8_256): -rtr then gives the plain results exactly
        dot, act = DOT_R4, base.act
    elif t in WEAVE:                                       # Q8_0_R8, Q4_0_R8: quant.simd's row dots
        dot, act = DOT_Q8, ACT_Q8_32
    else:
        dot, act = DOT_UNPACK, (base.act if base else None)
    if t in interleaved.NOT_REPACKED:        # ik's own quantizers (quant.iq1_r4_quantize)
        q = (lambda x, im: iq1_r4_quantize.quantize(x, t, im).reshape(-1))
    else:
        q = (lambda x, im: interleaved.quantize(x, t, im, quantize_plain))
    return TypeTraits(ti, "interleaved", q,
                      None, False, None, dq, base is not None and base.decodes, dot, act, WEAVE.get(t, -1),
                      needs_imatrix=False)


def _build() -> dict[int, TypeTraits]:
    fam_of = {t: f for f in FAMILIES for t in f.module.TYPES}
    plain = {ti.id: _plain_record(ti, fam_of.get(ti.id)) for ti in ALL_TYPES if not ti.interleave}
    inter = {ti.id: _interleaved_record(ti, plain) for ti in ALL_TYPES if ti.interleave}
    return {**plain, **inter}


TRAITS: dict[int, TypeTraits] = _build()

# the type sets the engine uses, all derived from the records
COMPUTE_TYPES = frozenset(t for t, r in TRAITS.items() if r.decodes)
QUANTIZE_TYPES = frozenset(t for t, r in TRAITS.items() if r.quantize is not None)
INT_DOT_TYPES = frozenset(t for t, r in TRAITS.items() if r.integer_dot)


def traits(t: int | str) -> TypeTraits:
    """The record of a type, by id or name (KeyError, with the valid names, if unknown)."""
    return TRAITS[type_info(t).id]


def id_table(value: Callable[[TypeTraits], int | bool], dtype, default, size: int = 400) -> np.ndarray:
    """A table over type ids for Numba code: value(record) at each registered id below size,
    default elsewhere."""
    table = np.full(size, default, dtype)
    for t, r in TRAITS.items():
        if t < size:
            table[t] = value(r)
    return table
