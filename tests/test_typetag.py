"""quant.typetag: kernels called with a type tag compile for the type's group only and give the
same results as the all-types kernels called with the plain id.  (The matmul kernels get tags
from quant.matmul, so every matmul test runs the tagged kernels against its reference.)"""
import pickle

import numpy as np
import pytest

from quant import kernels as K
from quant import matmul as M
from quant.simd_blocks import BLOCK_DOTS, for_type
from quant.typetag import QTypeType, make_tag
from quant.types import type_info


def test_tag_is_its_id_and_pickles_with_its_group():
    t = K.tag(type_info("Q4_K").id)
    assert int(t) == 12 and t == 12
    g = t._numba_type_.group
    assert {10, 11, 12, 13, 14} <= g and 8 not in g        # the K-quants, not Q8_0
    u = pickle.loads(pickle.dumps(t))
    assert u is t                                            # interned: the same Numba type
    assert K.tag(8)._numba_type_.group == frozenset({2, 8})  # Q8_0 / Q4_0 on their own
    with pytest.raises(ValueError):
        make_tag(8, {12})


def test_switch_intrinsics_keep_only_the_group():
    recs, ty = for_type(BLOCK_DOTS, QTypeType(frozenset({12, 14})))
    assert set(recs) == {12, 14} and isinstance(ty, QTypeType)
    recs, _ = for_type(BLOCK_DOTS, QTypeType(frozenset({8})))
    assert recs == {}                                        # Q8_0 has no simd_blocks record


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "IQ4_K", "IQ3_XXS", "IQ2_KT", "F16",
                                  "Q4_K_R4", "Q8_0_R8"])
def test_tagged_decoder_equals_the_all_types_one(name):
    qt = type_info(name).id
    rng = np.random.default_rng(qt)
    rows, cols = 16, 512
    w = M.quantize_tensor(rng.standard_normal((rows, cols)).astype(np.float32), qt)
    v = M._view(w)
    ids = np.arange(v.rows, dtype=np.int64)
    a = np.empty((v.rows, v.cols), np.float32)
    b = np.empty_like(a)
    K.dequant_rows(v.buf, v.qtype, v.stride, ids, v.cols, K.QK, K.F16_TO_F32, a)     # every type's switch
    K.dequant_rows(v.buf, K.tag(v.qtype), v.stride, ids, v.cols, K.QK, K.F16_TO_F32, b)
    np.testing.assert_array_equal(a, b)
