"""QTensor: a (possibly quantized) matrix as raw bytes, viewed straight from the GGUF mmap."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .types import type_info


@dataclass
class QTensor:
    """Rows of packed blocks.

    data:  uint8 array of shape (*batch, rows, row_bytes) — usually a view into a memory map.
    qtype: GGML type id.
    shape: logical shape in NumPy order (*batch, rows, cols); cols is GGML's ne[0].
    name:  a free label (the engine puts the GGUF tensor name there); "" when unnamed.
           Selecting one expert (t[i]) gives an unnamed tensor: the label names the whole.
    """
    data: np.ndarray
    qtype: int
    shape: tuple
    name: str = ""
    device: ClassVar[str] = "CPU"   # where the bytes live (engine.cuda_backend.GpuTensor: "CUDA0")

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    def __getitem__(self, i: int) -> "QTensor":
        """Select along the leading (expert) axis."""
        return QTensor(self.data[i], self.qtype, tuple(self.shape[1:]))

    def row_block(self, r0: int, r1: int) -> "QTensor":
        """Rows [r0, r1) of a 2-D weight (of a 3-D one seen as its stacked rows), a view."""
        rb = self.data.shape[-1]
        return QTensor(self.data.reshape(-1, rb)[r0:r1], self.qtype, (r1 - r0, self.cols))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @classmethod
    def from_raw(cls, raw: np.ndarray, qtype: int, shape: tuple) -> "QTensor":
        ti = type_info(qtype)
        rb = ti.row_bytes(shape[-1])
        flat = raw.reshape(-1).view(np.uint8)
        return cls(flat.reshape(*shape[:-1], rb), qtype, tuple(int(s) for s in shape))


def f32_qtensor(a: np.ndarray) -> QTensor:
    """An f32 array (rows along the last axis) as an F32 QTensor over a copy-free byte view."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return QTensor(a.view(np.uint8).reshape(*a.shape[:-1], a.shape[-1] * 4), 0, tuple(a.shape))
