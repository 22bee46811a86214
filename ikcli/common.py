"""Flags shared by the tools, with llama.cpp's spellings, and their translation to an engine config."""
from __future__ import annotations

import functools
import inspect
import os
import sys
from dataclasses import dataclass
from typing import List, Optional

import typer

from .errors import CliError

ModelOpt = typer.Option(None, "-m", "--model", help="model path (GGUF; first part of a split model). Default: embedded demo model")
BatchOpt = typer.Option(2048, "-b", "--batch-size", help="logical maximum batch size")
UBatchOpt = typer.Option(512, "-ub", "--ubatch-size", help="physical maximum batch size")
ThreadsOpt = typer.Option(0, "-t", "--threads", help="number of threads to use during generation (default: the physical cores)")
ThreadsBatchOpt = typer.Option(0, "-tb", "--threads-batch", help="threads for batch and prompt processing (default: same as --threads)")
NglOpt = typer.Option(0, "-ngl", "--gpu-layers", "--n-gpu-layers", help="number of layers to store in VRAM")
MlaOpt = typer.Option(3, "-mla", "--mla-use", help="DeepSeek attention: 0 decompressed heads, 1 latent + kv^T, 2 latent cache only, 3 latent cache, FlashMLA generation")
FaOpt = typer.Option("on", "-fa", "--flash-attn", help="flash attention: on|off|auto (also 1|0; -fa alone = on; -no-fa = off)")
AmbOpt = typer.Option(256, "-amb", "--attention-max-batch", help="max. MiB for the K*Q (or decompressed K/V) scratch of one attention op; 0 = no limit")
CtkOpt = typer.Option("f16", "-ctk", "--cache-type-k",
                      help="KV cache type for K: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q6_0, q8_KV")
CtvOpt = typer.Option("f16", "-ctv", "--cache-type-v",
                      help="KV cache type for V: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q6_0, q8_KV "
                           "(quantized V needs -fa)")
FmoeOpt = typer.Option("1", "-fmoe", "--fused-moe", help="fused MoE gate/up/SiLU (default on; -fmoe alone = on; -no-fmoe = off)")
OtOpt = typer.Option(None, "-ot", "--override-tensor", help="REGEX=BUFFER[,...]: place tensors whose name matches (first rule wins); buffers: CPU, CUDA0 (where a GPU can be used)")
RtrOpt = typer.Option(False, "-rtr", "--run-time-repack",
                      help="repack CPU weights into row-interleaved _R4/_R8 types at load (no mmap for them)")
NoMmapOpt = typer.Option(False, "--no-mmap", help="read the model into memory instead of mapping it")
MlockOpt = typer.Option(False, "--mlock", help="force the system to keep the model in RAM rather than swapping or compressing")
ThpOpt = typer.Option(False, "-thp", "--transparent-huge-pages",
                      help="read the model into huge pages (needs huge pages reserved; else it stays mapped)")
OkvOpt = typer.Option(None, "-okv", "--override-kv", help="KEY=TYPE:VALUE: override a model metadata value (types int, float, bool, str); repeatable")
# RoPE / YaRN overrides: 0 (or negative for the yarn factors) keeps the model's value, as in ik
_ROPE_OPTIONS = [
    ("rope_freq_base", float, typer.Option(0.0, "--rope-freq-base", help="RoPE base frequency (default: the model's)")),
    ("rope_freq_scale", float, typer.Option(0.0, "--rope-freq-scale", help="RoPE frequency scaling factor, expands context by 1/N")),
    ("rope_scaling", Optional[str], typer.Option(None, "--rope-scaling", help="RoPE scaling: none, linear or yarn (default: the model's)")),
    ("rope_scale", float, typer.Option(0.0, "--rope-scale", help="RoPE context scaling factor, expands context by N (sets --rope-freq-scale to 1/N)")),
    ("yarn_orig_ctx", int, typer.Option(0, "--yarn-orig-ctx", help="YaRN: original context size of the model (default: the model's)")),
    ("yarn_ext_factor", float, typer.Option(-1.0, "--yarn-ext-factor", help="YaRN: extrapolation mix factor (default: 1.0 with yarn scaling, else 0.0)")),
    ("yarn_attn_factor", float, typer.Option(-1.0, "--yarn-attn-factor", help="YaRN: scale sqrt(t) or attention magnitude (default: 1.0)")),
    ("yarn_beta_slow", float, typer.Option(-1.0, "--yarn-beta-slow", help="YaRN: high correction dim or alpha (default: the model's, 1.0)")),
    ("yarn_beta_fast", float, typer.Option(-1.0, "--yarn-beta-fast", help="YaRN: low correction dim or beta (default: the model's, 32.0)")),
]
SerOpt = typer.Option(None, "-ser", "--smart-expert-reduction", help="K,t: run at least K experts, drop the others whose score < t * top score")

