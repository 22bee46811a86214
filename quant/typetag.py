"""Type ids the kernels see at compile time: one compiled kernel per group of weight types (a
type family) instead of one kernel that switches over every type.

A kernel called with a plain int qtype compiles once for all types: the type switches of
quant.simd_blocks / simd_r4 / simd_gemm and the row decoders of quant.kernels hold every type's
code.  Numba copies a callee's code into every caller's module and generates machine code for it
there, so each entry point (matvec, dequant_rows, the tile GEMM, ...) paid for all ~90 types:
the first run of a model compiled for ~2 minutes whatever types it held.

Called with a tag instead (an int subclass, made by quant.kernels.tag), the argument's Numba
type carries the type's group (its family: the K-quants, the IQK types, ...), so the kernel
compiles once per group and holds only that group's code:
- the switch intrinsics emit the group's cases only (`group_of` at typing time);
- `by_type` picks an implementation when the call is typed, from the group (a branch on
  a closure constant is pruned before typing; a branch on the id would still type its callees);
- `qid(qtype)` gives the id as an int64 in jitted code (a constant for a one-type group).
Per group, not per type: every compiled entry point costs ~1.5 s on its own (parallel regions
most), and the test suite runs ~90 types through four of them.

The tag has `_numba_type_`, which Numba's dispatcher reads without a Python typeof call
(~0.6 us more per call than an int, measured, against ~10 us for a matmul call).  Tag types
pickle, so the per-group kernels are cached like the others.
"""
from __future__ import annotations

import inspect
from typing import Callable

from llvmlite import ir
from numba import types
from numba.core import datamodel
from numba.core.imputils import lower_constant
from numba.extending import NativeValue, intrinsic, register_model, typeof_impl, unbox, overload


class QTypeType(types.Type):
    """Numba type of a tag: the ids of the type's group; the value is the id (int64)."""

    def __init__(self, group: frozenset[int]) -> None:
        self.group = frozenset(int(t) for t in group)
        super().__init__(name=f"qtypes({','.join(map(str, sorted(self.group)))})")


@register_model(QTypeType)
class _QTypeModel(datamodel.models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.IntType(64))


class QType(int):
    """A type id that makes the kernels compile for its group only."""
    _numba_type_: QTypeType

    def __repr__(self) -> str:
        return f"tag({int(self)})"

    def __reduce__(self):
        return _rebuild, (int(self), tuple(sorted(self._numba_type_.group)))


def _rebuild(qtype: int, group: tuple[int, ...]) -> QType:
    return make_tag(qtype, group)


_TAGS: dict[tuple[int, frozenset[int]], QType] = {}


def make_tag(qtype: int, group) -> QType:
    """The (interned) tag of type id qtype in the group of ids `group` (which holds qtype)."""
    key = (int(qtype), frozenset(int(t) for t in group))
    t = _TAGS.get(key)
    if t is None:
        if key[0] not in key[1]:
            raise ValueError(f"type id {qtype} is not in its group {sorted(key[1])}")
        t = QType(key[0])
        t._numba_type_ = QTypeType(key[1])
        _TAGS[key] = t
    return t


@typeof_impl.register(QType)
def _typeof_tag(val, c):
    return val._numba_type_


@lower_constant(QTypeType)
def _const_tag(context, builder, ty, pyval):
    return context.get_constant(types.int64, int(pyval))


@unbox(QTypeType)
def _unbox_tag(typ, obj, c):
    return NativeValue(c.pyapi.long_as_longlong(obj))


def group_of(t: types.Type) -> frozenset[int] | None:
    """At typing time: the ids of a tag type's group, None for anything else (an int)."""
    return t.group if isinstance(t, QTypeType) else None


@intrinsic
def qid(typingctx, qtype):
    """The type id as an int64: a tag's value (a constant when its group is one type), or the
    integer itself."""
    if isinstance(qtype, QTypeType):
        only = next(iter(qtype.group)) if len(qtype.group) == 1 else None

        def codegen(context, builder, sig, args):
            return context.get_constant(types.int64, only) if only is not None else args[0]
        return types.int64(qtype), codegen
    if isinstance(qtype, types.Integer):
        def codegen(context, builder, sig, args):
            return context.cast(builder, args[0], sig.args[0], types.int64)
        return types.int64(qtype), codegen
    return None


@intrinsic
def as_group(typingctx, qtype, proto):
    """The id qtype (an int) as a tag of proto's group (proto: a tag, e.g. a global one): for
    ids computed in jitted code, such as the plain type of an _R4 type."""
    if not isinstance(proto, QTypeType) or not isinstance(qtype, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return context.cast(builder, args[0], sig.args[0], types.int64)
    return proto(qtype, proto), codegen


def by_type(pos: int, pick: Callable[[frozenset[int] | None], Callable]) -> Callable:
    """A function for jitted code whose argument `pos` is a type id or a tag.  When a call is
    typed, pick(group) (a tag) or pick(None) (an int) returns the implementation: a Python
    function with the same arguments as pick(None)'s, compiled into the caller."""
    names = list(inspect.signature(pick(None)).parameters)
    args = ", ".join(names)
    # Numba matches an overload's typing function and implementation by their signatures, so
    # the stub and the typing function are written with the implementations' argument names
    ns = {"pick": pick, "group_of": group_of}
    exec(f"def by_type_stub({args}):\n    raise TypeError('runs in jitted code only')\n"
         f"def typed({args}):\n    return pick(group_of({names[pos]}))\n", ns)
    overload(ns["by_type_stub"])(ns["typed"])
    return ns["by_type_stub"]


__all__ = ["QType", "QTypeType", "make_tag", "group_of", "qid", "as_group", "by_type"]
