"""Kernels called through their address, so that a driver compiles once for every type group.

Numba copies a callee's code into every caller's library, and LLVM optimizes it and generates
machine code for it there again.  The few-token products of one type group held the group's row
dots and GEMM in seven libraries (the two helpers around them, the parallel loop, its parfor
gufunc and two gufunc wrappers, and the non-parallel entry above), 4-6 s of LLVM time each:
a cold compile of the K-quants' products took 43.7 s (scripts/bench_compile.py).  Called
through an address instead, the group's kernel is compiled once, on its own, and the driver,
whose code no longer depends on the group, once for all groups (19.1 s).

`jit_address(dispatcher, argtypes)` compiles (or loads from the cache) a kernel for the given
Numba types and returns the address of its compiled function; `call_at(addr, args)` calls it
from jitted code with Numba's own calling convention (exceptions propagate as from a direct
call).  The address is process-specific: it is an argument, never a constant, so the drivers
stay cacheable.
"""
from __future__ import annotations

from typing import Callable

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def call_at(typingctx, addr, args):
    """Call the compiled function at addr (an int64 from jit_address) with the tuple args; its
    Numba signature must be none(*args' types) exactly (jit_address was given those types)."""
    if not isinstance(addr, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    argtys = tuple(args.types)

    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(types.none, argtys)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        vals = cgutils.unpack_tuple(builder, llargs[1], len(argtys))
        status, _ = context.call_conv.call_function(builder, fn, types.none, argtys, vals)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()
    return types.none(addr, args), codegen


def jit_address(dispatcher, argtypes: tuple) -> int:
    """The address of dispatcher's compiled function for these Numba argument types (compiled,
    or loaded from Numba's cache, on the first request).  The caller keeps the dispatcher for as
    long as it uses the address: the compiled code is the dispatcher's."""
    argtypes = tuple(argtypes)
    dispatcher.compile(argtypes)
    cres = dispatcher.overloads[argtypes]
    return int(cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))


def arrays_key(*arrays, writability: bool = True) -> tuple:
    """What Numba's types of these arrays depend on (dtype, rank, layout, writability,
    alignment): the key to keep a kernel's address under (numba.typeof itself costs ~15 us).
    writability=False leaves it out, for kernels that type their arrays read-only either way."""
    return tuple((a.dtype.char, a.ndim, a.flags.c_contiguous, writability and a.flags.writeable, a.flags.aligned)
                 for a in arrays)


def cached_address(cache: dict, key, make: Callable[[], tuple]) -> int:
    """cache[key]'s kernel address; on a miss make() gives (dispatcher, argtypes), which is
    compiled and kept with its address (the compiled code is the dispatcher's).  setdefault: of
    two threads asking at once, both get the first one's kernel."""
    kern = cache.get(key)
    if kern is None:
        disp, argtypes = make()
        kern = cache.setdefault(key, (disp, jit_address(disp, argtypes)))
    return kern[1]


_CLOSED: set = set()     # ids of the dispatchers one_form has closed


def one_form(dispatcher, argtypes: tuple):
    """dispatcher, compiled (or loaded from Numba's cache) for argtypes only, on the first call,
    and then closed to new compiles: calls with other array kinds (C-contiguous for 'A', writable
    for read-only) convert to these types instead of compiling a form of their own.  For large
    parallel loops that read their arrays through strides and pointers only (a form per layout mix
    is a copy of the same code)."""
    if id(dispatcher) not in _CLOSED:
        dispatcher.compile(tuple(argtypes))
        dispatcher.disable_compile()
        _CLOSED.add(id(dispatcher))
    return dispatcher


__all__ = ["arrays_key", "cached_address", "call_at", "jit_address", "one_form"]