# Options that take a value but may be written alone (users' scripts from every era): the
# value they mean when alone, and the negative spellings that map onto them.
OPTIONAL_VALUE = {"-fa": "on", "--flash-attn": "on", "-fmoe": "1", "--fused-moe": "1"}
NEGATIONS = {"-no-fa": ("-fa", "off"), "--no-flash-attn": ("-fa", "off"),
             "-no-fmoe": ("-fmoe", "0"), "--no-fused-moe": ("-fmoe", "0"),
             "--no-context-shift": ("--context-shift", "off")}
_BOOL_WORDS = {"on": True, "1": True, "true": True, "yes": True, "auto": True,
               "off": False, "0": False, "false": False, "no": False}
SUPPORTED_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_0", "q8_kv")
IK_ONLY_CACHE_TYPES = ("iq4_nl",)


RUN_TOOLS = ("perplexity", "sweep-bench", "imatrix", "server")   # the tools on ik's common parser


def _ik_table() -> dict[str, tuple[str, int]]:
    """Every spelling of ik's common option set -> (its row's first spelling, number of values)."""
    from .ik_flags import COMMON_FLAGS
    return {name: (names[0], n) for names, n in COMMON_FLAGS for name in names}


def ik_aliases(canon: str) -> tuple[str, ...]:
    """All spellings of the ik flag whose first spelling is canon."""
    from .ik_flags import COMMON_FLAGS
    return next((names for names, _ in COMMON_FLAGS if names[0] == canon), ())


def _is_value_like(a: str) -> bool:
    try:
        float(a)
        return True
    except ValueError:
        return a == "-"


def numa_nodes() -> int:
    """NUMA nodes of this machine (1 where the kernel does not say)."""
    from engine.numa import topology
    return max(1, len(topology()))


def parse_numa(mode: Optional[str]) -> str:
    """--numa: the strategy to apply ("" on one node, with a line: nothing to place)."""
    from engine.numa import STRATEGIES
    if mode is None:
        return ""
    if mode not in STRATEGIES:
        raise CliError(f"invalid value '{mode}' for --numa: use {', '.join(STRATEGIES)}")
    if numa_nodes() == 1:
        log(f"--numa {mode}: this machine has one NUMA node, nothing to place")
        return ""
    return mode


