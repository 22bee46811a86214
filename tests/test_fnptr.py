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
