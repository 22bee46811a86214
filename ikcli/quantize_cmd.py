"""`ikcli quantize`: llama-quantize's arguments, per-tensor type rules, log lines and GGUF output.

    ikcli quantize [options] IN.gguf [OUT.gguf] TYPE [NTHREADS]

The per-tensor choices are engine.quantize_plan's (ik_llama.cpp's rules for the base types ikcli
can produce); the bytes come from quant.reference.  The output is written to a temporary file
in the destination folder and renamed only once complete; it is removed on any error, Ctrl-C,
SIGTERM or SIGHUP, and one left by a killed run (SIGKILL: its process is gone) is removed by the
next run writing the same output.  --imatrix: a legacy .dat file
(engine.imatrix), looked up per tensor with llama-quantize's fallbacks; each expert of a 3-D
tensor gets its own block of weights.

The per-class flags (--attn-q-type … --ffn-up-type, --ffn-gate-inp-type) go to the plan, which
applies them where ik's llama_tensor_get_type does; their type names are ggml's, any case (ik
compares them case-sensitively and silently ignores a name it does not know; ikcli stops with one
line).  --override-kv KEY=TYPE:VALUE (engine.gguf_file.parse_kv_override, as for the run tools)
applies to the hparams the rules read, as ik's model loader does, and is written into the output
as llama-quantize writes it: int as INT32, float as FLOAT32, bool, str, replacing a key in place,
before general.file_type (so that one cannot be overridden).  -h/--help and a missing or bad
TYPE print llama-quantize's list of ftypes ("  %2d  or  %-7s : …", its order; the descriptions
are ikcli's: base type and its bits per weight).
"""
from __future__ import annotations

import functools
import os
import sys
import time
from typing import List, Optional

import typer

from . import common
from .errors import CliError
from .outfiles import check_output_path, remove_stale_temps, temp_path, terminate_cleanly, write_error

MiB = 1024.0 * 1024.0


def _log(msg: str, bar=None) -> None:
    if bar is not None:
        bar.console.print(msg, markup=False, highlight=False, soft_wrap=True)
    else:
        common.log(msg)