def normalize_argv(args: list[str], declared: dict[str, int] | None = None, tool: str | None = None,
                   note=None) -> list[str]:
    """The command line a tool's parser gets, checked flag by flag, never clustered.

    declared: the tool's own spellings -> number of values (None: only the rewrites below).
    Rewrites `-fa`/`-fmoe` written without a value and the `-no-…` spellings; `--long_name`
    becomes `--long-name`, as ik does.  For a run tool (RUN_TOOLS) a spelling of ik's common set
    that the tool does not declare is dropped with its values and one `note` line (ignored) or
    refused with a CliError naming it (ikcli.ik_flags says which); anything else starting with
    '-' that the tool does not declare is an unknown argument (click would read `-thp` as
    `-t hp`)."""
    from .ik_flags import NO_EFFECT, REFUSED, USED_BY
    note = note or log
    ik = _ik_table() if tool in RUN_TOOLS else {}
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if a == "--":
            out += args[i - 1:]
            break
        if not a.startswith("-") or _is_value_like(a):
            out.append(a)
            continue
        name, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        if name.startswith("--"):
            name = name.replace("_", "-")
        if name in NEGATIONS:
            out += list(NEGATIONS[name])
            continue
        if name in OPTIONAL_VALUE and not eq:
            out.append(name)
            nxt = args[i] if i < len(args) else None
            if nxt is None or (nxt.startswith("-") and not _is_value_like(nxt)):   # written alone
                out.append(OPTIONAL_VALUE[name])
            continue
        if declared is None or name in declared:
            out.append(name + eq + val)
            n = 0 if eq or declared is None else declared[name]
            out += args[i:i + n]
            i += n
            continue
        if name not in ik:
            raise CliError(f"unknown argument: {a}")
        canon, n = ik[name]
        alias = next((x for x in ik_aliases(canon) if x in declared), None)
        if alias is not None:               # another spelling of the same ik flag, e.g. --save-all-logits
            out.append(alias + eq + val)
            out += [] if eq else args[i:i + n]
            i += 0 if eq else n
            continue
        if not eq and len(args) - i < n:
            raise CliError(f"invalid parameter for argument: {name} (expects {n} value{'s' if n > 1 else ''})")
        i += 0 if eq else n
        if canon == "-h":
            out.append("--help")
        elif canon in REFUSED:
            raise CliError(f"{name} is not supported by ikcli: {REFUSED[canon]}")
        elif canon in USED_BY[tool]:
            raise CliError(f"{name} is not supported by ikcli {tool} yet")
        else:
            note(f"{name}: ignored: {NO_EFFECT.get(canon, f'ik_llama.cpp {tool} does not use it either')}")
    return out


_log_file = None      # --log-file: the log lines also go there


_log_skip: tuple[str, ...] = ()     # --minilog: the loader's long listings are not printed


def log(msg: str) -> None:
    if _log_skip and _skipped(msg):
        return
    print(msg, file=sys.stderr, flush=True)
    if _log_file is not None:
        try:
            _log_file.write(msg + "\n")
            _log_file.flush()
        except (OSError, ValueError):
            pass


# what --minilog leaves out (ik's sweep-bench --minilog drops the same kinds of lines): the
# metadata and tensor-type listings, the model's printout, buffer sizes and per-layer notes
MINILOG_SKIP = ("llama_model_loader: - kv ", "llama_model_loader: - type ", "llama_model_loader: Dumping metadata",
                "llama_model_loader: loaded meta data", "validate_override:", "llm_load_print_meta:", "print_info:",
                "llm_load_tensors:", "Layer ", "==========", "load: ")


def _skipped(msg: str) -> bool:
    body = msg.lstrip(" \t")
    return msg.startswith(_log_skip) or body[:1] in (",", "(", ")") or body[:1].isdigit()


def minilog(on: bool) -> None:
    global _log_skip
    _log_skip = MINILOG_SKIP if on else ()


