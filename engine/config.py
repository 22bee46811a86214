"""What the engine needs to know to load and run a model; filled in by ikcli from flags."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-thread siblings counted once), as ik's
    default -t; the logical CPU count where the kernel does not say."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = set(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as fh:
                cores.add(fh.read().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def default_threads() -> int:
    return physical_cores()


@dataclass
class RopeOverrides:
    """--rope-* / --yarn-* values; 0 or negative (ik's 'not set') keeps the model's own."""
    freq_base: float = 0.0
    freq_scale: float = 0.0
    scaling: str = ""              # "", none, linear, yarn
    orig_ctx: int = 0
    ext_factor: float = -1.0
    attn_factor: float = -1.0
    beta_fast: float = -1.0
    beta_slow: float = -1.0


@dataclass
class EngineConfig:
    model_path: str
    n_ctx: int = 0             # 0: the model's training context
    n_batch: int = 2048        # logical batch (tokens handed to one decode call)
    n_ubatch: int = 512        # physical micro-batch
    n_threads: int = 0         # generation threads (0: the physical cores)
    n_threads_batch: int = 0   # prompt-processing threads (0: same as n_threads)
    seed: int = -1
    flash_attn: bool = True    # online-softmax attention; K*Q is never materialized
    mla: int = 3               # DeepSeek attention mode 0..3 (forced to 0 for other models)
    attn_max_batch_mib: int = 256  # -amb: cap on the K*Q (or decompressed K/V) scratch, MiB; 0 = no cap
    type_k: str = "f16"        # KV cache types (llama.cpp names)
    type_v: str = "f16"
    fused_moe: bool = True     # gate+up+SiLU*mul of the selected experts in one pass
    ser_min: int = -1          # -ser K,t: smart expert reduction (off when K <= 0 or t <= 0)
    ser_thresh: float = 0.0
    tensor_overrides: list = field(default_factory=list)  # -ot (regex, buffer); first match wins
    repack: bool = False       # -rtr: CPU weights repacked into row-interleaved types at load
    use_mmap: bool = True      # False (--no-mmap): the files are read into memory at load
    use_mlock: bool = False    # --mlock: lock the model's pages in RAM
    numa: str = ""             # --numa strategy on a multi-node machine ("" = none)
    check_tensors: bool = False   # -vq: every tensor's values checked finite at load
    use_thp: bool = False      # -thp: read the model into huge pages (MAP_HUGETLB) where the system has them
    kv_overrides: list = field(default_factory=list)   # --override-kv (key, type, value)
    rope: RopeOverrides = field(default_factory=RopeOverrides)
    n_gpu_layers: int = 0      # -ngl: the last N repeating layers (N > n_layer: and the output) on the GPU
    kv_offload: bool = True    # False (-nkvo): GPU layers keep their KV cache in host memory

    def threads(self, batch: bool) -> int:
        t = self.n_threads_batch if batch and self.n_threads_batch > 0 else self.n_threads
        return t if t > 0 else default_threads()