@functools.lru_cache(maxsize=None)
def _can_produce(t: int) -> bool:
    """Whether quant.reference can write type t (NotImplementedError: not yet); asked per tensor,
    answered once per type."""
    import numpy as np  # here, not at import: `ikcli --help` must stay light
    from quant import reference, registry
    from quant.types import type_info
    try:
        ti = type_info(t)
        bs = ti.block_size
        n = max(bs, 1) * (256 // bs if bs and 256 % bs == 0 else 1)
        x = np.random.default_rng(0).standard_normal((max(1, ti.interleave), n)).astype(np.float32)  # _R4/_R8: groups
        reference.quantize(x, t, np.ones(n, np.float32) if registry.traits(t).needs_imatrix else None)
        return True
    except (NotImplementedError, KeyError, ValueError):
        return False


def _block_size(t: int) -> Optional[int]:
    from quant.types import type_info
    try:
        return type_info(t).block_size
    except KeyError:
        return None


def _nbytes(t: int, ne: tuple) -> Optional[int]:
    import numpy as np  # here, not at import: `ikcli --help` must stay light
    from quant.types import type_info
    try:
        rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
        return type_info(t).row_bytes(ne[0]) * rows
    except (KeyError, ValueError):
        return None


def _convert(entry, new_type: int, nthread: int = 1, imatrix=None):
    """Re-encode one tensor (any number of dims, row-wise in chunks) as new_type; flat uint8 bytes.

    imatrix: None, ne[0] per-column weights, or ne[0] * ne[2] of them (one block per expert of a
    3-D tensor: each expert's rows use theirs, as llama-quantize does).

    Chunks of rows run on `nthread` threads (NTHREADS): the quantizers' Numba kernels are
    nogil and NumPy's array operations release the GIL too."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np  # here, not at import: `ikcli --help` must stay light
    from quant import reference
    from quant.matmul import dequantize
    from quant.tensor import QTensor
    from quant.types import F32, type_info
    ne0 = entry.ne[0]
    rows = entry.n_elements // ne0
    src = entry.raw.view(np.ndarray).reshape(rows, -1)
    out_rb = type_info(new_type).row_bytes(ne0)
    out = np.empty((rows, out_rb), dtype=np.uint8)
    # chunks small enough to spread a tensor over the threads, large enough to amortize NumPy calls
    chunk = max(1, min((1 << 22) // ne0, -(-rows // max(1, 2 * nthread))))
    il = max(1, type_info(new_type).interleave)   # _R4/_R8: chunks of whole row groups
    chunk = -(-chunk // il) * il
    plane = rows                           # rows sharing one block of imatrix weights
    if imatrix is not None:
        imatrix = np.asarray(imatrix, dtype=np.float32).reshape(-1, ne0)
        plane = rows // imatrix.shape[0]
        chunk = min(chunk, plane)

    def one(i: int) -> None:
        n = min(chunk, plane - i % plane)  # a chunk never spans two experts
        part = src[i:i + n]
        if entry.qtype == F32:
            x = part.view(np.float32)
        else:
            x = dequantize(QTensor(part, entry.qtype, (part.shape[0], ne0)))
        w = imatrix[i // plane] if imatrix is not None else None
        out[i:i + part.shape[0]] = reference.quantize(x, new_type, imatrix=w).reshape(part.shape[0], out_rb)

    starts = [p + j for p in range(0, rows, plane) for j in range(0, plane, chunk)]
    if nthread > 1 and len(starts) > 1:
        pool = ThreadPoolExecutor(max_workers=nthread)
        try:
            list(pool.map(one, starts))
        finally:                         # Ctrl-C / SIGTERM: do not run the chunks not yet started
            pool.shutdown(wait=True, cancel_futures=True)
    else:
        for i in starts:
            one(i)
    return out.reshape(-1)


def _emit(writer, data) -> None:
    """Append one tensor's bytes (a separate function so tests can simulate a failure)."""
    writer.write_tensor_data(data)


def _copy_kv(writer, reader, ftype_value: int, extra_kv: Optional[list] = None) -> None:
    """The input's metadata, then (as llama-quantize sets them) general.quantization_version, the
    --override-kv and quantize.imatrix.* values (extra_kv: (key, value, GGUFValueType)) and
    general.file_type; a key set again keeps its place, as gguf_set_val_* does."""
    from gguf import GGUFValueType
    kv: dict = {}
    for name, value in reader.meta.items():
        if name in ("general.architecture", "split.no", "split.count", "split.tensors.count"):
            continue
        vt, sub = reader.kv_types[name]
        kv[name] = (value, GGUFValueType(vt), None if sub is None else GGUFValueType(sub))
    kv["general.quantization_version"] = (2, GGUFValueType.UINT32, None)
    for k, v, vt in extra_kv or []:
        kv[k] = (v, vt, None)
    kv["general.file_type"] = (ftype_value, GGUFValueType.UINT32, None)
    for name, (v, vt, sub) in kv.items():
        writer.add_key_value(name, v, vt, sub)


def _override_kv_values(overrides: list) -> list:
    """--override-kv (key, kind, value) triples as llama-quantize writes them: int as int32 (the
    value cast as C does), float as float32, bool, str."""
    from gguf import GGUFValueType
    out = []
    for key, kind, value in overrides:
        if kind == "int":
            out.append((key, (int(value) + 2 ** 31) % 2 ** 32 - 2 ** 31, GGUFValueType.INT32))
        elif kind == "float":
            out.append((key, float(value), GGUFValueType.FLOAT32))
        elif kind == "bool":
            out.append((key, bool(value), GGUFValueType.BOOL))
        else:
            out.append((key, str(value), GGUFValueType.STRING))
    return out


def _parse_flag_type(key: str, name: str) -> int:
    """A per-class type flag's ggml type name (any case); ik ignores a name it does not know
    without a word, ikcli stops with one line."""
    from engine.quantize_plan import PlanError, parse_type
    try:
        return parse_type(name)
    except PlanError as e:
        raise PlanError(f"--{key.replace('_', '-')}-type: {e}") from None


def _read_rules(specs: List[str]):
    from engine.quantize_plan import parse_custom_rules
    rules = []
    for spec in specs:
        if spec.startswith("@"):
            try:
                with open(spec[1:], encoding="utf-8") as fh:
                    text = fh.read()
            except OSError as e:
                raise CliError(f"cannot read custom quantization rules file '{spec[1:]}': {e.strerror}") from None
            rules += parse_custom_rules(text, comments=True)
        else:
            rules += parse_custom_rules(spec)
    return rules


class _Imatrix:
    def __init__(self, data: dict, dataset: str, last_call: int) -> None:
        self.data, self.dataset, self.last_call = data, dataset, last_call


def _prepare_imatrix(path: str, include: List[str], exclude: List[str]) -> "_Imatrix":
    """llama-quantize's load_imatrix + prepare_imatrix: mean squares per entry, filtered by name."""
    import numpy as np  # here, not at import: `ikcli --help` must stay light
    from engine.imatrix import ImatrixError, mean_squares, read_dat
    try:
        dat = read_dat(path)
    except ImatrixError as e:
        raise CliError(str(e)) from None
    data = mean_squares(dat)
    if dat.dataset:
        print(f"load_imatrix: imatrix dataset='{dat.dataset}'")
    print(f"load_imatrix: loaded {len(data)} importance matrix entries from {path} computed on {dat.last_call} chunks")
    for name in exclude:
        data = {k: v for k, v in data.items() if name not in k}
    if include:
        data = {k: v for k, v in data.items() if any(n in k for n in include)}
    if data:
        print(f"prepare_imatrix: have {len(data)} importance matrix entries")
    for k, v in data.items():
        bad = v[~np.isfinite(v)]
        if bad.size:
            raise CliError(f"imatrix contains non-finite value {bad[0]} (entry {k})")
    sys.stdout.flush()
    return _Imatrix(data, dat.dataset, dat.last_call)


def _tensor_weights(plans, entries, im: Optional["_Imatrix"], ft, ignore_rules: bool,
                    dry_run: bool = False) -> Optional[dict]:
    """Per quantized tensor, the imatrix values its quantizer gets (ik's lookup and checks); None
    when no imatrix was given.  Errors (wrong size, missing data for a very low-bit type) are raised
    before anything is written."""
    from engine import quantize_plan as qp
    from quant import registry
    data = im.data if im is not None else {}
    if data:
        common.log(f"================================ Have weights data with {len(data)} entries")
    out: dict = {}
    for p, e in zip(plans, entries):
        if not p.quantize:
            continue
        w = None
        key = qp.imatrix_lookup(p.name, data) if data else None
        if key is not None:
            v = data[key]
            ne2 = e.ne[2] if len(e.ne) > 2 else 1
            if v.size == e.ne[0] * ne2:
                w = v
            elif p.name != "token_embd.weight":
                raise CliError(f"imatrix size {v.size} is different from tensor size {e.ne[0] * ne2} for {p.name}")
            else:
                common.log(f"====== llama_model_quantize_internal: imatrix size {v.size} is different from tensor "
                           f"size {e.ne[0] * ne2} for {p.name}")
        if w is None and not ignore_rules and p.name not in ("token_embd.weight", "output.weight") and (
                p.new_type in qp.VERY_LOW_BIT or (p.new_type == qp.TYPE_ID["q2_k"] and ft.name == "Q2_K_S")):
            raise CliError(f"Missing importance matrix for tensor {p.name} in a very low-bit quantization "
                           f"(the result would be garbage)")
        if w is None and not dry_run and registry.traits(p.new_type).needs_imatrix:   # even with --ignore-imatrix-rules
            raise CliError(f"{qp.TYPE_NAME.get(p.new_type, p.new_type)} cannot be quantized without an importance "
                           f"matrix (ik_llama.cpp aborts here); there is none for {p.name}")
        if w is not None:
            out[p.name] = w
    return out if data else None


def _imatrix_kv(im: Optional["_Imatrix"], path: Optional[str], hide: bool) -> list:
    """The quantize.imatrix.* metadata llama-quantize writes (int values as int32, as it does)."""
    from gguf import GGUFValueType
    if im is None or not im.data:
        return []
    kv = [("quantize.imatrix.file", "top_secret" if hide else path[:127], GGUFValueType.STRING)]
    if im.dataset:
        kv.append(("quantize.imatrix.dataset", "top_secret" if hide else im.dataset[:127], GGUFValueType.STRING))
    kv.append(("quantize.imatrix.entries_count", 0 if hide else len(im.data), GGUFValueType.INT32))
    if im.last_call > 0:
        kv.append(("quantize.imatrix.chunks_count", 0 if hide else im.last_call, GGUFValueType.INT32))
    return kv


def _ftype_description(name: str, ftype: int, base: str) -> str:
    """One line about an ftype, from ikcli's own tables: its base ggml type and that type's bits
    per weight (the mixtures give some tensors more)."""
    from engine import quantize_plan as qp
    from quant.types import type_info
    if name == "COPY":
        return "copy every tensor as it is, quantize nothing"
    if not base:
        return "a layout ikcli does not produce"
    alias = next((n for n, f, _ in qp.FTYPES if f == ftype and n.startswith(name + "_")), None)
    if alias is not None:
        return f"same as {alias}"
    tid = qp.TYPE_ID[base.lower()]
    plain, rows = qp.INTERLEAVED.get(tid, (tid, 0))
    plain_name = qp.TYPE_NAME[plain]
    bpw = None
    try:
        ti = type_info(tid)
        bpw = ti.bpw
        if ti.interleave:                # Q8_K_R8 holds q8_K blocks (ik falls back to q8_0 for it)
            plain_name, rows = qp.TYPE_NAME[type_info(ti.base).id], ti.interleave
    except KeyError:
        try:
            bpw = type_info(plain).bpw
        except KeyError:
            pass
    what = base if name.lower() == base.lower() or rows else f"{base} mix"
    if rows:
        what += f" ({plain_name} in groups of {rows} rows)"
    return what if bpw is None else f"{what}, {bpw:g} bpw"


def ftype_listing() -> str:
    """The ftypes llama-quantize accepts, in its order and layout (number, name, description)."""
    from engine import quantize_plan as qp
    lines = ["", "Allowed quantization types:"]
    for name, ftype, base in qp.FTYPES:
        head = f"  {ftype:2d}  or  " if name != "COPY" else " " * 10
        lines.append(f"{head}{name:<7s} : {_ftype_description(name, ftype, base)}")
    return "\n".join(lines) + "\n"


def _show_help(ctx: typer.Context, value: bool) -> None:
    """-h/--help: Typer's help for the options, then the ftype list as llama-quantize prints it."""
    if not value or ctx.resilient_parsing:
        return
    text = ctx.get_help()            # Typer's rich help prints itself and returns ""
    if text:
        typer.echo(text)
    typer.echo(ftype_listing(), nl=False)
    raise typer.Exit(0)


def _usage_error(msg: str) -> CliError:
    """A missing or bad TYPE: the ftype list (on stdout, as llama-quantize's usage) and one error line."""
    sys.stdout.write(ftype_listing())
    sys.stdout.flush()
    return CliError(msg)


def _type_opt(flag: str, what: str):
    return typer.Option(None, flag, metavar="TYPE", help=f"use this ggml type for {what}")


def quantize(
    args: List[str] = typer.Argument(..., metavar="IN.gguf [OUT.gguf] TYPE [NTHREADS]",
                                     help="input model, output file, quantization type (name or number), threads"),
    custom_q: List[str] = typer.Option([], "--custom-q", metavar="REGEX=TYPE,...",
                                       help="custom type rules (first match wins); @FILE reads them from a file "
                                            "(one or more per line, # comments)"),
    token_embedding_type: Optional[str] = typer.Option(None, "--token-embedding-type", metavar="TYPE",
                                                       help="use this ggml type for token_embd.weight"),
    output_tensor_type: Optional[str] = typer.Option(None, "--output-tensor-type", metavar="TYPE",
                                                     help="use this ggml type for output.weight"),
    pure: bool = typer.Option(False, "--pure", help="disable the type mixture: all tensors get the same type"),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="allow requantizing tensors that are already quantized"),
    leave_output_tensor: bool = typer.Option(False, "--leave-output-tensor",
                                             help="leave output.weight un(re)quantized"),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="print the per-tensor plan with sizes and bits per weight; write nothing"),
    imatrix: Optional[str] = typer.Option(None, "--imatrix", metavar="FILE",
                                          help="importance matrix (.dat of llama-imatrix / ikcli imatrix) for the quantizers"),
    include_weights: List[str] = typer.Option([], "--include-weights", metavar="NAME",
                                              help="use the imatrix only for tensors whose name contains NAME (repeatable)"),
    exclude_weights: List[str] = typer.Option([], "--exclude-weights", metavar="NAME",
                                              help="do not use the imatrix for tensors whose name contains NAME (repeatable)"),
    hide_imatrix: bool = typer.Option(False, "--hide-imatrix", help="do not store the imatrix details in the output"),
    ignore_imatrix_rules: bool = typer.Option(False, "--ignore-imatrix-rules",
                                              help="allow very low-bit types without importance data"),
    keep_split: bool = typer.Option(False, "--keep-split",
                                    help="write the output in the same shards as the input (PREFIX-0000i-of-0000n.gguf)"),
    repack: bool = typer.Option(False, "--repack",
                                help="rewrite tensors into their _R4/_R8 variant without re-quantizing "
                                     "(TYPE is then ignored)"),
    repack_pattern: List[str] = typer.Option([], "--repack-pattern", metavar="REGEX,...",
                                             help="with --repack: only tensors whose name one of these regexes finds"),
    attn_q_type: Optional[str] = _type_opt("--attn-q-type", "attn_q (also attn_qkv, attn_q_a, attn_q_b, as in ik)"),
    attn_k_type: Optional[str] = _type_opt("--attn-k-type", "attn_k (also attn_kv_b, attn_k_b, attn_kv_a_mqa)"),
    attn_v_type: Optional[str] = _type_opt("--attn-v-type", "attn_v"),
    attn_qkv_type: Optional[str] = _type_opt("--attn-qkv-type",
                                             "attn_qkv (accepted, but as in ik attn_q's rule comes first: no effect)"),
    attn_output_type: Optional[str] = _type_opt("--attn-output-type", "attn_output"),
    ffn_gate_type: Optional[str] = _type_opt("--ffn-gate-type", "ffn_gate (also ffn_gate_exps / _shexp)"),
    ffn_down_type: Optional[str] = _type_opt("--ffn-down-type", "ffn_down (also ffn_down_exps / _shexp)"),
    ffn_up_type: Optional[str] = _type_opt("--ffn-up-type", "ffn_up (also ffn_up_exps / _shexp)"),
    ffn_gate_inp_type: Optional[str] = _type_opt("--ffn-gate-inp-type",
                                                 "the expert routers ffn_gate_inp (else they are not quantized)"),
    override_kv: List[str] = typer.Option([], "--override-kv", metavar="KEY=TYPE:VALUE",
                                          help="set a metadata value in the output (types int, float, bool, str); "
                                               "repeatable"),
    _help: bool = typer.Option(False, "-h", "--help", is_eager=True, callback=_show_help,
                               help="Show this message and the quantization types, and exit."),
) -> None:
    from engine import quantize_plan as qp

    if repack_pattern and not repack:
        common.log("quantize: note: --repack-pattern is used only with --repack (ignored)")
    if (include_weights or exclude_weights or hide_imatrix) and not imatrix:
        common.log("quantize: note: --include-weights, --exclude-weights and --hide-imatrix are used only with "
                   "--imatrix (ignored)")
    if include_weights and exclude_weights:
        raise CliError("--include-weights and --exclude-weights cannot be used together")
    # positional arguments as llama-quantize reads them: IN [OUT] TYPE [NTHREADS]
    if len(args) < 2:
        raise _usage_error("bad arguments: expected IN.gguf [OUT.gguf] TYPE [NTHREADS]")
    fname_inp = args[0]
    rest = args[1:]
    try:
        ft = qp.parse_ftype(rest[0])
        fname_out = os.path.join(os.path.dirname(fname_inp), f"ggml-model-{ft.name}.gguf")
        rest = rest[1:]
    except qp.PlanError:
        fname_out = rest[0]
        if len(rest) < 2:
            raise _usage_error("missing ftype (expected IN.gguf OUT.gguf TYPE [NTHREADS])") from None
        try:
            ft = qp.parse_ftype(rest[1])
        except qp.PlanError as e:
            raise _usage_error(str(e)) from None
        rest = rest[2:]
    nthread = 0
    if rest:
        try:
            nthread = int(rest[0])
        except ValueError:
            raise CliError(f"invalid nthread '{rest[0]}'") from None
        rest = rest[1:]
    if rest:
        raise CliError(f"unexpected extra arguments: {' '.join(rest)}")
    if not dry_run:
        check_output_path(fname_out)       # before any work (--keep-split's shards: in _write)
    im = _prepare_imatrix(imatrix, include_weights, exclude_weights) if imatrix else None
    kv_overrides = common.parse_kv_overrides(override_kv)
    try:
        out_type = qp.parse_type(output_tensor_type) if output_tensor_type is not None else None
        emb_type = qp.parse_type(token_embedding_type) if token_embedding_type is not None else None
        given = dict(zip(qp.CLASS_TYPE_KEYS, (attn_q_type, attn_k_type, attn_v_type, attn_qkv_type, attn_output_type,
                                              ffn_gate_type, ffn_down_type, ffn_up_type)))
        class_types = {k: _parse_flag_type(k, v) for k, v in given.items() if v is not None}
        gate_inp_type = _parse_flag_type("ffn_gate_inp", ffn_gate_inp_type) if ffn_gate_inp_type is not None else None
        rules = _read_rules(custom_q)
    except qp.PlanError as e:
        raise CliError(str(e)) from None
    for r in rules:
        common.log(f"Adding custom rule {r.pattern} -> {qp.TYPE_NAME[r.qtype]}")
    if pure and rules:
        common.log("quantize: note: --custom-q rules are not applied with --pure (as in ik_llama.cpp)")
    if class_types and (pure or ft.base < 0 or not qp.is_quantized_type(ft.base)):
        common.log("quantize: note: the --attn-*-type / --ffn-*-type flags are applied only by the mixture rules, "
                   "not with --pure, COPY or an unquantized TYPE (as in ik_llama.cpp)")
    if not ignore_imatrix_rules and (im is None or not im.data) and ft.name in qp.NEED_IMATRIX_FTYPES:
        raise CliError("Please do not use IQ1_S, IQ1_M, IQ2_S, IQ2_XXS, IQ2_XS or Q2_K_S quantization without an "
                       "importance matrix")
    if ft.name in ("Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8") or (ft.base < 0 and ft.name != "COPY"):
        raise CliError(f"type {ft.name} cannot be produced by ikcli")

    from engine.gguf_file import _open_one, open_model_file
    mf = open_model_file(fname_inp)
    if kv_overrides:               # ik's model loader reads the hparams with the overrides applied
        mf.override_kv(kv_overrides, common.log)
    mi = qp.ModelInfo.from_meta(mf.meta)
    entries = list(mf.tensors.values())
    if repack:
        _repack_only(fname_inp, fname_out, mf, _open_one, entries, [p for v in repack_pattern for p in v.split(",") if p],
                     dry_run, keep_split, _override_kv_values(kv_overrides))
        return
    try:
        plans, n_fallback = qp.plan_tensors([(e.name, e.ne, e.qtype) for e in entries], ft, mi, pure=pure,
                                            leave_output=leave_output_tensor, output_type=out_type,
                                            token_embd_type=emb_type, rules=rules, block_size=_block_size,
                                            has_imatrix=im is not None and bool(im.data), class_types=class_types,
                                            ffn_gate_inp_type=gate_inp_type)
    except qp.PlanError as e:          # e.g. an expert model's tensor without a blk.N. layer
        raise CliError(str(e)) from None
    cannot = {}
    for p in plans:
        if p.quantize and not _can_produce(p.new_type):
            cannot.setdefault(qp.TYPE_NAME.get(p.new_type, str(p.new_type)), []).append(p.name)
    if not dry_run:
        if cannot:
            what = "; ".join(f"{t} (for {', '.join(n[:3])}{', ...' if len(n) > 3 else ''})" for t, n in cannot.items())
            raise CliError(f"ikcli cannot quantize to {what} yet; choose other types with --custom-q, "
                           f"--output-tensor-type, --token-embedding-type or --pure")
        for p in plans:
            if p.quantize and qp.is_quantized_type(p.src_type) and not allow_requantize:
                raise CliError(f"requantizing from type {qp.TYPE_NAME.get(p.src_type, p.src_type)} is disabled "
                               f"(tensor {p.name}); use --allow-requantize")
    file_type = ft.ftype if ft.name != "COPY" else int(mf.meta.get("general.file_type", 0) or 0)
    weights = _tensor_weights(plans, entries, im, ft, ignore_imatrix_rules, dry_run)

    common.log(f"main: quantizing '{fname_inp}' to '{fname_out}' as {ft.name}"
               + (f" using {nthread} threads" if nthread > 0 else ""))
    if dry_run:
        _print_plan(plans, entries, cannot)
        _log_outputs(fname_out, mf, entries, keep_split)
        return
    t0 = time.time()
    _write(fname_out, mf, _open_one(mf.paths[0]), entries, plans, file_type, n_fallback,
           nthread if nthread > 0 else (os.cpu_count() or 1), weights,
           _override_kv_values(kv_overrides) + _imatrix_kv(im, imatrix, hide_imatrix), keep_split=keep_split)
    t1 = time.time()
    print()
    print(f"main: quantize time = {1000 * (t1 - t0):8.2f} ms")
    print(f"main:    total time = {1000 * (t1 - t0):8.2f} ms")


