"""quant.simd_blocks: the integer row dots of the K-quant, IQK and legacy block types.

Every record of BLOCK_DOTS, in both forms (generic IR and AVX512-VNNI where the CPU has it), is
checked against the f32 row decoders (quant.kernels.decode_row; IQ6_K: its integer levels) on
random bytes, which reach every level, scale, sign and extra bit, at one block and at several;
then quant.matmul's few-token path against its tile path and NumPy on odd shapes, experts and
the fused gate/up product."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from quant import kernels as K
from quant import simd_blocks as SB
from quant import simd_gemm as SG
from quant.iqk import decode_row_iqk_int6
from quant.matmul import (_Q8_K, _q8_rounded, _quantize_act, _tiles, _view, dequantize, matmul, matmul_id,
                          moe_up_gate, quantize_tensor)
from quant.tensor import QTensor
from quant.types import type_info

TYPES = sorted(SB.BLOCK_DOTS)
NAMES = [SB.BLOCK_DOTS[t].name for t in TYPES]


from quant import simd_r4 as R4  # noqa: E402


@njit(cache=True)
def _rdot(kind, qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, out, r):
    """kind 0 / 1: quant.simd_blocks' generic / host (VNNI where present) row dot; 2 / 3: the
    same of quant.simd_r4's group dot; activation rows k0.. of q.  The one test function that
    holds the four switches over every type (each compiled copy costs seconds cold)."""
    nt = q.shape[0] - k0
    if kind == 0:
        return SB.row_dot_generic(qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, nt, out, r)
    if kind == 1:      # the VNNI row dots of planes records read the activations reordered
        return SB.row_dot(qtype, buf, base, stride, n, K.row_dot_act(qtype, q), s, bs, b16, cols, k0, nt, out, r)
    if kind == 2:
        return R4.group_dot_generic(qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, nt, out, r)
    return R4.group_dot(qtype, buf, base, stride, n, q, s, bs, b16, cols, k0, nt, out, r)


def _dot(kind, qtype, buf, q, s, bs, b16, cols, out):
    """One row (or group) at byte 0 times all rows of q."""
    return _rdot(kind, K.tag(qtype), buf, 0, 0, 1, q, s, bs, b16, cols, 0, out, 0)


@njit(cache=True)
def _many_calls(generic, qtype, buf, stride, n, q, s, bs, b16, cols, calls, out):
    """calls row-dot calls over n rows in one compiled function (as quant.kernels' loops do)."""
    ok = True
    for _ in range(calls):
        ok &= _rdot(0 if generic else 2, qtype, buf, 0, stride, n, q, s, bs, b16, cols, 0, out, 0)
    return ok


def test_long_loops_keep_the_stack_flat():
    """The row dots' per-row allocas are freed after each row: 200000 calls of 4 rows and 8 tokens
    in one compiled loop (the stack of a 20000-token prompt's passes) run in a 1 MiB stack (they
    took ~0.4 KiB each before and crashed a thread's stack)."""
    import subprocess
    import sys
    code = ("import sys, numpy as np; sys.path.insert(0, %r)\n"
            "from test_block_dots import _many_calls, _act\n"
            "from quant.types import type_info\n"
            "from quant.kernels import tag\n"
            "for name, generic in (('Q4_K', True), ('Q4_K_R4', False)):\n"
            "    t = tag(type_info(name).id); rb = type_info(name).row_bytes(256)\n"
            "    rng = np.random.default_rng(0); q, s, bs, b16, _ = _act(rng, 256, 8)\n"
            "    buf = np.zeros(4 * rb, np.uint8); out = np.zeros((8, 4), np.float32)\n"
            "    n = 4 if generic else 1\n"
            "    assert _many_calls(generic, t, buf, rb if generic else 4 * rb, n, q, s, bs, b16, 256, 200000, out)\n"
            "print('ok')\n") % str(__import__("pathlib").Path(__file__).parent)
    r = subprocess.run(["bash", "-c", 'ulimit -s 1024 && exec "$0" -c "$1"', sys.executable, code],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def _kind(form: str, r4: bool) -> int:
    if form == "vnni" and not SB.HAS_VNNI:
        pytest.skip("no AVX512-VNNI on this CPU")
    return (2 if r4 else 0) + (form == "vnni")


def _gemm_form(form: str) -> None:
    """The GEMM tests' forms: "generic" (the IR any CPU compiles) and "native" (quant.simd_gemm's
    tile_gemm: the VNNI form, or without VNNI the AVX2 one)."""
    if form == "native" and not K.HAS_GEMM:
        pytest.skip("neither AVX512-VNNI nor AVX2 on this CPU")


NT = 3    # activation rows per kernel call (each weight block is unpacked once for all)


def _act(rng, cols, n=NT, per256=False):
    """n activation rows quantized as quant.matmul does: (q, s, bs, b16, their f64 values);
    per256: one scale per 256 values (the GEMM activations of the act256 types)."""
    x = (rng.standard_normal((n, cols)) * rng.choice([0.01, 1, 100], size=(n, cols))).astype(np.float32)
    q = np.empty((n, cols), np.int8)
    s = np.empty((n, cols // 32), np.float32)
    bs = np.empty((n, cols // 32), np.int32)
    K.quantize_act_q8(x, 256 if per256 else 32, q, s, bs)
    i16 = np.empty((n, cols // 16), np.int32)
    b16 = np.empty((n, cols // 16), np.float32)
    K.block_sums16(q, s, i16, b16, np.empty((n, 0), np.int32))
    bs = i16
    return q, s, bs, b16, (q.reshape(n, -1, 32).astype(np.float64) * s[:, :, None]).reshape(n, cols)


@pytest.mark.parametrize("ints16", [True, False])
def test_one_pass_quantization_with_sums_matches_two_passes(ints16):
    """quant.matmul's prompt path (quantize_act_q8_sums) against quantize_act_q8 then
    block_sums16; without ints16 (Q8_0 / Q4_0) bs keeps its per-32 sums."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((9, 256)) * rng.choice([0.01, 1, 100], size=(9, 256))).astype(np.float32)
    w = 16 if ints16 else 32
    q, s, bs, b16 = (np.empty((9, 256), np.int8), np.empty((9, 8), np.float32), np.empty((9, 256 // w), np.int32),
                     np.empty((9, 16), np.float32))
    c16 = np.empty((9, 16), np.int32)
    K.quantize_act_q8_sums(x, 32, q, s, bs, b16, c16)
    q2, s2, bs2, b2 = np.empty_like(q), np.empty_like(s), np.empty((9, 8), np.int32), np.empty_like(b16)
    K.quantize_act_q8(x, 32, q2, s2, bs2)
    i16 = np.empty((9, 16), np.int32) if ints16 else bs2
    c2 = np.empty_like(c16)
    K.block_sums16(q2, s2, i16, b2, c2)
    for a, b in ((q, q2), (s, s2), (bs, i16), (b16, b2), (c16, c2)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c16, -128 * q.reshape(9, 16, 16).astype(np.int32).sum(-1))
    if not ints16:
        np.testing.assert_array_equal(bs, q.reshape(9, 8, 32).astype(np.int32).sum(-1))


def _decode(qtype, raw, cols):
    y = np.empty(cols, np.float32)
    if type_info(qtype).name == "IQ6_K":
        decode_row_iqk_int6(raw, qtype, 0, cols, K.F16_TO_F32, y)
    else:
        K.decode_row(K.readonly(raw), K.tag(qtype), 0, cols, 32, K.F16_TO_F32, y)
    return y


def _random_row(rng, qtype, rb):
    """Random bytes of a row; MXFP4's exponent bytes kept below 2^22 (random E8M0 bytes are
    mostly huge powers of two, and a row is usable only if every block is finite)."""
    raw = rng.integers(0, 256, rb, dtype=np.uint8)
    if type_info(qtype).name == "MXFP4":
        raw[0::17] = rng.integers(0, 150, rb // 17)
    return raw


@pytest.mark.parametrize("form", ["generic", "vnni"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_row_dot_matches_decoder_on_random_bytes(qtype, form):
    kind = _kind(form, False)
    fmt = SB.BLOCK_DOTS[qtype]
    rng = np.random.default_rng(qtype)
    checked = 0
    # one block, several, and for the grouped legacy records a row that ends in single blocks
    # tails: 96 = three single blocks, 160 = a group of 4 and one block, 128 = a group of 4 alone
    tails = {32, 128, fmt.values + 96, fmt.values + 160} if fmt.tail else set()
    for cols in sorted({fmt.values, 3 * fmt.values, 1024} | tails):
        rb = type_info(qtype).row_bytes(cols)
        q, s, bs, b16, xa = _act(rng, cols)
        for _ in range(40):
            raw = _random_row(rng, qtype, rb)
            y = _decode(qtype, raw, cols).astype(np.float64)
            if not np.all(np.isfinite(y)) or np.abs(y).max() > 1e6:   # f16 inf / nan scales
                continue
            want = xa @ y
            mag = np.abs(xa) @ np.abs(y)
            out = np.full((NT, 1), np.nan, np.float32)
            assert _dot(kind, qtype, raw, q, s, bs, b16, cols, out)
            assert np.all(np.abs(out[:, 0] - want) <= 2e-5 * mag + 1e-30), (cols, out[:, 0], want)
            checked += 1
    assert checked >= 30


def test_planes_activation_order():
    """The planes records' activations: each 128 values' 16-value halves as the nibble planes of
    64 stored bytes lie (0, 2, 4, 6 the low nibbles of four sub-blocks, 1, 3, 5, 7 the high ones);
    row_dot_act copies only for them, and only where the row dot is the VNNI one."""
    assert SB.PLANES_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    q = np.arange(2 * 256, dtype=np.int64).astype(np.int8).reshape(2, 256)
    for t, rec in SB.BLOCK_DOTS.items():
        got = K.row_dot_act(t, q)
        if rec.planes and SB.HAS_VNNI:
            want = q.reshape(2, 2, 8, 16)[:, :, list(SB.PLANES_ORDER)].reshape(2, 256)
            np.testing.assert_array_equal(got, want, err_msg=rec.name)
        else:
            assert got is q, rec.name


@pytest.mark.skipif(not (SB.HAS_VNNI and K.HAS_GEMM), reason="planes order and the GEMM need VNNI")
def test_planes_copy_only_for_row_dot_groups():
    """Per-pair form: no copy when every pair group takes the GEMM (a prompt); with one small group
    the copy holds that group's rows in planes order."""
    t = type_info("IQ4_XS").id
    n, cols = 2 * K.GEMM_MIN + 3, 256
    q = np.arange(n * cols, dtype=np.int64).astype(np.int8).reshape(n, cols)
    b16 = np.zeros((n, cols // 16), np.float32)
    c16 = np.zeros((n, cols // 16), np.int32)
    big = np.array([0, K.GEMM_MIN, 2 * K.GEMM_MIN], np.int64)
    q2 = np.ascontiguousarray(q[:2 * K.GEMM_MIN])
    assert K._row_dot_act_pairs(t, q2, big, cols, b16[:len(q2)], c16[:len(q2)]) is q2
    got = K._row_dot_act_pairs(t, q, np.array([0, K.GEMM_MIN, 2 * K.GEMM_MIN, n], np.int64), cols, b16, c16)
    tail = q[2 * K.GEMM_MIN:]
    want = tail.reshape(-1, 2, 8, 16)[:, :, list(SB.PLANES_ORDER)].reshape(tail.shape)
    np.testing.assert_array_equal(got[2 * K.GEMM_MIN:], want)


def test_row_dot_refuses_types_without_record():
    rng = np.random.default_rng(0)
    q, s, bs, b16, _ = _act(rng, 256)
    raw = rng.integers(0, 256, 300, dtype=np.uint8)
    out = np.zeros((NT, 1), np.float32)
    assert not _dot(0, 8, raw, q, s, bs, b16, 256, out)     # Q8_0: quant.simd's, not here
    assert np.all(out == 0)


def _rounded_ref(w: QTensor, x: np.ndarray, per256: bool = False) -> np.ndarray:
    """x's Q8 round trip (per256: one scale per 256, the GEMM activations of ik's Q8_K types)
    times the dequantized rows, in f64."""
    deq = dequantize(w).reshape(-1, w.cols).astype(np.float64)
    return _q8_rounded(x, _quantize_act(x, False, per256=per256)).astype(np.float64) @ deq.T


def _gemm_acts(w: QTensor, n: int) -> bool:
    """Whether matmul quantizes n activation rows for w per 256 (its GEMM runs, the type is ik's Q8_K's)."""
    return n >= K.GEMM_MIN and w.qtype in _Q8_K


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_K", "IQ3_K", "IQ4_K",
                                  "IQ5_K", "IQ4_KS", "IQ2_KS", "Q4_1", "Q5_0", "Q5_1", "Q6_0", "IQ4_NL"])
def test_matmul_few_and_many_tokens_agree(name):
    """13 rows (not a multiple of 4 or 8), 512 columns: the row dots (one token, a partial and a
    full tile of TMAX rows), the integer GEMM (from K.GEMM_MIN tokens with VNNI: passes of 8, 4
    and single tokens) and the f32 tile path (CPUs without VNNI; called here directly)
    against NumPy on the same Q8-rounded activations."""
    rng = np.random.default_rng(7)
    w = quantize_tensor(rng.standard_normal((13, 512)).astype(np.float32), type_info(name).id)
    for n in (1, 3, 8, 19, 100):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        want = _rounded_ref(w, x, _gemm_acts(w, n))
        np.testing.assert_allclose(matmul(w, x), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        want = _rounded_ref(w, x)
        tiles = np.empty((n, 13), np.float32)
        _tiles(_view(w), _q8_rounded(x), tiles)
        np.testing.assert_allclose(tiles, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def _gemm_form_kernel(generic: bool):
    """_gemm for one form: `generic` is a closure constant, so Numba prunes the other form's branch
    before typing it (a runtime flag compiled both GEMMs into every type group's specialization:
    IQ1_M_ROWS's native test 37.5 s cold, most of it the generic GEMM no test of that group runs)."""
    @njit(cache=True)
    def gemm(qtype, buf, stride, rows, cols, q, s, b16, out, r4, r8, per32, act256, small):
        """quant.simd_gemm over every SG.ROWS-row run (tiles start as NaN: rows past `rows` stay so);
        r4 / r8: the _R4 / _R8 packing (stride: of one row, groups of 4 / 8 rows); per32: the
        per-32 form (SCALE32 types); act256: activations with one scale per 256; the packing's code
        picks the mins' form.  The flags are always passed (bools): an omitted default is another
        signature, another cold compile."""
        tu = np.full(SG.ROWS * cols, 0x7F, np.uint8)
        td = np.full(cols // 16 * SG.ROWS, np.nan, np.float32)
        tw = np.full(cols // 16 * SG.ROWS, np.nan, np.float32)
        c16 = np.empty((q.shape[0], cols // 16), np.int32)      # -128 * the per-16 sums of q
        for t in range(q.shape[0]):
            for i in range(cols // 16):
                c16[t, i] = -128 * np.sum(q[t, 16 * i:16 * i + 16].astype(np.int32))
        b32 = np.empty((q.shape[0], cols // 32), np.float32)    # per32 mins tiles take per-32 sums
        for t in range(q.shape[0]):
            for i in range(cols // 32):
                b32[t, i] = b16[t, 2 * i] + b16[t, 2 * i + 1]
        for r0 in range(0, rows, SG.ROWS):
            n = min(SG.ROWS, rows - r0)
            if r8:
                code = SG.tile_pack_r8(qtype, buf, r0 * stride, 8 * stride, n // 8, cols, tu, td, tw)
            elif r4:
                code = SG.tile_pack_r4(qtype, buf, r0 * stride, 4 * stride, n // 4, cols, tu, td, tw)
            else:
                code = SG.tile_pack(qtype, buf, r0 * stride, stride, n, cols, tu, td, tw)
            if code == SG.NOT_PACKED:
                return False
            m = code == SG.PACKED_MINS
            bsums = b32 if per32 and m else b16
            if generic:
                SG.tile_gemm_generic(tu, td, tw, cols // 16, q, s, bsums, c16, 0, q.shape[0], out, r0, n, per32, m, act256,
                                     small, qtype)
            else:
                SG.tile_gemm(tu, td, tw, cols // 16, q, s, bsums, c16, 0, q.shape[0], out, r0, n, per32, m, act256, small,
                             qtype)
        return True

    return gemm


_GEMMS = {True: _gemm_form_kernel(True), False: _gemm_form_kernel(False)}


def _gemm(generic, qtype, buf, stride, rows, cols, q, s, b16, out, r4, r8, per32, act256, small):
    return _GEMMS[bool(generic)](qtype, buf, stride, rows, cols, q, s, b16, out, r4, r8, per32, act256, small)


def _gemm_native(qtype, buf, stride, rows, cols, q, s, bs, b16, out):
    """The native GEMM as the products run it: K.matvec_int with GEMM_MIN or more activation rows
    packs each 32-row run into a tile for quant.simd_gemm (its run kernel, compiled once per type
    group, is the engine's own: no second copy of the GEMM compiled for the test)."""
    n = q.shape[0]
    assert n >= K.GEMM_MIN and K._GEMM_WEAVE[qtype] == 0
    tu = np.full(SG.ROWS * cols, SG.LEVEL_OFF, np.uint8)
    # the rows pack (else the kernel would take its row dots for them, and this tested those)
    for r in range(rows):
        assert _pack_code(K.tag(qtype), buf[r * stride:(r + 1) * stride], stride, cols, 0, tu) != SG.NOT_PACKED
    c16 = (-128 * q.reshape(n, -1, 16).astype(np.int32).sum(axis=2)).astype(np.int32)
    ro = K.readonly(buf)
    res = np.empty((n, rows), np.float32)
    K.matvec_int(K.tag(qtype), ro, 0, stride, ro, 0, stride, False, rows, cols, type_info(qtype).block_size,
                 K.F16_TO_F32, q, s, bs, b16, c16, np.zeros(1, np.int64), np.array([0, n], np.int64), res, res)
    out[...] = res


GEMM_TYPES = TYPES + sorted(SB.GEMM_ONLY)
# The generic form of the GEMM runs on no CPU (quant.kernels takes it only with VNNI or AVX2): it
# stands in for the VNNI form's structure where VNNI is missing.  Its packing is the native form's,
# so it is tested on one type of each form in four type groups, not on every type (its cold compile,
# ~50 s a group on a 2-core Zen 3, was the suite's largest share)
GENERIC_GEMM = [type_info(n).id for n in ("Q4_0", "Q8_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS", "IQ4_K")]


@njit(cache=True)
def _pack_code(qtype, buf, stride, cols, weave, tu):
    """The packing's code for one row (weave 4 / 8: one _R4 / _R8 group) of cols values, its
    levels into tu (SG.ROWS * cols bytes)."""
    td = np.empty(cols // 16 * SG.ROWS, np.float32)
    tw = np.empty(cols // 16 * SG.ROWS, np.float32)
    if weave == 8:
        return SG.tile_pack_r8(qtype, buf, 0, stride, 1, cols, tu, td, tw)
    if weave == 4:
        return SG.tile_pack_r4(qtype, buf, 0, stride, 1, cols, tu, td, tw)
    return SG.tile_pack(qtype, buf, 0, stride, 1, cols, tu, td, tw)


def _packed_levels(qtype, raw, stride, cols, weave=0):
    """(code, the levels of the packed row (or group's rows) as the GEMM sees them: less
    LEVEL_OFF, or as stored for PACKED_MINS)."""
    tu = np.full(SG.ROWS * cols, SG.LEVEL_OFF, np.uint8)
    code = _pack_code(K.tag(qtype), raw, stride, cols, weave, tu)
    lev = tu.reshape(SG.ROWS // SG.LANES, cols // 4, SG.LANES, 4)[0, :, :max(weave, 1)].astype(np.int32)
    return code, lev if code == SG.PACKED_MINS else lev - SG.LEVEL_OFF


@pytest.mark.parametrize("qtype", sorted(SG.FORMS))
def test_gemm_forms_are_what_the_kernels_pass(qtype):
    """SG.FORMS (the forms a tag's tile_gemm holds) against what quant.kernels passes: its per32 and
    act256 tables, and the packing's own code for mins (a form missing there would leave the
    outputs unwritten)."""
    per32, mins, act256, small = SG.FORMS[qtype]
    assert per32 == bool(K._GEMM_SCALE32[qtype]) and act256 == bool(K._GEMM_ACT256[qtype])
    assert small == bool(K._GEMM_SMALL[qtype])
    if qtype in SG.R8_PACKS:
        assert not mins
        return
    r4 = qtype in SG.R4_DOTS
    cols = 256 if r4 else SG.PLAIN_PACKS[qtype].values
    rb = type_info(qtype).row_bytes(cols) * (4 if r4 else 1)
    raw = _random_row(np.random.default_rng(qtype), qtype, rb) if not r4 else np.zeros(rb, np.uint8)
    code, _ = _packed_levels(qtype, raw, rb, cols, 4 if r4 else 0)
    assert code != SG.NOT_PACKED
    assert (code == SG.PACKED_MINS) == mins


@pytest.mark.parametrize("qtype", sorted(t for t in SG.SCALE32 if t in SG.PLAIN_PACKS))
def test_mins32_is_what_the_packing_says(qtype):
    """quant.kernels hands tile_gemm per-32 activation sums for the types in MINS32: exactly the
    SCALE32 types whose packing reports mins (PACKED_MINS)."""
    fmt = SG.PLAIN_PACKS[qtype]
    raw = _random_row(np.random.default_rng(qtype), qtype, type_info(qtype).row_bytes(fmt.values))
    code, _ = _packed_levels(qtype, raw, raw.size, fmt.values)
    assert code != SG.NOT_PACKED
    assert (code == SG.PACKED_MINS) == (qtype in SG.MINS32)


@pytest.mark.parametrize("qtype", sorted(SG.WEAVE))
def test_level_bound_holds_on_random_blocks(qtype):
    """Each type's lmax (BlockDot.lmax, which puts it in SG.SMALL: the AVX2 GEMM then adds 8
    products in int16) bounds the levels its packing writes, over 48 random rows (or groups):
    every level and extra bit.  For PACKED_MINS the stored levels are unsigned (0..lmax)."""
    weave = SG.WEAVE[qtype]
    lmax = SG._lmax(qtype)
    cols = SG.PLAIN_PACKS[qtype].values if weave == 0 else 256
    rb = type_info(qtype).row_bytes(cols) * max(weave, 1)
    rng = np.random.default_rng(qtype + 5)
    hi = lo = 0
    for _ in range(48):
        code, lev = _packed_levels(qtype, _random_row(rng, qtype, rb), rb, cols, weave)
        assert code != SG.NOT_PACKED
        hi, lo = max(hi, int(lev.max())), min(lo, int(lev.min()))
    assert -lmax <= lo and hi <= lmax, (lo, hi, lmax)
    if code == SG.PACKED_MINS:      # offset 0: the AVX2 row dots take them unsigned in vpmaddubsw
        assert lo >= 0 and lmax <= 127
    # the bound is the type's, not slack: its extreme levels occur in random blocks
    assert max(hi, -lo) >= lmax - 1 or lmax == 128, (lo, hi, lmax)


def test_avx2_direct_products_cannot_saturate():
    """quant.simd_blocks.avx2_mode sends a type's stored levels straight into vpmaddubsw ("direct")
    only when they lie in 0..127, and adds k products' int16 pair sums before widening only while
    k * 2 * (largest level) * 127 stays below 2**15.  Both rest on lmax, so every such type has
    its bound checked on packed levels above (its packing: WEAVE); a biased type's tables at that
    bias are checked by quant.simd_blocks.rebias as the kernels are built."""
    recs = [(t, f.off, f.lmax, f.biased) for t, f in SB.BLOCK_DOTS.items()]
    recs += [(t, f.off, f.lmax, f.biased) for t, f in R4.R4_DOTS.items()]
    seen = set()
    for t, off, lmax, biased in recs:
        mode, k, bias = SB.avx2_mode(off, lmax, biased)
        seen.add(mode)
        if mode != "direct":
            assert biased or off - lmax < 0 or off + lmax > 127 or lmax == 128
            continue
        assert t in SG.WEAVE or type_info(t).base in SG.WEAVE, type_info(t).name
        hi = 2 * lmax if biased else (lmax if off == 0 else off + lmax)
        lo = 0 if biased or off == 0 else off - lmax
        assert 0 <= lo and hi <= 127, (type_info(t).name, lo, hi)
        assert k >= 1 and k * 2 * hi * 127 < 2 ** 15, (type_info(t).name, k, hi)
        assert bias == (lmax if biased else off)
    assert seen == {"direct", "signed"}


@njit(cache=True)
def _tile_avx2(qtype, tu, td, tw, q, s, b16, c16, out, per32, mins, small):
    SG.tile_gemm_avx2(tu, td, tw, td.size // SG.ROWS, q, s, b16, c16, 0, q.shape[0], out, 0, SG.ROWS, per32, mins,
                      False, small, qtype)


@pytest.mark.parametrize("name", ["Q6_K", "Q4_K"])
def test_avx2_small_form_at_the_level_bound(name):
    """The AVX2 GEMM's small form (8 products added in int16 before vpmaddwd) on tiles whose every
    level is at the bound SMALL_LEVEL and activations at +-127: every int16 sum at its largest,
    exact (Q6_K: signed levels; Q4_K: the mins form, levels as stored)."""
    if SG.tile_gemm_avx2 is None:
        pytest.skip("no AVX2 on this CPU")
    qt = type_info(name).id
    per32, mins, _, small = SG.FORMS[qt]
    assert small
    cols, n = 512, 5
    td = np.ones(cols // 16 * SG.ROWS, np.float32)
    tw = np.zeros(cols // 16 * SG.ROWS, np.float32)
    for lev in ([SG.SMALL_LEVEL] if mins else [SG.SMALL_LEVEL, -SG.SMALL_LEVEL]):
        for a in (127, -127):
            tu = np.full(SG.ROWS * cols, lev + (0 if mins else SG.LEVEL_OFF), np.uint8)
            q = np.full((n, cols), a, np.int8)
            s = np.ones((n, cols // 32), np.float32)
            b16 = np.zeros((n, cols // (32 if per32 and mins else 16)), np.float32)
            c16 = np.full((n, cols // 16), -128 * 16 * a, np.int32)
            out = np.full((n, SG.ROWS), np.nan, np.float32)
            _tile_avx2(K.tag(qt), tu, td, tw, q, s, b16, c16, out, per32, mins, small)
            assert np.all(out == np.float32(lev * a * cols)), (lev, a, out)


@pytest.mark.parametrize("qtype,form", [(t, "generic") for t in GENERIC_GEMM] + [(t, "native") for t in GEMM_TYPES],
                         ids=lambda v: type_info(v).name if isinstance(v, int) else v)
def test_tile_gemm_matches_decoder_on_random_bytes(qtype, form):
    """The GEMM's packing and products, on random rows (every level, scale, sign, extra bit and
    min): 53 rows (a full 32-row tile, then 21 rows: one full and one partial 16-row vector), 15 tokens
    (two vectors: passes of 6, 6 and 3; one vector: passes of 8, 4 and 3 single ones),
    one block, several, and for the grouped legacy records a row ending in single blocks."""
    _gemm_form(form)
    fmt = {**SB.BLOCK_DOTS, **SB.GEMM_ONLY}[qtype]
    rng = np.random.default_rng(qtype + 1)
    for cols in sorted({fmt.values, 3 * fmt.values} | ({fmt.values + 96, fmt.values + 160} if fmt.tail else set())):
        rb = type_info(qtype).row_bytes(cols)
        rows, ys = [], []
        while len(rows) < 53:
            raw = _random_row(rng, qtype, rb)
            y = _decode(qtype, raw, cols).astype(np.float64)
            if np.all(np.isfinite(y)) and np.abs(y).max() <= 1e6:    # f16 inf / nan scales
                rows.append(raw)
                ys.append(y)
        buf, y = np.concatenate(rows), np.stack(ys)
        q, s, bs, b16, xa = _act(rng, cols, 15, fmt.act256)
        out = np.full((15, 53), np.nan, np.float32)
        if form == "generic":
            assert _gemm(True, K.tag(qtype), buf, rb, 53, cols, q, s, b16, out, False, False, qtype in SG.SCALE32,
                         fmt.act256, qtype in SG.SMALL)
        else:
            _gemm_native(qtype, buf, rb, 53, cols, q, s, bs, b16, out)
        want, mag = xa @ y.T, np.abs(xa) @ np.abs(y).T
        assert np.all(np.abs(out - want) <= 2e-5 * mag + 1e-30), (cols, out, want)


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_K", "Q6_K", "IQ4_KS"])
def test_matmul_id_and_fused_gate_up(name):
    rng = np.random.default_rng(3)
    t = type_info(name).id
    gate = quantize_tensor(rng.standard_normal((4, 12, 256)).astype(np.float32), t)
    up = quantize_tensor(rng.standard_normal((4, 12, 256)).astype(np.float32), t)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ids = np.array([3, 0, 3, 1, 2, 3])
    xr = np.array([0, 0, 1, 1, 2, 2])
    _check_experts(gate, up, x, ids, xr)


def _check_experts(gate: QTensor, up: QTensor, x: np.ndarray, ids: np.ndarray, xr: np.ndarray) -> None:
    """matmul_id and moe_up_gate against float64 products of the dequantized experts with the
    Q8-rounded activations (one scale per 256 where some expert's pairs reach the GEMM and the
    type is one of ik's Q8_K types: quant.matmul quantizes the whole call so)."""
    per256 = _gemm_acts(gate, int(np.bincount(ids).max()))
    xq = _q8_rounded(x, _quantize_act(x, False, per256=per256)).astype(np.float64)
    dg = dequantize(gate).astype(np.float64)
    du = dequantize(up).astype(np.float64)
    g = np.stack([dg[e] @ xq[r] for e, r in zip(ids, xr)])
    u = np.stack([du[e] @ xq[r] for e, r in zip(ids, xr)])
    np.testing.assert_allclose(matmul_id(gate, x, ids, xr), g, rtol=2e-5, atol=2e-5 * np.abs(g).max())
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(moe_up_gate(gate, up, x, ids, xr), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ----------------------------------------------------------------------------------------
# _R4 layouts (quant.simd_r4)
# ----------------------------------------------------------------------------------------
from quant import interleaved as IL  # noqa: E402
R4_TYPES = sorted(R4.R4_DOTS)


@pytest.mark.parametrize("form", ["generic", "vnni"])
@pytest.mark.parametrize("qtype", R4_TYPES, ids=[R4.R4_DOTS[t].name for t in R4_TYPES])
def test_group_dot_matches_plain_decode_on_random_bytes(qtype, form):
    """Random R bytes (every level, scale, sign, extra and min bit), one and two block columns:
    the 4 row results against the plain decoder of the unpacked rows."""
    kind = _kind(form, True)
    rng = np.random.default_rng(qtype)
    pt = IL.plain_type(qtype)
    checked = 0
    for cols in (256, 512):
        q, s, bs, b16, xa = _act(rng, cols)
        for _ in range(300):
            raw = rng.integers(0, 256, 4 * type_info(qtype).row_bytes(cols), dtype=np.uint8)
            plain = IL.unpack(raw, qtype, 4, cols)
            y = np.stack([_decode(pt, plain[k], cols) for k in range(4)]).astype(np.float64)
            if not np.all(np.isfinite(y)) or np.abs(y).max() > 1e6:
                continue
            out = np.full((NT, 4), np.nan, np.float32)
            assert _dot(kind, qtype, raw, q, s, bs, b16, cols, out)
            want = xa @ y.T
            mag = np.abs(xa) @ np.abs(y).T
            assert np.all(np.abs(out - want) <= 2e-5 * mag + 1e-30), (cols, out, want)
            checked += 1
    assert checked >= 10


def test_group_dot_refuses_types_without_record():
    rng = np.random.default_rng(0)
    q, s, bs, b16, _ = _act(rng, 256)
    out = np.zeros((NT, 4), np.float32)
    assert not _dot(2, 210, rng.integers(0, 256, 4 * 84, dtype=np.uint8), q, s, bs, b16, 256, out)  # Q2_K_R4
    assert np.all(out == 0)


def _check_interleaved_gemm(qtype, form, seed, col_list, ngroups):
    """quant.simd_gemm's packing of an _R4 / _R8 type on random groups, 15 tokens (every pass
    width of the GEMM), against the plain decoder of the unpacked rows."""
    il = type_info(qtype).interleave
    rng = np.random.default_rng(seed)
    pt = IL.plain_type(qtype)
    for cols in col_list:
        grb = il * type_info(qtype).row_bytes(cols)
        groups, ys = [], []
        while len(groups) < ngroups:
            raw = rng.integers(0, 256, grb, dtype=np.uint8)
            plain = IL.unpack(raw, qtype, il, cols)
            y = np.stack([_decode(pt, plain[k], cols) for k in range(il)]).astype(np.float64)
            if np.all(np.isfinite(y)) and np.abs(y).max() <= 1e6:
                groups.append(raw)
                ys.append(y)
        buf, y = np.concatenate(groups), np.concatenate(ys)
        act256 = qtype in _Q8_K
        q, s, bs, b16, xa = _act(rng, cols, 15, act256)
        rows = il * ngroups
        out = np.full((15, rows), np.nan, np.float32)
        assert _gemm(form == "generic", K.tag(qtype), buf, grb // il, rows, cols, q, s, b16, out, il == 4, il == 8,
                     qtype in SG.SCALE32, act256, qtype in SG.SMALL)
        want, mag = xa @ y.T, np.abs(xa) @ np.abs(y).T
        assert np.all(np.abs(out - want) <= 2e-5 * mag + 1e-30), (cols, out, want)


@pytest.mark.parametrize("form", ["generic", "native"])
@pytest.mark.parametrize("qtype", R4_TYPES, ids=[R4.R4_DOTS[t].name for t in R4_TYPES])
def test_tile_gemm_packs_r4_groups(qtype, form):
    """The _R4 packing: 36 rows (a full 32-row tile and one group), one and two block columns."""
    _gemm_form(form)
    _check_interleaved_gemm(qtype, form, qtype + 2, (256, 512), 9)


@pytest.mark.parametrize("form", ["generic", "native"])
@pytest.mark.parametrize("name", ["Q8_0_R8", "Q4_0_R8"])
def test_tile_gemm_packs_r8_groups(name, form):
    """The _R8 packing: 40 rows (a full 32-row tile and one group), one and three blocks."""
    _gemm_form(form)
    qtype = type_info(name).id
    _check_interleaved_gemm(qtype, form, qtype, (32, 96), 5)


@pytest.mark.parametrize("form", ["generic", "vnni"])
@pytest.mark.parametrize("name", ["Q4_K", "IQ4_XS", "Q4_K_R4"])
def test_row_dots_over_a_run_of_rows(name, form):
    """One call over several rows, as quant.kernels makes them: 5 rows (or groups) at a byte
    offset, with a stride longer than a row, activation rows from k0 = 1, output columns from
    r = 2, a full pass of TMAX tokens; against the decoder."""
    ti = type_info(name)
    r4 = ti.interleave == 4
    kind = _kind(form, r4)
    rng = np.random.default_rng(ti.id + 5)
    cols, nrows, pad, off = 512, 5, 24, 7
    width = 4 if r4 else 1
    unit = width * ti.row_bytes(cols)                       # bytes of one row / group
    buf = rng.integers(0, 256, off + nrows * (unit + pad), dtype=np.uint8)
    ys = []
    for i in range(nrows):
        o = off + i * (unit + pad)
        while True:                     # random bytes until no f16 scale is inf / nan
            raw = rng.integers(0, 256, unit, dtype=np.uint8)
            if r4:
                plain = IL.unpack(raw, ti.id, 4, cols)
                rows = np.stack([_decode(IL.plain_type(ti.id), plain[k], cols) for k in range(4)])
            else:
                rows = _decode(ti.id, raw, cols)[None]
            if np.all(np.isfinite(rows)) and np.abs(rows).max() <= 1e6:
                break
        buf[o:o + unit] = raw
        ys.append(rows)
    y = np.concatenate(ys).astype(np.float64)
    q, s, bs, b16, xa = _act(rng, cols, 1 + SB.TMAX)
    out = np.full((1 + SB.TMAX, 2 + nrows * width), np.nan, np.float32)
    assert _run_dot(kind, ti.id, buf, off, unit + pad, nrows, q, s, bs, b16, cols, out)
    want, mag = xa[1:] @ y.T, np.abs(xa[1:]) @ np.abs(y).T
    assert np.all(np.isnan(out[0])) and np.all(np.isnan(out[:, :2]))    # nothing outside its block
    assert np.all(np.abs(out[1:, 2:] - want) <= 2e-5 * mag + 1e-30), (out, want)


def _run_dot(kind, qtype, buf, base, stride, n, q, s, bs, b16, cols, out):
    return _rdot(kind, K.tag(qtype), buf, base, stride, n, q, s, bs, b16, cols, 1, out, 2)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_r8_prompts_take_the_plain_gemm(name):
    """Q8_0_R8 / Q4_0_R8 prompts go through quant.simd_gemm's R8 packing: with VNNI the same
    products as the plain type's (bit for bit: the same tile), and the reference's either way;
    40 rows (a full tile, a partial one of 8), 12 / 100 tokens."""
    rng = np.random.default_rng(11)
    w32 = rng.standard_normal((40, 512)).astype(np.float32)
    plain = quantize_tensor(w32, type_info(name).id)
    r8 = quantize_tensor(w32, type_info(name + "_R8").id)
    for n in (12, 100):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        want = _rounded_ref(plain, x)
        got = matmul(r8, x)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        if SB.HAS_VNNI:
            np.testing.assert_array_equal(got, matmul(plain, x))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q8_0_R8", "Q4_K", "IQ2_K_R4", "Q6_K", "IQ4_XS", "IQ4_K"])
def test_expert_pairs_mix_gemm_and_row_dots(name):
    """matmul_id / moe_up_gate whose experts get 20 pairs (the GEMM with VNNI) and 3 (row dots)
    in one call, and pairs that reuse one activation row for the same expert (more pairs than
    rows: Q8_0's per-16 sums must still come for the GEMM)."""
    rng = np.random.default_rng(5)
    t = type_info(name).id
    gate = quantize_tensor(rng.standard_normal((4, 32, 512)).astype(np.float32), t)
    up = quantize_tensor(rng.standard_normal((4, 32, 512)).astype(np.float32), t)
    for n_x, ids, xr in ((23, np.array([2] * 20 + [0] * 3), np.arange(23)),
                         (1, np.array([1] * 20), np.zeros(20, np.int64))):
        _check_experts(gate, up, rng.standard_normal((n_x, 512)).astype(np.float32), ids, xr)
