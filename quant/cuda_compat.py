"""Import before numba.cuda compiles anything: numba-cuda (0.30.4, the newest) registers an overload
for np.row_stack when its CUDA target first loads, and NumPy 2.5 removed row_stack (an alias of
vstack since NumPy 2.0), so the first kernel compile fails with AttributeError.  Restoring the alias
where it is missing lets the registry load; nothing in ikcli calls row_stack."""
import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