def _print_plan(plans, entries, cannot) -> None:
    from engine.quantize_plan import TYPE_NAME, format_shape
    tot_org = tot_new = n_el = 0
    unknown = False
    w = max([len(p.name) for p in plans] + [6])
    out = sys.stdout
    out.write(f"{'tensor':<{w}}  {'shape':<28}  {'type':<16}  {'MiB':>10}\n")
    for p, e in zip(plans, entries):
        nb = _nbytes(p.new_type, p.ne) if p.quantize else e.nbytes
        for n in p.notes:
            common.log(n)
        src, dst = TYPE_NAME.get(p.src_type, str(p.src_type)), TYPE_NAME.get(p.new_type, str(p.new_type))
        ty = f"{src} -> {dst}" if (p.quantize or p.repack) else src
        size = f"{nb / MiB:10.3f}" if nb is not None else f"{'?':>10}"
        out.write(f"{p.name:<{w}}  [{format_shape(p.ne)}]  {ty:<16}  {size}\n")
        tot_org += e.nbytes
        n_el += e.n_elements
        if nb is None:
            unknown = True
        else:
            tot_new += nb
    bpw = 8.0 * tot_new / max(n_el, 1)
    out.write(f"total: {len(plans)} tensors, {n_el} weights, {tot_org / MiB:.2f} MiB -> "
              f"{tot_new / MiB:.2f} MiB{' (+ unknown)' if unknown else ''}, {bpw:.3f} bits per weight\n")
    if cannot:
        out.write("note: ikcli cannot produce yet: " + ", ".join(f"{t} ({len(n)} tensors)" for t, n in cannot.items())
                  + "\n")
    common.log(f"llama_model_quantize_internal: model size  = {tot_org / MiB:8.2f} MB")
    common.log(f"llama_model_quantize_internal: quant size  = {tot_new / MiB:8.2f} MB")


