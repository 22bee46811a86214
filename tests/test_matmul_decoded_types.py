"""matmul / matmul_id on the k-quant, IQK and legacy types: the rows ik_llama.cpp quantized
(tests/data goldens) multiplied with activations, against NumPy on ik's own dequantized values,
on the few-token (integer kernels, quant.simd_blocks) and the many-token (tile + BLAS) paths.

The integer types multiply activations rounded through the Q8 blocks (quant.matmul._q8_rounded)
on both paths, so the NumPy side uses the same rounded activations.  IQ6_K's integer kernel uses
the integer levels of ik's matmul kernels (decode_row_iqk_int6), its tile path the levels of
ik's dequantize_row_iq6_k."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quant import kernels as K
from quant.iqk import decode_row_iqk_int6
from quant.matmul import _Q8_K, _q8_rounded, _quantize_act, dequantize, many_tokens, matmul, matmul_id
from quant.tensor import QTensor
from quant.types import type_info

DATA = Path(__file__).parent / "data"


def goldens():
    out = []
    z = np.load(DATA / "golden_mainline.npz")
    n = int(z["n"])
    for k in z.keys():
        if k.endswith("_raw"):
            out.append((k[:-4], z[k], z[k[:-4] + "_deq"].reshape(-1, n)))
    z = np.load(DATA / "golden_iqk.npz")
    for k in z.keys():
        if k.endswith("/raw"):
            name = k[:-4]
            y = z[name + "/y"]
            out.append((name, z[k], y.reshape(z[k].shape[0], -1)))
    return out


CASES = goldens()


def _act(t, x):
    """The activations the kernels multiply type t's weights with (one scale per 256 for ik's Q8_K
    types where the GEMM runs)."""
    per256 = x.shape[0] >= K.GEMM_MIN and t.id in _Q8_K
    return _q8_rounded(x, _quantize_act(x, False, per256=per256)) if t.id in K.INT_DOT_TYPES else x


def _kernel_deq(t, raw, deq, n_tokens):
    """The weights the few-token kernel multiplies: IQ6_K's integer levels there, else deq."""
    if t.name != "IQ6_K" or n_tokens >= many_tokens(t.id):
        return deq
    y = np.empty_like(deq)
    for r in range(deq.shape[0]):
        decode_row_iqk_int6(raw[r], t.id, 0, deq.shape[1], K.F16_TO_F32, y[r])
    assert np.abs(y - deq).max() <= 0.5 * np.abs(deq).max() / 100
    return y


@pytest.mark.parametrize("name,raw,deq", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("n_tokens", [1, 3, 40, 100])   # 100: the tile path of every type
def test_matmul_on_ik_quantized_rows(name, raw, deq, n_tokens):
    t = type_info(name)
    raw = np.ascontiguousarray(raw.reshape(deq.shape[0], -1))
    w = QTensor(raw, t.id, deq.shape)
    np.testing.assert_array_equal(dequantize(w), deq)
    x = np.random.default_rng(0).standard_normal((n_tokens, deq.shape[1])).astype(np.float32)
    got = matmul(w, x)
    want = _act(t, x).astype(np.float64) @ _kernel_deq(t, raw, deq, n_tokens).T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max() + 1e-6)


@pytest.mark.parametrize("name,raw,deq", CASES[:3] + CASES[-3:], ids=[c[0] for c in CASES[:3] + CASES[-3:]])
def test_matmul_id_on_decoded_types(name, raw, deq):
    t = type_info(name)
    rows = deq.shape[0] // 2 * 2
    w = QTensor(np.ascontiguousarray(raw[:rows].reshape(2, rows // 2, -1)), t.id, (2, rows // 2, deq.shape[1]))
    x = np.random.default_rng(1).standard_normal((4, deq.shape[1])).astype(np.float32)
    ids, xr = np.array([1, 0, 1, 1]), np.array([0, 1, 2, 3])
    got = matmul_id(w, x, ids, xr)
    d3 = _kernel_deq(t, np.ascontiguousarray(raw.reshape(deq.shape[0], -1)), deq, 1)[:rows]
    d3 = d3.reshape(2, rows // 2, -1).astype(np.float64)
    x = _act(t, x)
    want = np.stack([d3[e] @ x[r].astype(np.float64) for e, r in zip(ids, xr)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max() + 1e-6)


@pytest.mark.parametrize("name,raw,deq", CASES, ids=[c[0] for c in CASES])
def test_reference_dequantize_dispatches_every_family(name, raw, deq):
    from quant import reference
    row = np.ascontiguousarray(raw.reshape(deq.shape[0], -1)[0])
    np.testing.assert_array_equal(reference.dequantize(row, type_info(name).id, deq.shape[1]), deq[0])
