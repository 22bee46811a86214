"""The mainline i-quants' quantizers, one entry point for the family (quant.registry binds it):
IQ3_XXS / IQ3_S in quant.iq3_quantize, IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S in
quant.iq12_quantize.  Both give ik_llama.cpp's bytes (their docstrings say where and how that
was checked)."""
from __future__ import annotations

import numpy as np

from . import iq12_quantize, iq3_quantize
from .types import type_info

_BY_TYPE = {**{t: iq3_quantize.quantize for t in iq3_quantize.QUANTIZE_TYPES},
            **{t: iq12_quantize.quantize for t in iq12_quantize.QUANTIZE_TYPES}}


def quantize(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None, require_imatrix: bool = True) -> np.ndarray:
    """f32 rows (nrows, n_per_row) -> the flat bytes of ggml_quantize_chunk for an i-quant
    (require_imatrix=False: IQ1_S / IQ2_XXS / IQ2_XS without an imatrix, as ik's _R4 forms)."""
    t = type_info(qtype).id
    fn = _BY_TYPE.get(t)
    if fn is None:
        raise NotImplementedError(f"quantize: type {type_info(qtype).name} is not implemented")
    if not require_imatrix and t in iq12_quantize.REQUIRES_IMATRIX:
        return iq12_quantize.quantize(x, qtype, imatrix, require_imatrix=False)
    return fn(x, qtype, imatrix)
