"""Loading a model: open the GGUF, read hyper-parameters and tokenizer, bind tensors to an architecture."""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from quant.tensor import QTensor
from quant.registry import COMPUTE_TYPES
from quant.types import interleaved_form, type_info

from .gguf_file import ModelFile, ModelFileError, TensorEntry, open_model_file
from .hparams import HParams, read_hparams

Log = Callable[[str], None]


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quiet_log(msg: str) -> None:
    pass


class Weights:
    """Typed access to a model file's tensors by GGUF name, with clear errors for missing ones."""

    def __init__(self, mf: ModelFile, repack: bool = False, on_gpu: Callable[[str], bool] = lambda name: False) -> None:
        self.mf = mf
        self.on_gpu = on_gpu                  # placement (-ngl / -ot): GPU tensors are not repacked
        self.used: set[str] = set()
        self.extra: dict[str, QTensor] = {}   # tensors computed at load (e.g. attn_kv_b)
        self.repack = repack                  # -rtr: repack matrices into _R4/_R8 types
        self.by_type: dict[int, QTensor] = {}  # one matrix of each type the products use (warm-up)
        self.n_repacked = 0
        self.repacked_bytes = 0
        self.kept: dict[str, int] = {}        # -rtr: plain type -> tensors left as they are
        self.unpacked: dict[str, int] = {}    # _R4/_R8 type -> tensors unpacked to the plain type
        self.unpacked_bytes = 0

    def has(self, name: str) -> bool:
        return name in self.mf.tensors or name in self.extra

    def entry(self, name: str) -> TensorEntry:
        t = self.mf.get(name)
        if t is None:
            raise ModelFileError(f"{self.mf.path}: missing tensor '{name}'")
        self.used.add(name)
        return t

    def matrix(self, name: str, shape: tuple | None = None) -> QTensor:
        """A weight used in matrix multiplications (kept as packed bytes)."""
        if name in self.extra:
            return self.extra[name]
        t = self.entry(name)
        if t.qtype not in COMPUTE_TYPES:
            raise ModelFileError(f"{self.mf.path}: tensor '{name}' has type {type_info(t.qtype).name}, "
                                 f"which this version of ikcli cannot compute with")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ModelFileError(f"{self.mf.path}: tensor '{name}' has shape {list(t.ne)}, "
                                 f"expected {list(reversed(shape))}")
        q = t.qtensor()
        if type_info(q.qtype).interleave:
            q = self._unpacked(q)
        elif self.repack and not self.on_gpu(name):
            q = self._repacked(name, q)
        q.name = name   # the label engine.linear's observers (imatrix) see
        self.by_type.setdefault(q.qtype, q)
        return q

    # ik_llama.cpp repacks every CPU tensor except the token embedding (its rows are looked up,
    # not multiplied), when its row count is a multiple of the group size
    _NO_REPACK = ("token_embd.weight",)

    def _repacked(self, name: str, q: QTensor) -> QTensor:
        """q in its row-interleaved form, in memory (the mmap no longer backs it), or q itself.
        Only where the interleaved form has a faster kernel than the plain one (Q8_0_R8, Q4_0_R8):
        the others would be computed by unpacking their rows again, slower than the plain rows."""
        from quant import interleaved
        from quant.matmul import has_interleaved_kernel
        ti = interleaved_form(q.qtype)
        if name in self._NO_REPACK or ti is None or q.rows % ti.interleave:
            return q
        if not has_interleaved_kernel(ti.id):
            tn = type_info(q.qtype).name.lower()
            self.kept[tn] = self.kept.get(tn, 0) + 1
            return q
        nrows = q.data.size // q.data.shape[-1]
        raw = interleaved.repack(q.data.reshape(nrows, -1), q.qtype, nrows, q.cols)
        self.n_repacked += 1
        self.repacked_bytes += raw.nbytes
        return QTensor(raw.reshape(q.data.shape), ti.id, q.shape)

    def _unpacked(self, q: QTensor) -> QTensor:
        """An _R4/_R8 tensor whose layout has no kernel of its own in ikcli, unpacked in memory to
        its plain type (quant.matmul.plain_if_no_kernel: the same values, bit for bit); the
        others are returned as they are."""
        from quant.matmul import plain_if_no_kernel
        p = plain_if_no_kernel(q)
        if p is not q:
            tn = type_info(q.qtype).name.lower()
            self.unpacked[tn] = self.unpacked.get(tn, 0) + 1
            self.unpacked_bytes += p.nbytes
        return p

    def vector(self, name: str, n: int | None = None) -> np.ndarray:
        t = self.entry(name)
        v = t.as_f32().reshape(-1).astype(np.float32)
        if n is not None and v.size != n:
            raise ModelFileError(f"{self.mf.path}: tensor '{name}' has {v.size} values, expected {n}")
        return v

    def optional_vector(self, name: str) -> np.ndarray | None:
        return self.vector(name) if name in self.mf.tensors else None


