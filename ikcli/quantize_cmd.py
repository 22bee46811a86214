"""`ikcli quantize`: llama-quantize's arguments, per-tensor type rules, log lines and GGUF output.

    ikcli quantize [options] IN.gguf [OUT.gguf] TYPE [NTHREADS]

The per-tensor choices are engine.quantize_plan's (ik_llama.cpp's rules for the base types ikcli
can produce); the bytes come from quant.reference.  The output is written to a temporary file
in the destination folder and renamed only once complete.
"""
from __future__ import annotations

import os
import sys
import time
from typing import List, Optional

import typer

from . import common
from .errors import CliError

MiB = 1024.0 * 1024.0


def _log(msg: str, bar=None) -> None:
    if bar is not None:
        bar.console.print(msg, markup=False, highlight=False, soft_wrap=True)
    else:
        common.log(msg)


def _can_produce(t: int) -> bool:
    """Whether quant.reference can write type t (NotImplementedError: not yet)."""
    import numpy as np  # here, not at import: `ikcli --help` must stay light
    from quant import reference
    from quant.types import type_info
    try:
        bs = type_info(t).block_size
        reference.quantize(np.zeros(max(bs, 1) * (256 // bs if bs and 256 % bs == 0 else 1), np.float32), t)
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


def _convert(entry, new_type: int, nthread: int = 1):
    """Re-encode one tensor (any number of dims, row-wise in chunks) as new_type; flat uint8 bytes.

    Chunks of rows run on `nthread` threads (NTHREADS): the NumPy quantizers spend most of
    their time in array operations that release the GIL."""
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

    def one(i: int) -> None:
        part = src[i:i + chunk]
        if entry.qtype == F32:
            x = part.view(np.float32)
        else:
            x = dequantize(QTensor(part, entry.qtype, (part.shape[0], ne0)))
        out[i:i + part.shape[0]] = reference.quantize(x, new_type).reshape(part.shape[0], out_rb)

    starts = range(0, rows, chunk)
    if nthread > 1 and len(starts) > 1:
        with ThreadPoolExecutor(max_workers=nthread) as pool:
            list(pool.map(one, starts))
    else:
        for i in starts:
            one(i)
    return out.reshape(-1)


def _emit(writer, data) -> None:
    """Append one tensor's bytes (a separate function so tests can simulate a failure)."""
    writer.write_tensor_data(data)


def _copy_kv(writer, reader, ftype_value: int) -> None:
    from gguf import GGUFValueType
    from engine.gguf_meta import field_value
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "split.no", "split.count", "split.tensors.count"):
            continue
        if not f.types:
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field_value(f), vt, sub)
    writer.add_key_value("general.quantization_version", 2, GGUFValueType.UINT32)
    writer.add_key_value("general.file_type", ftype_value, GGUFValueType.UINT32)


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
    imatrix: Optional[str] = typer.Option(None, "--imatrix", metavar="FILE", help="importance matrix (not supported yet)"),
) -> None:
    from engine import quantize_plan as qp

    if imatrix is not None:
        raise CliError("--imatrix is not supported yet by ikcli quantize")
    # positional arguments as llama-quantize reads them: IN [OUT] TYPE [NTHREADS]
    if len(args) < 2:
        raise CliError("bad arguments: expected IN.gguf [OUT.gguf] TYPE [NTHREADS]")
    fname_inp = args[0]
    rest = args[1:]
    try:
        ft = qp.parse_ftype(rest[0])
        fname_out = os.path.join(os.path.dirname(fname_inp), f"ggml-model-{ft.name}.gguf")
        rest = rest[1:]
    except qp.PlanError:
        fname_out = rest[0]
        if len(rest) < 2:
            raise CliError("missing ftype (expected IN.gguf OUT.gguf TYPE [NTHREADS])") from None
        try:
            ft = qp.parse_ftype(rest[1])
        except qp.PlanError as e:
            raise CliError(str(e)) from None
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
    try:
        out_type = qp.parse_type(output_tensor_type) if output_tensor_type is not None else None
        emb_type = qp.parse_type(token_embedding_type) if token_embedding_type is not None else None
        rules = _read_rules(custom_q)
    except qp.PlanError as e:
        raise CliError(str(e)) from None
    for r in rules:
        common.log(f"Adding custom rule {r.pattern} -> {qp.TYPE_NAME[r.qtype]}")
    if pure and rules:
        common.log("quantize: note: --custom-q rules are not applied with --pure (as in ik_llama.cpp)")
    if ft.name in ("MXFP4_R8", "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8") or (ft.base < 0 and ft.name != "COPY"):
        raise CliError(f"type {ft.name} cannot be produced by ikcli")

    from engine.gguf_file import _open_one, open_model_file
    mf = open_model_file(fname_inp)
    arch = mf.arch
    mi = qp.ModelInfo(arch=arch, n_layer=int(mf.meta.get(f"{arch}.block_count", 0) or 0),
                      n_expert=int(mf.meta.get(f"{arch}.expert_count", 0) or 0))
    entries = list(mf.tensors.values())
    if not ft.rules_implemented and not pure and ft.name != "COPY":
        common.log(f"quantize: warning: the per-tensor mixture rules of {ft.name} are not implemented; using "
                   f"{qp.TYPE_NAME[ft.base]} except the output/embedding/expert-attention rules")
    plans, n_fallback = qp.plan_tensors([(e.name, e.ne, e.qtype) for e in entries], ft, mi, pure=pure,
                                        leave_output=leave_output_tensor, output_type=out_type,
                                        token_embd_type=emb_type, rules=rules, block_size=_block_size)
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

    common.log(f"main: quantizing '{fname_inp}' to '{fname_out}' as {ft.name}"
               + (f" using {nthread} threads" if nthread > 0 else ""))
    if dry_run:
        _print_plan(plans, entries, cannot)
        return
    t0 = time.time()
    _write(fname_out, mf, _open_one(mf.paths[0]), entries, plans, file_type, n_fallback,
           nthread if nthread > 0 else (os.cpu_count() or 1))
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
        ty = f"{src} -> {dst}" if p.quantize else src
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


