"""What the engine needs to know to load and run a model; filled in by ikcli from flags."""
from __future__ import annotations

import os
from dataclasses import dataclass


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


@dataclass
class EngineConfig:
    model_path: str
    n_ctx: int = 0             # 0: the model's training context
    n_batch: int = 2048        # logical batch (tokens handed to one decode call)
    n_ubatch: int = 512        # physical micro-batch
    n_threads: int = 0         # generation threads (0: all cores)
    n_threads_batch: int = 0   # prompt-processing threads (0: same as n_threads)
    seed: int = -1
    mla: int = 0               # DeepSeek attention mode; only 0 (decompressed heads) so far
    attn_max_batch_mib: int = 0  # cap on the K·Q scratch (0: only the engine's internal cap)
    verbose: bool = True

    def threads(self, batch: bool) -> int:
        t = self.n_threads_batch if batch and self.n_threads_batch > 0 else self.n_threads
        return t if t > 0 else default_threads()