def open_log_file(base: Optional[str], new: bool, append: bool, disable: bool) -> None:
    """--log-file BASE (BASE.log; BASE.<pid>.log with --log-new; appended with --log-append), as ik's
    log.h names it; --log-disable keeps it closed."""
    global _log_file
    if _log_file is not None:
        _log_file.close()
        _log_file = None
    if base is None or disable:
        return
    name = f"{base or 'unnamed'}.{os.getpid()}.log" if new else f"{base or 'unnamed'}.log"
    try:
        _log_file = open(name, "a" if append else "w", encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot open log file '{name}': {e.strerror}") from None


def resolve_model(model: Optional[str]) -> str:
    if model:
        return model
    from .defaults import demo_model
    path = demo_model()
    if not os.path.exists(path):
        raise CliError("no -m given and the embedded demo model is missing from this installation")
    return path


def parse_bool(flag: str, value: str) -> bool:
    v = str(value).strip().lower()
    if v not in _BOOL_WORDS:
        raise CliError(f"invalid value '{value}' for {flag}: use on, off, auto, 1 or 0")
    return _BOOL_WORDS[v]


def parse_cache_type(flag: str, value: str) -> str:
    v = value.strip().lower()
    if v in SUPPORTED_CACHE_TYPES:
        return v
    names = ", ".join("q8_KV" if t == "q8_kv" else t for t in SUPPORTED_CACHE_TYPES)
    if v in IK_ONLY_CACHE_TYPES:
        raise CliError(f"cache type '{value}' for {flag} is not available in ikcli; use one of {names}")
    raise CliError(f"Invalid cache type: {value} (for {flag}; valid: {names})")


def parse_ser(value: Optional[str]) -> tuple[int, float]:
    if value is None:
        return -1, 0.0
    parts = value.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), float(parts[1])
    except ValueError:
        raise CliError(f"invalid value '{value}' for -ser: expected K,t (e.g. -ser 6,1)") from None


def check_common(n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int, n_threads_batch: int, ngl: int, mla: int) -> None:
    if n_ctx < 0:
        raise CliError(f"-c/--ctx-size must be >= 0 (got {n_ctx})")
    if n_batch < 1 or n_ubatch < 1:
        raise CliError("-b/--batch-size and -ub/--ubatch-size must be >= 1")
    if n_threads < 0 or n_threads_batch < 0:
        raise CliError("-t/-tb must be >= 0")
    if mla not in (0, 1, 2, 3):
        raise CliError(f"-mla must be 0, 1, 2 or 3 (got {mla})")
    if ngl != 0 and gpu_missing():
        log("warning: not compiled with GPU offload support, --gpu-layers option will be ignored")
        log(f"warning: {gpu_missing()} (ikcli's GPU path needs numba.cuda and a CUDA device; see the README)")


def gpu_missing() -> str:
    """"" when ikcli can use a GPU, else why not (imports numba.cuda: call only when a GPU is asked for)."""
    from engine.device import gpu_status
    return gpu_status()


def buffer_types() -> tuple[str, ...]:
    return ("CPU",) if gpu_missing() else ("CPU", "CUDA0")


def parse_overrides(values: Optional[list[str]]) -> list[tuple[str, str]]:
    """-ot values (repeatable, each a comma-separated list of REGEX=BUFFER) as (regex, buffer) pairs."""
    import re
    out: list[tuple[str, str]] = []
    for value in values or []:
        for rule in value.split(","):
            pat, eq, buf = rule.partition("=")
            if not eq or not pat:
                raise CliError(f"invalid tensor buffer type override '{rule}' in -ot {value}: expected REGEX=BUFFER")
            if buf != "CPU" and buf not in buffer_types():
                why = f" ({gpu_missing()})" if gpu_missing() else ""
                raise CliError(f"unknown buffer type '{buf}' in -ot rule '{rule}'; available buffer types: "
                               f"{', '.join(buffer_types())}{why}")
            try:
                re.compile(pat)
            except re.error as e:
                raise CliError(f"bad regex in -ot rule '{rule}': {e}") from None
            out.append((pat, buf))
    return out


@dataclass
class EngineFlags:
    """The engine flags every model-running command takes (-mla -fa -amb -ctk -ctv -fmoe -ser -ot -rtr)."""
    mla: int
    fa: str
    amb: int
    ctk: str
    ctv: str
    fmoe: str
    ser: Optional[str]
    ot: Optional[List[str]]
    rtr: bool = False
    no_mmap: bool = False
    mlock: bool = False
    thp: bool = False
    override_kv: Optional[List[str]] = None
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    rope_scaling: Optional[str] = None
    rope_scale: float = 0.0
    yarn_orig_ctx: int = 0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_beta_fast: float = -1.0
    no_warmup: bool = False
    check_tensors: bool = False
    numa: Optional[str] = None
    nkvo: bool = False