def _repack_only(fname_inp, fname_out, mf, open_one, entries, patterns: List[str], dry_run: bool,
                 keep_split: bool, extra_kv: Optional[list] = None) -> None:
    """llama-quantize --repack: the same blocks, rows regrouped into the _R4/_R8 layouts."""
    from engine import quantize_plan as qp
    try:
        plans = qp.plan_repack([(e.name, e.ne, e.qtype) for e in entries], patterns)
    except qp.PlanError as e:
        raise CliError(str(e)) from None
    if not any(p.repack for p in plans):
        print("=========================== llama_model_quantize_internal: nothing to do for only_repack option")
        return
    src_ft = int(mf.meta.get("general.file_type", 0) or 0)
    new_ft = qp.repacked_ftype(src_ft)
    old_name = next((n for n, f, _ in qp.FTYPES if f == src_ft and n != "COPY"), str(src_ft))
    print(f"===================== Model ftype: {old_name}: Repacked ftype: {new_ft.name if new_ft else old_name}")
    common.log(f"main: repacking '{fname_inp}' to '{fname_out}'")
    if dry_run:
        _print_plan(plans, entries, {})
        _log_outputs(fname_out, mf, entries, keep_split)
        return
    t0 = time.time()
    _write(fname_out, mf, open_one(mf.paths[0]), entries, plans, new_ft.ftype if new_ft else src_ft, 0,
           extra_kv=extra_kv, keep_split=keep_split)
    t1 = time.time()
    print()
    print(f"main: quantize time = {1000 * (t1 - t0):8.2f} ms")
    print(f"main:    total time = {1000 * (t1 - t0):8.2f} ms")


