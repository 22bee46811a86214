"""Type ids, block sizes and byte sizes of the GGML tensor types ikcli understands (their layouts;
what ikcli can do with each is quant.registry's).

Ids and layouts follow ggml.h of ik_llama.cpp (a superset of mainline's numbering).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TypeInfo:
    name: str        # canonical spelling, e.g. "Q8_0"
    id: int          # GGML type id as stored in GGUF
    block_size: int  # weights per block
    type_size: int   # bytes per block
    row_meta: int = 0  # bytes before a row's blocks (ik_llama.cpp's per-row scales: IQ4_KS, IQ2_KS ...)
    interleave: int = 0  # rows stored interleaved (ik_llama.cpp's _R4 / _R8 CPU layouts), else 0
    base: str = ""       # the plain type whose blocks an interleaved type holds
    repack: bool = True  # interleaved: a repacking of base's blocks (False: ik quantizes it on its own)
    internal: bool = False   # an ikcli compute form of another type's rows, never in a GGUF file

    def row_bytes(self, n: int) -> int:
        if n % self.block_size:
            raise ValueError(f"row of {n} values is not a multiple of {self.name} block size {self.block_size}")
        return self.row_meta + n // self.block_size * self.type_size

    @property
    def bpw(self) -> float:
        return 8.0 * self.type_size / self.block_size


_TYPES = [
    TypeInfo("F32", 0, 1, 4),
    TypeInfo("F16", 1, 1, 2),
    TypeInfo("Q4_0", 2, 32, 18),
    TypeInfo("Q4_1", 3, 32, 20),
    TypeInfo("Q5_0", 6, 32, 22),
    TypeInfo("Q5_1", 7, 32, 24),
    TypeInfo("Q8_0", 8, 32, 34),
    TypeInfo("Q8_1", 9, 32, 36),
    TypeInfo("Q2_K", 10, 256, 84),
    TypeInfo("Q3_K", 11, 256, 110),
    TypeInfo("Q4_K", 12, 256, 144),
    TypeInfo("Q5_K", 13, 256, 176),
    TypeInfo("Q6_K", 14, 256, 210),
    TypeInfo("Q8_K", 15, 256, 296),         # ik_llama.cpp's: two floats (d, sum) + 256 + 16 int16
    # mainline i-quants (quant.iquants)
    TypeInfo("IQ2_XXS", 16, 256, 66),
    TypeInfo("IQ2_XS", 17, 256, 74),
    TypeInfo("IQ3_XXS", 18, 256, 98),
    TypeInfo("IQ1_S", 19, 256, 50),
    TypeInfo("IQ4_NL", 20, 32, 18),
    TypeInfo("IQ3_S", 21, 256, 110),
    TypeInfo("IQ2_S", 22, 256, 82),
    TypeInfo("IQ4_XS", 23, 256, 136),
    TypeInfo("I8", 24, 1, 1),
    TypeInfo("I16", 25, 1, 2),
    TypeInfo("I32", 26, 1, 4),
    TypeInfo("F64", 28, 1, 8),
    TypeInfo("IQ1_M", 29, 256, 56),
    TypeInfo("BF16", 30, 1, 2),
    TypeInfo("MXFP4", 39, 32, 17),      # e8m0 exponent byte, 16 bytes of e2m1 nibbles
    TypeInfo("Q6_0", 133, 32, 26),      # ik_llama.cpp: f16 d, 8 bytes of high bits, 16 of nibbles
    # ik_llama.cpp's IQK types (ggml-common.h)
    TypeInfo("IQ2_K", 137, 256, 76),
    TypeInfo("IQ3_K", 138, 256, 110),
    TypeInfo("IQ4_K", 139, 256, 144),
    TypeInfo("IQ5_K", 140, 256, 176),
    TypeInfo("IQ6_K", 141, 256, 212),
    TypeInfo("IQ4_KS", 144, 256, 136, row_meta=4),
    TypeInfo("IQ2_KS", 145, 256, 70, row_meta=2),
    TypeInfo("IQ4_KSS", 146, 256, 128, row_meta=4),
    TypeInfo("IQ5_KS", 152, 256, 168, row_meta=4),
    TypeInfo("IQ3_KS", 156, 256, 102, row_meta=2),
    TypeInfo("IQ2_KL", 157, 256, 86, row_meta=2),
    # ik_llama.cpp's trellis types (f32 row scale, then the blocks)
    TypeInfo("IQ1_KT", 158, 256, 56, row_meta=4),
    TypeInfo("IQ2_KT", 153, 256, 68, row_meta=4),
    TypeInfo("IQ3_KT", 154, 256, 100, row_meta=4),
    TypeInfo("IQ4_KT", 155, 256, 128, row_meta=4),
    # ik_llama.cpp's Q8_KV: per row an f32 scale and the i32 sum of its quants, then int8 values
    TypeInfo("Q8_KV", 151, 32, 32, row_meta=8),
    # ik_llama.cpp's row-interleaved CPU layouts: groups of 4 or 8 rows stored block by block;
    # the same bytes per row as the plain type (ggml.c type_traits)
    TypeInfo("Q4_0_R8", 202, 32, 18, interleave=8, base="Q4_0"),
    TypeInfo("Q5_0_R4", 206, 32, 22, interleave=4, base="Q5_0"),
    TypeInfo("Q8_0_R8", 208, 32, 34, interleave=8, base="Q8_0"),
    TypeInfo("Q2_K_R4", 210, 256, 84, interleave=4, base="Q2_K"),
    TypeInfo("Q3_K_R4", 211, 256, 110, interleave=4, base="Q3_K"),
    TypeInfo("Q4_K_R4", 212, 256, 144, interleave=4, base="Q4_K"),
    TypeInfo("Q5_K_R4", 213, 256, 176, interleave=4, base="Q5_K"),
    TypeInfo("Q6_K_R4", 214, 256, 210, interleave=4, base="Q6_K"),
    TypeInfo("IQ2_XXS_R4", 216, 256, 66, interleave=4, base="IQ2_XXS"),
    TypeInfo("IQ2_XS_R4", 217, 256, 74, interleave=4, base="IQ2_XS"),
    TypeInfo("IQ3_XXS_R4", 218, 256, 98, interleave=4, base="IQ3_XXS"),
    TypeInfo("IQ1_S_R4", 219, 32, 6, row_meta=2, interleave=4, base="IQ1_S", repack=False),  # (quant.interleaved)
    TypeInfo("IQ1_M_R4", 229, 32, 7, row_meta=2, interleave=4, base="IQ1_M_ROWS", repack=False),
    # IQ1_M_R4's rows one after the other (quant.interleaved.iq1_m_r4_to_rows): how ikcli computes
    # with it (no ggml type holds its values); id 4 is ggml's long-removed Q4_2, never in a file
    TypeInfo("IQ1_M_ROWS", 4, 32, 7, row_meta=2, internal=True),
    TypeInfo("IQ4_NL_R4", 220, 32, 18, interleave=4, base="IQ4_NL"),
    TypeInfo("IQ3_S_R4", 221, 256, 110, interleave=4, base="IQ3_S"),
    TypeInfo("IQ2_S_R4", 222, 256, 82, interleave=4, base="IQ2_S"),
    TypeInfo("IQ4_XS_R8", 223, 256, 136, interleave=8, base="IQ4_XS"),
    TypeInfo("Q6_0_R4", 233, 32, 26, interleave=4, base="Q6_0"),
    TypeInfo("IQ2_K_R4", 337, 256, 76, interleave=4, base="IQ2_K"),
    TypeInfo("IQ3_K_R4", 338, 256, 110, interleave=4, base="IQ3_K"),
    TypeInfo("IQ4_K_R4", 339, 256, 144, interleave=4, base="IQ4_K"),
    TypeInfo("IQ5_K_R4", 340, 256, 176, interleave=4, base="IQ5_K"),
    TypeInfo("IQ4_KS_R4", 344, 256, 136, row_meta=4, interleave=4, base="IQ4_KS"),
    TypeInfo("IQ5_KS_R4", 352, 256, 168, row_meta=4, interleave=4, base="IQ5_KS"),
    TypeInfo("MXFP4_R8", 353, 32, 17, interleave=8, base="MXFP4"),
    TypeInfo("Q8_K_R8", 399, 256, 258, interleave=8, base="Q8_K"),   # 8 f16 scales + 8 x 256 int8 per 8 rows
    # ik's other special forms (quant.interleaved): bf16 pairs of 16 rows; Q8_K with 16 rows (quants
    # stored ^ 0x80); Q8_KV's quants of 8 rows, the group header holding only their 8 f32 scales
    TypeInfo("BF16_R16", 230, 1, 2, interleave=16, base="BF16"),
    TypeInfo("Q8_K_R16", 397, 256, 258, interleave=16, base="Q8_K"),  # 16 f16 scales + 16 x 256 uint8
    TypeInfo("Q8_KV_R8", 398, 32, 32, row_meta=4, interleave=8, base="Q8_KV"),
]

ALL_TYPES: tuple[TypeInfo, ...] = tuple(_TYPES)
BY_ID: dict[int, TypeInfo] = {t.id: t for t in _TYPES}
BY_NAME: dict[str, TypeInfo] = {t.name.lower(): t for t in _TYPES}

F32, F16, Q4_0, Q8_0, BF16, Q6_0 = 0, 1, 2, 8, 30, 133

def interleaved_form(t: int) -> TypeInfo | None:
    """The _R4 / _R8 type that holds type t's blocks row-interleaved, if there is one."""
    name = type_info(t).name
    for ti in _TYPES:
        if ti.base == name and ti.repack:
            return ti
    return None


def type_info(t: int | str) -> TypeInfo:
    """Look a type up by id or by name (any case)."""
    if isinstance(t, str):
        key = t.strip().lower()
        if key.isdigit():
            return type_info(int(key))
        if key not in BY_NAME:
            raise KeyError(f"unknown tensor type '{t}'; valid: "
                           f"{', '.join(sorted(x.name for x in _TYPES if not x.internal))}")
        return BY_NAME[key]
    if t not in BY_ID:
        raise KeyError(f"unknown tensor type id {t}")
    return BY_ID[t]