_ENGINE_OPTIONS = [("mla", int, MlaOpt), ("fa", str, FaOpt), ("amb", int, AmbOpt), ("ctk", str, CtkOpt),
                   ("ctv", str, CtvOpt), ("fmoe", str, FmoeOpt), ("ser", Optional[str], SerOpt),
                   ("ot", Optional[List[str]], OtOpt), ("rtr", bool, RtrOpt), ("no_mmap", bool, NoMmapOpt),
                   ("mlock", bool, MlockOpt), ("thp", bool, ThpOpt), ("override_kv", Optional[List[str]], OkvOpt),
                   *_ROPE_OPTIONS,
                   ("numa", Optional[str], typer.Option(None, "--numa", help="distribute, isolate or numactl: where the compute threads run on a machine with several NUMA nodes")),
                   ("nkvo", bool, typer.Option(False, "-nkvo", "--no-kv-offload", help="keep the KV cache of GPU layers in host memory")),
                   ("check_tensors", bool, typer.Option(False, "-vq", "--check-tensors", help="check every tensor's data for NaN / infinite values at load")),
                   ("no_warmup", bool, typer.Option(False, "--no-warmup", help="skip the warm-up run (then the first pass compiles any kernel not yet in the cache)"))]


# log.h's flags, taken by every run tool and acted on before it starts
_LOG_OPTIONS = [
    ("log_file", Optional[str], typer.Option(None, "--log-file", help="also write the log lines to FNAME.log")),
    ("log_new", bool, typer.Option(False, "--log-new", help="with --log-file: one file per run (FNAME.<pid>.log)")),
    ("log_append", bool, typer.Option(False, "--log-append", help="with --log-file: append instead of overwriting")),
    ("log_disable", bool, typer.Option(False, "--log-disable", help="write no log file")),
    ("log_enable", bool, typer.Option(False, "--log-enable", help="write the log file of --log-file (the default)")),
]


