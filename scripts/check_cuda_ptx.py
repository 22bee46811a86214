"""Compile every CUDA kernel of ikcli to PTX for sm_90 with NVVM, on a machine without a GPU.

The device query is faked (compute capability 9.0), so this needs only the CUDA toolkit's NVVM
(CUDA_HOME, default /usr/local/cuda-13.0), not a device.  It catches what Numba's simulator cannot:
code that does not compile for a GPU (e.g. min()/max() in device code with this Numba), and local
memory (spills).  Usage: python scripts/check_cuda_ptx.py [all|mm|mm1|ops|dev]; prints one line
per kernel and the list of failures.
"""
import os, sys, time
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
os.environ.setdefault("CUDA_HOME", "/usr/local/cuda-13.0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from numba import cuda, types
import numba.cuda.dispatcher as D
class FakeDev: compute_capability = (9, 0)
D.get_current_device = lambda: FakeDev()
from quant import cuda_matmul as CM
from engine import cuda_ops as OPS

def A(dt, nd): return types.Array(dt, nd, "C")
f32, u8, u16, i32, i64 = types.float32, types.uint8, types.uint16, types.int32, types.int64
ELEM = {np.float32: f32, np.uint16: u16, np.uint8: u8}
which = sys.argv[1] if len(sys.argv) > 1 else "all"
types_ = sorted(CM.CUDA_TYPES) if which in ("all", "mm") else [0, 1, 8, 12]
fails = []
def comp(name, k, sig):
    t = time.time()
    try:
        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
        nloc = ptx.count("ld.local") + ptx.count("st.local")
        print(f"ok {name} {time.time()-t:.1f}s local_ops={nloc} ptx_chars={len(ptx)}", flush=True)
    except Exception as e:
        fails.append(name); print(f"FAIL {name}: {type(e).__name__}: {str(e)[:1500]}", flush=True)

if which in ("all", "mm", "mm1"):
    for qt in types_:
        el = ELEM[CM._DECODERS[qt][2]]
        d = A(el, 2)
        for NT in (1, 4, 8):
            comp(f"matvec {qt} NT{NT}", CM._matvec_kernel(qt, NT, False), (d, A(f32, 2), A(f32, 2), A(i32, 1), A(i32, 1), i64))
        comp(f"matvec {qt} idx", CM._matvec_kernel(qt, 1, True), (d, A(f32, 2), A(f32, 2), A(i32, 1), A(i32, 1), i64))
        for ind in (False, True):
            comp(f"tiled {qt} {ind}", CM._tiled_kernel(qt, ind, CM.TILE), (d, A(f32, 2), A(f32, 2), i64) + (A(i32, 1),) * 5)
            comp(f"rows {qt} {ind}", CM._rows_kernel(qt, ind), (d, A(i32, 1), A(f32, 2)))
if which in ("all", "ops"):
    for op in range(5):
        comp(f"ew {op}", OPS._ew_kernel(op), (A(f32, 1), A(f32, 1), A(f32, 1), f32))
    for kind in (0, 1):
        comp(f"row {kind}", OPS._row_kernel(kind), (A(f32, 2), A(f32, 1), types.boolean, f32, A(f32, 2)))
    comp("rope", OPS._rope, (A(f32, 3), A(f32, 2), A(f32, 2), types.boolean))
    comp("rope strided", OPS._rope, (types.Array(f32, 3, "A"), A(f32, 2), A(f32, 2), types.boolean))
    for qt in sorted(OPS.WRITE_TYPES):
        el = ELEM[CM._DECODERS[qt][2]]
        comp(f"write {qt}", OPS._write_kernel(qt), (A(el, 2), i64, A(f32, 2)))
    comp("combine", OPS._fa_combine, (A(f32, 3), A(f32, 2), A(f32, 2), A(f32, 1), types.boolean, i64, A(f32, 2)))
    for (kq, vq, dk, dv, vik) in [(1, 1, 128, 128, False), (8, 8, 576, 512, True), (0, 30, 64, 64, False),
                                   (8, 2, 128, 128, False), (133, 8, 128, 128, False), (1, 1, 576, 512, True)]:
        BC = OPS._fa_bc(dk, dv, vik)
        k = OPS._fa_kernel(kq, vq, dk, dv, vik, OPS.FA_ROWS_PER_WARP, BC)
        ek = ELEM[CM._DECODERS[kq][2]]; ev = ELEM[CM._DECODERS[vq][2]]
        comp(f"fa {kq} {vq} {dk} {dv} {vik}", k, (A(f32, 3), A(ek, 2), A(ek if vik else ev, 2), i64, i64, A(i32, 1), A(i32, 1),
                                                   i64, f32, i64, A(f32, 3), A(f32, 2), A(f32, 2)))
if which in ("all", "dev"):
    from engine import device_kernels as DK
    for nd in (1, 2, 3, 4):
        comp(f"elementwise rank {nd}", DK.KERNELS[nd], (A(f32, nd), types.Array(f32, nd, "A"),
                                                          types.Array(f32, nd, "A"), i64))
    comp("fill", DK.fill, (A(f32, 1), f32))
    comp("gather_rows", DK._gather_rows, (A(f32, 2), A(f32, 2), A(i32, 1)))
    comp("gather_sum", DK._gather_sum, (A(f32, 2), A(f32, 2), A(i32, 2)))
    comp("count_nonfinite", DK._count_nonfinite, (A(f32, 1), A(i32, 1)))
print("FAILS", fails)