def _progress(total_tensors: int):
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[mib]:.1f} MiB written"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def _split_outputs(fname_out: str, mf, entries, keep_split: bool) -> list[tuple[str, list[int]]]:
    """(output path, indices of its tensors) per output file: one file, or with --keep-split the
    input's shards as llama_split_path names them (PREFIX-00001-of-00003.gguf)."""
    if not keep_split or len(mf.paths) < 2:
        return [(fname_out, list(range(len(entries))))]
    prefix = fname_out[:-5] if fname_out.endswith(".gguf") else fname_out
    n = len(mf.paths)
    shard = {p: i for i, p in enumerate(mf.paths)}
    return [(f"{prefix}-{i + 1:05d}-of-{n:05d}.gguf", [j for j, e in enumerate(entries) if shard[e.path] == i])
            for i in range(n)]


def _log_outputs(fname_out: str, mf, entries, keep_split: bool) -> None:
    """--dry-run --keep-split: the shards a real run would write (nothing is written)."""
    outputs = _split_outputs(fname_out, mf, entries, keep_split)
    if len(outputs) > 1:
        for path, idx in outputs:
            common.log(f"dry run: would write {path} ({len(idx)} tensors)")


def _write(fname_out, mf, reader, entries, plans, file_type, n_fallback, nthread: int = 1,
           weights: Optional[dict] = None, extra_kv: Optional[list] = None, keep_split: bool = False) -> None:
    """Write the output file(s); each one goes to a temporary name (temp_path) renamed when
    complete, and on any failure, Ctrl-C, SIGTERM or SIGHUP every file of this run is removed.
    Outputs are checked and stale temporary files of killed runs removed before any work."""
    outputs = _split_outputs(fname_out, mf, entries, keep_split)
    for path, _ in outputs:
        check_output_path(path)
        remove_stale_temps(path, "quantize")
    with terminate_cleanly():
        _write_outputs(outputs, mf, reader, entries, plans, file_type, n_fallback, nthread, weights, extra_kv)