def _progress(total_tensors: int):
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[mib]:.1f} MiB written"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def _write(fname_out, mf, reader, entries, plans, file_type, n_fallback, nthread: int = 1) -> None:
    import numpy as np  # here, not at import: `ikcli --help` must stay light
    import gguf
    from engine.quantize_plan import TYPE_NAME, format_shape
    from quant.types import type_info

    out_dir = os.path.dirname(os.path.abspath(fname_out))
    if not os.path.isdir(out_dir):
        raise CliError(f"output folder '{out_dir}' does not exist")
    tmp = os.path.join(out_dir, f".{os.path.basename(fname_out)}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, mf.arch or "llama")
    align = mf.meta.get("general.alignment")
    if isinstance(align, int) and align > 0:
        writer.data_alignment = align
    bar = _progress(len(plans))
    try:
        _copy_kv(writer, reader, file_type)
        for p, e in zip(plans, entries):
            nb = _nbytes(p.new_type, p.ne) if p.quantize else e.nbytes
            writer.add_tensor_info(p.name, tuple(reversed(p.ne)), np.float32, nb, raw_dtype=p.new_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        tot_org = tot_new = 0
        n = len(plans)
        task = None
        if bar is not None:
            bar.start()
            task = bar.add_task("quantize", total=n, mib=0.0)
        for i, (p, e) in enumerate(zip(plans, entries)):
            for note in p.notes:
                _log(note, bar)
            head = (f"[{i + 1:4d}/{n:4d}] {p.name:>36s} - [{format_shape(p.ne)}], "
                    f"type = {TYPE_NAME.get(e.qtype, str(e.qtype)):>6s}, ")
            if p.quantize:
                data = _convert(e, p.new_type, nthread)
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
        if bar is not None:
            bar.stop()
            bar = None
        os.replace(tmp, fname_out)
    except BaseException:
        if bar is not None:
            bar.stop()
        try:
            writer.close()
        except Exception:
            pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    common.log(f"llama_model_quantize_internal: model size  = {tot_org / MiB:8.2f} MB")
    common.log(f"llama_model_quantize_internal: quant size  = {tot_new / MiB:8.2f} MB")
    if n_fallback:
        n_q = sum(p.quantize for p in plans)
        common.log(f"llama_model_quantize_internal: WARNING: {n_fallback} of {n_q} tensor(s) required fallback quantization")
    _ = type_info
