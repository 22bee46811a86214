#!/usr/bin/env python3
"""Row decoding speed (dequant_rows, 1 thread, 1024 x 4096) per type and latent flash attention at
T=1, n_kv 3584 (2 threads), f16 and q8_0 caches:  python scripts/bench_decode.py"""
import sys, time, numpy as np
import os; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numba
from quant import kernels as K
from quant.matmul import quantize_tensor, _view
from quant.types import Q8_0, Q4_0, F16, BF16, Q6_0
from engine.kv_cache import RowStore
from engine.flash_attn import flash_attn
numba.set_num_threads(1)
rng=np.random.default_rng(0)
x=rng.standard_normal((1024,4096)).astype(np.float32)
out=np.empty_like(x); ids=np.arange(1024)
res=[]
for t,n in [(Q8_0,'q8_0'),(Q4_0,'q4_0'),(F16,'f16'),(BF16,'bf16'),(Q6_0,'q6_0')]:
    w=quantize_tensor(x,t); v=_view(w)
    K.dequant_rows(v.buf,v.tag,v.stride,ids,4096,32,K.F16_TO_F32,out)
    best=1e9
    for r in range(7):
        t0=time.perf_counter(); K.dequant_rows(v.buf,v.tag,v.stride,ids,4096,32,K.F16_TO_F32,out); best=min(best,time.perf_counter()-t0)
    res.append(f"{n} {best*1e3:.2f}ms")
print("dequant 1 thread 1024x4096:", " ".join(res))
numba.set_num_threads(2)
for ct in (F16, Q8_0):
    st=RowStore(4096,576,ct); st.write(0, rng.standard_normal((3584,576)).astype(np.float32))
    q=rng.standard_normal((1,16,576)).astype(np.float32)
    cp=np.arange(3584,dtype=np.int32); qp=np.array([3584],np.int32)
    flash_attn(q,st,None,3584,1,576,512,cp,qp,0.1)
    best=1e9
    for r in range(30):
        t0=time.perf_counter(); flash_attn(q,st,None,3584,1,576,512,cp,qp,0.1); best=min(best,time.perf_counter()-t0)
    print(f"FA latent TG n_kv 3584 {ct}: {best*1e3:.3f} ms (2 threads)")
