"""GGML tensor types: block layouts, reference and Numba quantize/dequantize, matmul kernels.

Nothing here knows about models; everything works on raw bytes plus a type id.
"""
from .numba_stamp import install as _stamp_kernel_cache

_stamp_kernel_cache()