class Model:
    """A loaded model: hyper-parameters, tokenizer and the architecture's forward pass."""

    def __init__(self, mf: ModelFile, hp: HParams, tokenizer, arch, log: Log) -> None:
        self.file = mf
        self.hp = hp
        self.tokenizer = tokenizer
        self.arch = arch
        self.log = log
        self.matrix_types: dict = {}    # one weight matrix of each type the products use
        self.placement = None           # engine.placement.Placement (None: everything on the CPU)

    def place_cache(self, cache) -> None:
        """Move the KV stores of the layers whose attention is on the GPU into GPU memory."""
        pl = self.placement
        if pl is None or not pl.any_gpu:
            return
        from .cuda_backend import DeviceRowStore
        from .cuda_ops import CACHE_TYPES
        from .kv_cache import cache_type_name
        for il, lc in enumerate(cache.layers):
            if pl.kv_on_gpu(il):
                for st in (lc.k, lc.v):
                    if st is not None and st.qtype not in CACHE_TYPES:
                        raise ValueError(f"cache type {cache_type_name(st.qtype)} is not supported in GPU memory; use "
                                         f"{', '.join(cache_type_name(t) for t in sorted(CACHE_TYPES))} or -nkvo")
                lc.k = DeviceRowStore.like(lc.k)
                if lc.v is not None:
                    lc.v = DeviceRowStore.like(lc.v)

    @property
    def n_vocab(self) -> int:
        return self.hp.n_vocab

    def size_bytes(self) -> int:
        return self.file.nbytes()

    def n_params(self) -> int:
        return self.file.n_elements()


def _fmt_size(nbytes: int) -> str:
    if nbytes < 1024 ** 3:
        return f"{nbytes / 1024 ** 2:.3f} MiB"
    return f"{nbytes / 1024 ** 3:.3f} GiB"


def _fmt_count(n: int) -> str:
    for lim, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= lim:
            return f"{n / lim:.3f} {suf}"
    return f"{n}"


def log_hparams(mf: ModelFile, hp: HParams, log: Log) -> None:
    p = "llm_load_print_meta"
    log(f"{p}: format           = GGUF V{mf.version}{' (latest)' if mf.version == 3 else ''}")
    log(f"{p}: arch             = {hp.arch}")
    log(f"{p}: n_vocab          = {hp.n_vocab}")
    log(f"{p}: n_ctx_train      = {hp.n_ctx_train}")
    log(f"{p}: n_embd           = {hp.n_embd}")
    log(f"{p}: n_layer          = {hp.n_layer}")
    log(f"{p}: n_head           = {hp.n_head}")
    log(f"{p}: n_head_kv        = {hp.n_head_kv}")
    log(f"{p}: n_rot            = {hp.n_rot}")
    log(f"{p}: n_embd_head_k    = {hp.n_embd_head_k}")
    log(f"{p}: n_embd_head_v    = {hp.n_embd_head_v}")
    log(f"{p}: f_norm_rms_eps   = {hp.rms_eps:.1e}")
    log(f"{p}: n_ff             = {hp.n_ff}")
    log(f"{p}: n_expert         = {hp.n_expert}")
    log(f"{p}: n_expert_used    = {hp.n_expert_used}")
    log(f"{p}: rope scaling     = {hp.rope_scaling}")
    log(f"{p}: freq_base_train  = {hp.rope_freq_base:.1f}")
    log(f"{p}: freq_scale_train = {hp.rope_freq_scale:g}")
    log(f"{p}: n_ctx_orig_yarn  = {hp.n_ctx_orig_yarn}")
    n = mf.n_elements()
    nb = mf.nbytes()
    log(f"{p}: model params     = {_fmt_count(n)}")
    log(f"{p}: model size       = {_fmt_size(nb)} ({nb * 8.0 / max(n, 1):.3f} BPW) ")
    if hp.arch == "deepseek2":
        log(f"{p}: n_layer_dense_lead   = {hp.n_layer_dense_lead}")
        log(f"{p}: n_lora_q             = {hp.q_lora_rank}")
        log(f"{p}: n_lora_kv            = {hp.kv_lora_rank}")
        log(f"{p}: n_ff_exp             = {hp.n_ff_exp}")
        log(f"{p}: n_expert_shared      = {hp.n_expert_shared}")
        log(f"{p}: expert_weights_scale = {hp.expert_weights_scale:.1f}")
        log(f"{p}: expert_weights_norm  = {int(hp.expert_weights_norm)}")
        log(f"{p}: expert_gating_func   = {'softmax' if hp.expert_gating_func == 1 else 'sigmoid'}")
        log(f"{p}: rope_yarn_log_mul    = {hp.rope_yarn_log_mul:.4f}")
    log(f"{p}: general.name     = {mf.meta.get('general.name', '')}")


