"""What numba.cuda needs before ikcli's first kernel compile or launch (NumPy only; imported by the
GPU modules ahead of numba.cuda).

* numba-cuda 0.30.4 (the newest) registers an overload for np.row_stack when its CUDA target first
  loads, and NumPy 2.5 removed row_stack (an alias of vstack since NumPy 2.0): every kernel compile
  failed with AttributeError on the lent H200 (numba 0.68.0, NumPy 2.5.2).  The alias is restored
  where it is missing; nothing in ikcli calls it.
* numba-cuda warns (NumbaPerformanceWarning) at every launch of fewer than 128 blocks.  Generation
  launches small grids by design (one token: a norm is one block), and the warnings filled
  sweep-bench's output with dozens of lines that ik's tools never print.
"""
import os
import warnings

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")     # read where numba's config loads later
warnings.filterwarnings("ignore", message=r"Grid size \d+ will likely result in GPU under-utilization")