def _write_outputs(outputs, mf, reader, entries, plans, file_type, n_fallback, nthread, weights, extra_kv) -> None:
    import numpy as np  # here, not at import: `ikcli --help` must stay light
    import gguf
    from engine.quantize_plan import TYPE_NAME, format_shape

    bar = _progress(len(plans))
    task = None
    if bar is not None:
        bar.start()
        task = bar.add_task("quantize", total=len(plans), mib=0.0)
    tot_org = tot_new = 0
    done: list[str] = []
    tmp = None
    writer = None
    path = outputs[0][0]
    try:
        for i_split, (path, idx) in enumerate(outputs):
            tmp = temp_path(path)
            writer = gguf.GGUFWriter(tmp, mf.arch or "llama")
            align = mf.meta.get("general.alignment")
            if isinstance(align, int) and align > 0:
                writer.data_alignment = align
            _copy_kv(writer, reader, file_type, extra_kv)
            if len(outputs) > 1:
                writer.add_key_value("split.no", i_split, gguf.GGUFValueType.UINT16)
                writer.add_key_value("split.count", len(outputs), gguf.GGUFValueType.UINT16)
                writer.add_key_value("split.tensors.count", len(entries), gguf.GGUFValueType.INT32)
            for j in idx:
                p, e = plans[j], entries[j]
                nb = _nbytes(p.new_type, p.ne) if p.quantize else e.nbytes
                writer.add_tensor_info(p.name, tuple(reversed(p.ne)), np.float32, nb, raw_dtype=p.new_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            n = len(plans)
            for j in idx:
                p, e = plans[j], entries[j]
                for note in p.notes:
                    _log(note, bar)
                head = (f"[{j + 1:4d}/{n:4d}] {p.name:>36s} - [{format_shape(p.ne)}], "
                        f"type = {TYPE_NAME.get(e.qtype, str(e.qtype)):>6s}, ")
                if p.repack:
                    from quant import interleaved
                    rows = e.n_elements // p.ne[0]
                    data = interleaved.repack(e.raw.view(np.ndarray).reshape(rows, -1), e.qtype, rows,
                                              p.ne[0]).reshape(-1)
                    _log(head + f"repacking to {TYPE_NAME[p.new_type]} .. size = {e.nbytes / MiB:8.2f} MiB", bar)
                elif p.quantize:
                    w = (weights or {}).get(p.name)
                    if weights is not None and w is None:
                        _log(f"====== llama_model_quantize_internal: did not find weights for {p.name}", bar)
                    data = _convert(e, p.new_type, nthread, w)
                    _log(head + f"converting to {TYPE_NAME[p.new_type]} .. size = {e.nbytes / MiB:8.2f} MiB -> "
                         f"{data.nbytes / MiB:8.2f} MiB", bar)
                else:
                    data = e.raw.view(np.ndarray).reshape(-1)
                    _log(head + f"size = {e.nbytes / MiB:8.3f} MB", bar)
                _emit(writer, data)
                tot_org += e.nbytes
                tot_new += data.nbytes
                if bar is not None:
                    bar.update(task, advance=1, mib=tot_new / MiB)
            writer.close()
            writer = None
            done.append(tmp)
            tmp = None
        for t, (path, _) in zip(done, outputs):
            os.replace(t, path)
        if bar is not None:
            bar.stop()
            bar = None
    except BaseException as exc:
        # a write error names the output (NumPy's and the OS's messages do not), judged before
        # the partial file is removed
        err = write_error(path, exc) if isinstance(exc, OSError) else None
        if bar is not None:
            bar.stop()
        if writer is not None:
            try:
                writer.close()
            except Exception:
                pass
        for t in done + ([tmp] if tmp else []):
            try:
                os.unlink(t)
            except OSError:
                pass
        if err is not None:
            raise err from None
        raise
    common.log(f"llama_model_quantize_internal: model size  = {tot_org / MiB:8.2f} MB")
    common.log(f"llama_model_quantize_internal: quant size  = {tot_new / MiB:8.2f} MB")
    if n_fallback:
        n_q = sum(p.quantize for p in plans)
        common.log(f"llama_model_quantize_internal: WARNING: {n_fallback} of {n_q} tensor(s) required fallback quantization")