def place_on_gpu(arch, pl, log: Log) -> int:
    """Upload the weights placement `pl` puts on the GPU (the layers', and the output's); returns
    their bytes.  A tensor of a type without CUDA kernels stays on the CPU (one line per type)."""
    from .cuda_backend import supports, upload_weights
    from .placement import GPU
    kept: dict[str, int] = {}

    def chooser(default: str):
        def want(q) -> bool:
            if pl.buffer(q.name.split(" ")[0] or default) != GPU:
                return False
            if not supports(q.qtype):
                tn = type_info(q.qtype).name.lower()
                kept[tn] = kept.get(tn, 0) + 1
                return False
            return True
        return want

    total = 0
    for il, L in enumerate(arch.layers):
        _, n = upload_weights(L, chooser(f"blk.{il}.derived"), vectors=pl.buffer(f"blk.{il}.attn_norm.weight") == GPU)
        total += n
    head = arch.head
    if pl.buffer("blk.0.attn_norm.weight") == GPU:
        from .cuda_backend import GpuVector
        head.first_layer_const = np.zeros(1, np.float32).view(GpuVector)
    if pl.buffer("output.weight") == GPU:          # a tied output is duplicated to the GPU, as llama.cpp does
        want = chooser("output.weight")
        out = head.output
        out.name, name = "output.weight", out.name
        if want(out):
            from .cuda_backend import GpuTensor, GpuVector
            head.output = GpuTensor.upload(out)
            head.output_norm = head.output_norm.view(GpuVector)
            total += out.nbytes
        out.name = name
    for tn, n in kept.items():
        log(f"ikcli: {n} {tn} tensors placed on {GPU} stay on the CPU: {tn} has no CUDA kernels "
            f"(ik_llama.cpp computes the CPU-only _R4/_R8 layouts on the CPU too)")
    return total