def with_engine_flags(fn):
    """Give a command the shared engine options, declared once here: they are appended to its
    own options and reach it as one EngineFlags argument named `flags` (the log options are
    acted on here)."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "flags"]
    extra = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=opt, annotation=ann)
             for n, ann, opt in _ENGINE_OPTIONS + _LOG_OPTIONS]

    @functools.wraps(fn)
    def command(**kw):
        flags = EngineFlags(**{n: kw.pop(n) for n, _, _ in _ENGINE_OPTIONS})
        logs = {n: kw.pop(n) for n, _, _ in _LOG_OPTIONS}
        open_log_file(logs["log_file"], logs["log_new"], logs["log_append"], logs["log_disable"])
        try:
            return fn(**kw, flags=flags)
        finally:
            open_log_file(None, False, False, True)
            minilog(False)

    command.__signature__ = sig.replace(parameters=own + extra)
    command.__annotations__ = {p.name: p.annotation for p in own + extra}
    return command


def engine_config(path: str, flags: EngineFlags, *, n_ctx: int, n_batch: int, n_ubatch: int, threads: int,
                  threads_batch: int, seed: int = -1, ngl: int = 0):
    """The EngineConfig for the engine flags every model-running tool shares (validated here)."""
    from engine.config import EngineConfig
    flash = parse_bool("-fa", flags.fa)
    type_k, type_v = parse_cache_type("-ctk", flags.ctk), parse_cache_type("-ctv", flags.ctv)
    if not flash and type_v not in ("f32", "f16", "bf16"):
        raise CliError("Quantized V cache cannot be used without flash attention")
    amb = flags.amb
    if amb < 0:
        raise CliError(f"-amb must be >= 0 (got {amb})")
    if 0 < amb < 128:
        log(f"XXXXXXXXXXXXXXXXXXXXXXXXXXXXXX amb = {amb} is too low. Changing to 128")
        amb = 128
    ser_min, ser_t = parse_ser(flags.ser)
    cfg = EngineConfig(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads,
                        n_threads_batch=threads_batch, seed=seed, flash_attn=flash, mla=flags.mla,
                        attn_max_batch_mib=amb, type_k=type_k, type_v=type_v,
                        fused_moe=parse_bool("-fmoe", flags.fmoe), ser_min=ser_min, ser_thresh=ser_t,
                        tensor_overrides=parse_overrides(flags.ot), repack=flags.rtr, use_mmap=not flags.no_mmap,
                        use_mlock=flags.mlock, use_thp=flags.thp, check_tensors=flags.check_tensors,
                        numa=parse_numa(flags.numa),
                        kv_overrides=parse_kv_overrides(flags.override_kv),
                        rope=rope_overrides(flags),
                        n_gpu_layers=ngl if ngl > 0 and not gpu_missing() else 0, kv_offload=not flags.nkvo)
    return cfg


def parse_kv_overrides(values: Optional[list[str]]) -> list:
    from engine.gguf_file import parse_kv_override
    try:
        return [parse_kv_override(v) for v in values or []]
    except ValueError as e:
        raise CliError(f"error: Invalid type for KV override: {e}") from None


def rope_overrides(flags: EngineFlags):
    from engine.config import RopeOverrides
    from engine.hparams import ROPE_SCALINGS
    if flags.rope_scaling is not None and flags.rope_scaling not in ROPE_SCALINGS:
        raise CliError(f"invalid value '{flags.rope_scaling}' for --rope-scaling: use none, linear or yarn")
    if flags.rope_scale < 0 or flags.rope_freq_scale < 0 or flags.rope_freq_base < 0 or flags.yarn_orig_ctx < 0:
        raise CliError("--rope-freq-base, --rope-freq-scale, --rope-scale and --yarn-orig-ctx must be >= 0")
    scale = 1.0 / flags.rope_scale if flags.rope_scale > 0 else flags.rope_freq_scale
    return RopeOverrides(freq_base=flags.rope_freq_base, freq_scale=scale, scaling=flags.rope_scaling or "",
                         orig_ctx=flags.yarn_orig_ctx, ext_factor=flags.yarn_ext_factor,
                         attn_factor=flags.yarn_attn_factor, beta_fast=flags.yarn_beta_fast,
                         beta_slow=flags.yarn_beta_slow)


def new_context(m, cfg, flags: EngineFlags, n_seq: int = 1):
    """The Context of the run, warmed up (ik's warm-up decode, and every kernel the run takes
    compiled, with a line saying so) unless --no-warmup."""
    from engine.context import Context
    from engine.warmup import warm_up
    if cfg.numa:
        from engine.numa import apply
        apply(cfg.numa, log)
    ctx = Context(m, cfg, log, n_seq=n_seq)
    if not flags.no_warmup:
        warm_up(ctx, log)
    return ctx


def load_model(path: str, cfg):
    """The model of `path` loaded with every load-time option of cfg (an engine.config.EngineConfig)."""
    from engine.model import load_model as load
    from engine.warmup import first_run_notice
    first_run_notice(log)
    return load(path, log, mla=cfg.mla, overrides=cfg.tensor_overrides, repack=cfg.repack, use_mmap=cfg.use_mmap,
                use_mlock=cfg.use_mlock, use_thp=cfg.use_thp, kv_overrides=cfg.kv_overrides, rope=cfg.rope,
                check_tensors=cfg.check_tensors, numa=bool(cfg.numa), n_gpu_layers=cfg.n_gpu_layers)
