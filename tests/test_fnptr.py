"""quant.fnptr: kernels called through their address from one driver for every type group."""
import numpy as np
import pytest
from numba import njit, types

from quant import kernels as K
from quant.fnptr import call_at, jit_address
from quant.types import type_info

_ARR = types.Array(types.float32, 1, "C")
_SIG = (_ARR, types.int64, types.float32)


def _scaled(k: float):
    @njit(cache=True)
    def fill(out, n, v):
        if n > out.shape[0]:
            raise ValueError("n past the end")
        for i in range(n):
            out[i] = v * k
    return fill


@njit(cache=True)
def _driver(fn, out, n, v):
    call_at(fn, (out, np.int64(n), np.float32(v)))
    return out.sum()


def test_call_at_runs_the_kernel_at_the_address():
    ka, kb = _scaled(2.0), _scaled(3.0)         # kept: the compiled code is the dispatchers'
    a, b = jit_address(ka, _SIG), jit_address(kb, _SIG)
    assert a != b
    out = np.zeros(5, np.float32)
    assert _driver(a, out, 4, 1.5) == pytest.approx(12.0)
    np.testing.assert_array_equal(out, [3, 3, 3, 3, 0])
    assert _driver(b, out, 5, 1.0) == pytest.approx(15.0)
    assert len(_driver.signatures) == 1          # one driver for both kernels


def test_an_exception_in_the_kernel_reaches_the_caller():
    k = _scaled(1.0)
    with pytest.raises(ValueError, match="past the end"):
        _driver(jit_address(k, _SIG), np.zeros(2, np.float32), 3, 1.0)


def test_run_kernels_are_one_per_group():
    buf = np.zeros(16, np.uint8)
    buf.flags.writeable = False
    q2, q4, q8 = (type_info(n).id for n in ("Q2_K", "Q4_K", "Q8_0"))
    assert K.run_address(q2, buf) == K.run_address(K.tag(q4), buf)       # one group: the K-quants
    assert K.run_address(q8, buf) != K.run_address(q4, buf)


def test_row_decoders_are_one_per_group_and_decode_as_the_switch():
    """dequant_rows with a tag goes through its group's row kernel (rows_address): the rows
    decode_row gives, in any order (tests/test_typetag.py compares it with every type's switch)."""
    from quant.matmul import quantize_tensor
    rng = np.random.default_rng(0)
    lut = K.F16_TO_F32
    buf = np.zeros(16, np.uint8)
    buf.flags.writeable = False
    q2, q4, q8 = (type_info(n).id for n in ("Q2_K", "Q4_K", "Q8_0"))
    assert K.rows_address(q2, buf, lut) == K.rows_address(K.tag(q4), buf, lut)
    assert K.rows_address(q8, buf, lut) != K.rows_address(q4, buf, lut)
    assert K.rows_address(q4, buf, lut) != K.rows_address(q4, buf, lut, unscaled=True)
    for name in ("Q4_K", "Q8_0"):
        t = type_info(name).id
        w = quantize_tensor(rng.standard_normal((7, 512)).astype(np.float32), t)
        raw = K.readonly(np.ascontiguousarray(w.data).reshape(-1))
        ids = np.array([6, 0, 3, 3], np.int64)
        a = np.full((4, 512), np.nan, np.float32)
        b = np.full((4, 512), np.nan, np.float32)
        K.dequant_rows(raw, K.tag(t), w.data.shape[1], ids, 512, K.QK, lut, a)
        for i, r in enumerate(ids):
            K.decode_row(raw, K.tag(t), r * w.data.shape[1], 512, K.QK, lut, b[i])
        np.testing.assert_array_equal(a, b)
        c = np.full((512, 4), np.nan, np.float32).T          # rows not contiguous: written through a copy
        K.dequant_rows(raw, K.tag(t), w.data.shape[1], ids, 512, K.QK, lut, c)
        np.testing.assert_array_equal(c, b)