def load_model(path: str, log: Log = stderr_log, mla: int = 3, overrides: list | tuple = (),
               repack: bool = False, use_mmap: bool = True, *, use_mlock: bool = False, use_thp: bool = False,
               kv_overrides: list | tuple = (), rope=None, check_tensors: bool = False, numa: bool = False,
               n_gpu_layers: int = 0, kv_offload: bool = True) -> Model:
    """Open, validate and bind a GGUF model. Raises ModelFileError with a one-line message.
    repack (-rtr): matrices with a row-interleaved form are repacked into it in memory;
    use_mmap False (--no-mmap): the files are read into memory instead of mapped;
    use_thp (-thp): read into huge pages where the system has them; use_mlock (--mlock): pages
    locked in RAM; kv_overrides: (key, type, value) metadata overrides (--override-kv);
    rope: engine.config.RopeOverrides (--rope-* / --yarn-*), applied after the model's values
    are logged, as ik's context applies them; check_tensors (-vq): every value checked finite; numa (--numa on several nodes): the
    pages are not prefetched, so that each lands on the node of the thread that reads it first;
    n_gpu_layers (-ngl), overrides (-ot REGEX=CPU|CUDA0) and kv_offload (not -nkvo): engine.placement."""
    from .placement import GPU, Placement
    from .hparams import override_rope
    from .tokenizer import Tokenizer

    mf = open_model_file(path, log)
    mf.override_kv(list(kv_overrides), log)
    hp = read_hparams(mf)
    try:
        tok = Tokenizer.from_metadata(mf.meta)
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as e:
        raise ModelFileError(f"{path}: cannot build tokenizer: {type(e).__name__ if not str(e) else e}") from None
    if hp.n_vocab == 0:
        hp.n_vocab = tok.n_vocab
    log_hparams(mf, hp, log)
    if rope is not None:
        try:
            override_rope(hp, rope)
        except ValueError as e:
            raise ModelFileError(str(e)) from None
    if use_mmap and use_thp and mf.read_into_memory(huge=True, log=log):
        pass                    # in huge pages (ik's -thp replaces the mapping; without one it does nothing)
    elif use_mmap and not numa:
        mf.prefetch()
    else:
        mf.read_into_memory()
    if use_mlock:
        mf.lock(log)
    if check_tensors:
        mf.check_tensors()
    want_gpu = n_gpu_layers > 0 or any(b == GPU for _, b in overrides)
    if want_gpu:
        from .device import gpu_status
        if gpu_status():
            raise ModelFileError(f"cannot place tensors on {GPU}: {gpu_status()}")
    pl = Placement(hp.n_layer, n_gpu_layers, list(overrides), kv_offload, gpu=want_gpu)
    w = Weights(mf, repack=repack, on_gpu=lambda name: pl.buffer(name) == GPU)
    if hp.arch in ("llama", "qwen2", "qwen2moe"):
        from .arch.llama import LlamaArch
        arch = LlamaArch(hp, w, log)
    elif hp.arch == "llama4":
        from .arch.llama4 import Llama4Arch
        arch = Llama4Arch(hp, w, log)
    elif hp.arch == "gpt-oss":
        from .arch.gpt_oss import GptOssArch
        arch = GptOssArch(hp, w, log)
    elif hp.arch == "gemma3":
        from .arch.gemma3 import Gemma3Arch
        arch = Gemma3Arch(hp, w, log)
    elif hp.arch == "glm4moe":
        from .arch.glm4moe import Glm4MoeArch
        arch = Glm4MoeArch(hp, w, log)
    elif hp.arch in ("qwen3", "qwen3moe"):
        from .arch.qwen3 import Qwen3Arch
        arch = Qwen3Arch(hp, w, log)
    elif hp.arch == "deepseek2":
        from .arch.deepseek2 import DeepSeek2Arch
        arch = DeepSeek2Arch(hp, w, log, mla=mla)
    else:  # read_hparams already refused it
        raise ModelFileError(f"{path}: unknown model architecture '{hp.arch}'")
    pl.log_overrides(mf.tensors, log)
    pl.log_offload(log)
    gpu_bytes = place_on_gpu(arch, pl, log) if pl.any_gpu else 0
    buf = sum(mf.tensors[n].nbytes for n in w.used) + sum(t.nbytes for t in w.extra.values())
    log(f"llm_load_tensors: {'CPU':>10s} buffer size = {max(buf - gpu_bytes, 0) / 1024 ** 2:8.2f} MiB")
    if pl.any_gpu:
        log(f"llm_load_tensors: {GPU:>10s} buffer size = {gpu_bytes / 1024 ** 2:8.2f} MiB")
    if w.n_repacked:
        log(f"============ Repacked {w.n_repacked} tensors")
    if w.unpacked:
        kinds = ", ".join(f"{n} {tn}" for tn, n in w.unpacked.items())
        log(f"ikcli: unpacked {kinds} tensors ({w.unpacked_bytes / 1024 ** 2:.2f} MiB) to their plain types "
            f"at load: ikcli computes them with the plain types' kernels (no _R4 kernels of its own yet)")
    for tn, n in w.kept.items():
        log(f"-rtr: {n} {tn} tensors kept in their plain layout (ikcli has no faster kernel for "
            f"{interleaved_form(type_info(tn).id).name.lower()})")
    model = Model(mf, hp, tok, arch, log)
    model.placement = pl
    for q in w.extra.values():
        w.by_type.setdefault(q.qtype, q)
    model.matrix_types = dict(w.by_type)
    return model
