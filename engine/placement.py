"""Where each weight lives: llama.cpp's layer offload (-ngl) and buffer overrides (-ot).

`-ngl N` puts the last N repeating layers on the GPU, and the output layer (output norm and output
matrix) too when N > n_layer; the token embedding always stays on the CPU (its rows are looked up,
not multiplied).  Then `-ot REGEX=BUFFER` rules are searched in order in each tensor's name; the
first that matches decides.  A tensor whose type has no GPU kernel (the CPU-only _R4/_R8 layouts,
and types the CUDA backend does not compute) stays on the CPU, with one log line per type: ik's
graph would run such a tensor's product on the CPU too.

The KV cache of a layer goes where the layer's attention goes (its attn_norm's buffer), unless
`-nkvo` keeps every layer's cache in host memory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

CPU, GPU = "CPU", "CUDA0"
BUFFERS = (CPU, GPU)

_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass
class Placement:
    n_layer: int
    n_gpu_layers: int = 0
    overrides: list[tuple[str, str]] = field(default_factory=list)
    kv_offload: bool = True              # False: -nkvo
    gpu: bool = False                    # a CUDA device (or the simulator) is there to use

    def __post_init__(self) -> None:
        self._rules = [(re.compile(p), b) for p, b in self.overrides]
        self.i_gpu_start = max(self.n_layer - max(self.n_gpu_layers, 0), 0) if self.gpu else self.n_layer

    @property
    def any_gpu(self) -> bool:
        return self.gpu and (self.n_gpu_layers > 0 or any(b == GPU for _, b in self.overrides))

    def by_layers(self, name: str) -> str:
        """The buffer -ngl alone gives a tensor."""
        if not self.gpu:
            return CPU
        m = _LAYER.match(name)
        if m:
            return GPU if int(m.group(1)) >= self.i_gpu_start else CPU
        if name.startswith("token_embd"):
            return CPU
        return GPU if self.n_gpu_layers > self.n_layer else CPU     # output, output_norm

    def override(self, name: str) -> str | None:
        for rx, buf in self._rules:
            if rx.search(name):
                return buf
        return None

    def buffer(self, name: str) -> str:
        o = self.override(name)
        return o if o is not None else self.by_layers(name)

    def kv_on_gpu(self, il: int) -> bool:
        return self.gpu and self.kv_offload and self.buffer(f"blk.{il}.attn_norm.weight") == GPU

    def log_offload(self, log: Callable[[str], None]) -> None:
        """llama.cpp's offload summary (printed by builds with a GPU backend)."""
        if not self.gpu:
            return
        n_gpu = min(self.n_gpu_layers, self.n_layer)
        p = "llm_load_tensors"
        log(f"{p}: offloading {n_gpu} repeating layers to GPU")
        if self.n_gpu_layers > self.n_layer:
            log(f"{p}: offloading non-repeating layers to GPU")
        log(f"{p}: offloaded {min(self.n_gpu_layers, self.n_layer + 1)}/{self.n_layer + 1} layers to GPU")

    def log_overrides(self, tensors: dict, log: Callable[[str], None]) -> None:
        """One line per tensor an -ot rule places, in ik's words."""
        if not self._rules:
            return
        for name, t in tensors.items():
            buf = self.override(name)
            if buf is not None:
                log(f"Tensor {name} (size = {t.nbytes / 1024 ** 2:.2f} MiB) buffer type overridden to {buf}")
