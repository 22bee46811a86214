"""Importance matrices: per-column sums of squared activations of each weight, llama-imatrix style.

Collection (`Collector`, an engine.linear observer) follows ik_llama.cpp's llama-imatrix:

* mul_mat with a weight whose name starts with "blk." and at least 16 activation rows: every
  row adds x**2 to the entry's sums and 1 to its counts (smaller batches are ignored, as ik
  does);  a 3-D per-head weight used through one batched product (DeepSeek's W_k_b, see
  engine.arch.deepseek2) has one block of sums per head, under the same rules;
* mul_mat_id (MoE experts): each (expert, row) pair adds to that expert's block of sums; all
  batch sizes, all names;
* the fused dense up/gate product counts as the two mul_mats ik records; the fused MoE one
  (-fmoe) only under the *up* tensor's name, as ik does (its quantizer uses ffn_up_exps' data
  for ffn_gate_exps);
* every recorded product adds 1 to the entry's call count (ncall); `last_call` is the largest.

The `.dat` file ("legacy" format, little endian): int32 n_entries; per entry int32 name length,
name bytes, int32 ncall, int32 nval, nval float32 values; then int32 last_call, int32 length and
the bytes of the dataset (text file) name.  A value is sum/count*ncall (the mean square times
the number of calls): readers divide by ncall.  Reading one file back adds values to the sums
and ncall to the counts and calls (ik's load_imatrix), so several files combine call-weighted.
Entries with columns that saw no data are skipped when saving, except MoE entries where fewer
than 5 % (rounded) of the experts lack data: those experts get value 1 (count 1) and are kept.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Optional

import numpy as np

MIN_ROWS = 16   # llama-imatrix ignores mul_mat products of fewer activation rows


class ImatrixError(ValueError):
    """A bad or unreadable .dat file, or data that cannot be combined; str() is one line."""


@dataclass
class Entry:
    """One weight's statistics: n_as blocks (experts / heads) of `cols` columns."""
    values: np.ndarray          # float64 (n_as * cols,): sums of squares
    counts: np.ndarray          # int64 (n_as * cols,)
    ncall: int = 0
    n_as: int = 1

    @property
    def cols(self) -> int:
        return self.values.size // self.n_as


def _new_entry(n: int, n_as: int) -> Entry:
    return Entry(np.zeros(n, np.float64), np.zeros(n, np.int64), 0, n_as)


@dataclass
class Collector:
    """Accumulates llama-imatrix's statistics from engine.linear's observer calls.

    on_call(last_call): called whenever a product raises the largest call count (after that
    product is accumulated) — where llama-imatrix saves periodically."""
    entries: dict[str, Entry] = field(default_factory=dict)
    last_call: int = 0
    on_call: Optional[Callable[[int], None]] = None

    # ---- collection (engine.linear observer) ---------------------------------------------
    def __call__(self, op: str, weights: tuple, x: np.ndarray, ids, rows) -> None:
        if op == "mul_mat":
            self._dense(weights[0], x)
        elif op == "fused_up_gate":
            self._dense(weights[0], x)
            self._dense(weights[1], x)
        elif op == "mul_mat_id":
            self._experts(weights[0], x, ids, rows)
        elif op == "moe_fused_up_gate":
            self._experts(weights[1], x, ids, rows)

    def _entry(self, name: str, n: int, n_as: int) -> Entry:
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = _new_entry(n, n_as)
        elif e.values.size != n:
            raise ImatrixError(f"inconsistent size for {name} ({e.values.size} vs {n})")
        return e

    def _dense(self, w, x: np.ndarray) -> None:
        if not w.name.startswith("blk.") or x.shape[0] < MIN_ROWS:
            return
        if len(w.shape) > 2:
            raise ImatrixError(f"{w.name}: a {len(w.shape)}-D weight in a plain product")
        e = self._entry(w.name, x.shape[1], 1)
        e.ncall += 1
        sq = np.einsum("ij,ij->j", x, x, dtype=np.float64)
        self._add(w.name, e, sq, x.shape[0])

    def _experts(self, w, x: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        if not w.name:
            return
        n_as = w.shape[0] if len(w.shape) == 3 else 1
        cols = x.shape[1]
        ids = np.asarray(ids, np.int64)
        rows = np.asarray(rows, np.int64)
        per_head = ".attn_k_b." in w.name or ".attn_v_b." in w.name
        if per_head and ids.size // max(n_as, 1) < MIN_ROWS:   # ik: a plain (batched) mul_mat
            return
        e = self._entry(w.name, cols * n_as, n_as)
        e.ncall += 1
        if ids.size:
            order = np.argsort(ids, kind="stable")
            sid = ids[order]
            sq = x[rows[order]].astype(np.float64)
            sq *= sq
            starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
            sums = np.add.reduceat(sq, starts, axis=0)
            n_per = np.diff(np.r_[starts, sid.size])
            v = e.values.reshape(n_as, cols)
            c = e.counts.reshape(n_as, cols)
            used = sid[starts]
            if not np.isfinite(sums).all():
                raise ImatrixError(f"detected NaNs in {w.name}")
            v[used] += sums
            c[used] += n_per[:, None]
        self._bump(e)

    def _add(self, name: str, e: Entry, sq: np.ndarray, n: int) -> None:
        if not np.isfinite(sq).all():
            raise ImatrixError(f"detected NaNs in {name}")
        e.values += sq
        e.counts += n
        self._bump(e)

    def _bump(self, e: Entry) -> None:
        if e.ncall > self.last_call:
            self.last_call = e.ncall
            if self.on_call is not None:
                self.on_call(self.last_call)

    # ---- files ---------------------------------------------------------------------------
    def load(self, path: str) -> None:
        """Add a .dat file's data (ik's load_imatrix: sums += values, counts and calls += ncall)."""
        for name, ncall, vals in read_dat(path).entries:
            e = self.entries.get(name)
            if e is None:
                e = self.entries[name] = _new_entry(vals.size, 1)
            elif e.values.size != vals.size:
                raise ImatrixError(f"{path}: entry '{name}' has {vals.size} values, "
                                   f"{e.values.size} in the data already loaded")
            e.values += vals.astype(np.float64)
            e.counts += ncall
            e.ncall += ncall

    def select(self, log: Callable[[str], None] = lambda s: None) -> list[tuple[str, int, np.ndarray]]:
        """The entries save() writes, as (name, ncall, float32 values); logs ik's partial-data lines.

        Like ik, an MoE entry kept despite missing experts has those experts set to value 1,
        count 1 in the collector itself."""
        out = []
        first = True
        for name, e in self.entries.items():
            n_all = e.counts.size
            if n_all == 0:
                continue
            n_zero = int((e.counts == 0).sum())
            if n_zero and first:
                log("")
                first = False
            if n_zero == n_all:
                log(f"save_imatrix: entry '{name:>40s}' has no data - skipping")
                continue
            if n_zero:
                msg = f"save_imatrix: entry '{name:>40s}' has partial data ({100.0 * (n_all - n_zero) / n_all:.2f}%)"
                keep = False
                if e.n_as > 1:
                    c = e.counts.reshape(e.n_as, -1)
                    bad = np.flatnonzero((c == 0).any(axis=1))
                    msg += f" {bad.size} out of {e.n_as} experts are missing data"
                    if bad.size < _round_half_away(e.n_as * 0.05):
                        log(msg + " Storing **but be aware**")
                        keep = True
                        e.counts.reshape(e.n_as, -1)[bad] = 1
                        e.values.reshape(e.n_as, -1)[bad] = 1.0
                if not keep:
                    log(msg + " - skipping")
                    continue
            with np.errstate(divide="ignore", invalid="ignore"):
                # in float32 as ik does (combining files then gives ik's bytes)
                vals = (e.values.astype(np.float32) / e.counts.astype(np.float32)) * np.float32(e.ncall)
            out.append((name, e.ncall, vals))
        if len(out) < len(self.entries):
            log(f"save_imatrix: warning: storing only {len(out)} out of {len(self.entries)} entries")
        return out

    def save(self, path: str, dataset: str, log: Callable[[str], None] = lambda s: None) -> int:
        """Write the .dat file (via a temporary file renamed when complete); returns the entry count."""
        sel = self.select(log)
        write_dat(path, sel, self.last_call, dataset)
        return len(sel)


def _round_half_away(v: float) -> int:
    """C's round(): halves away from zero (Python's round() goes to even)."""
    return int(np.floor(v + 0.5)) if v >= 0 else -int(np.floor(-v + 0.5))


# ---- the .dat format ---------------------------------------------------------------------

@dataclass
class DatFile:
    entries: list[tuple[str, int, np.ndarray]]   # (name, ncall, float32 values)
    last_call: int = 0
    dataset: str = ""


def _write_entries(fh: BinaryIO, entries, last_call: int, dataset: str) -> None:
    fh.write(struct.pack("<i", len(entries)))
    for name, ncall, vals in entries:
        nb = name.encode("utf-8")
        fh.write(struct.pack("<i", len(nb)))
        fh.write(nb)
        fh.write(struct.pack("<ii", int(ncall), int(vals.size)))
        fh.write(np.ascontiguousarray(vals, dtype="<f4").tobytes())
    fh.write(struct.pack("<i", int(last_call)))
    ds = dataset.encode("utf-8")
    fh.write(struct.pack("<i", len(ds)))
    fh.write(ds)


def write_dat(path: str, entries, last_call: int, dataset: str) -> None:
    """Write a legacy .dat file atomically (temporary file in the same folder, then rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            _write_entries(fh, entries, last_call, dataset)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_dat(path: str) -> DatFile:
    """Read a legacy .dat file (ours or llama-imatrix's); ImatrixError with one line if it is bad."""
    try:
        with open(path, "rb") as fh:
            buf = fh.read()
    except OSError as e:
        raise ImatrixError(f"failed to open {path}: {e.strerror}") from None
    off = 0

    def take(n: int, what: str) -> bytes:
        nonlocal off
        if off + n > len(buf):
            raise ImatrixError(f"{path}: truncated file (failed reading {what})")
        b = buf[off:off + n]
        off += n
        return b

    if len(buf) < 4:
        raise ImatrixError(f"no data in file {path}")
    (n_entries,) = struct.unpack("<i", take(4, "the entry count"))
    if n_entries < 1:
        raise ImatrixError(f"no data in file {path}")
    entries = []
    for i in range(n_entries):
        (ln,) = struct.unpack("<i", take(4, f"the name of entry {i + 1}"))
        if ln < 0 or ln > 1 << 16:
            raise ImatrixError(f"{path}: bad name length {ln} for entry {i + 1} (not an imatrix .dat file?)")
        try:
            name = take(ln, f"the name of entry {i + 1}").decode("utf-8")
        except UnicodeDecodeError:
            raise ImatrixError(f"{path}: entry {i + 1} has a name that is not UTF-8 (not an imatrix .dat file?)") from None
        ncall, nval = struct.unpack("<ii", take(8, f"the size of entry {i + 1}"))
        if nval < 1:
            raise ImatrixError(f"{path}: failed reading number of values for entry {i + 1} ('{name}')")
        vals = np.frombuffer(take(4 * nval, f"the data of entry {i + 1} ('{name}')"), dtype="<f4").astype(np.float32)
        entries.append((name, ncall, vals))
    last_call, dataset = 0, ""
    if off < len(buf):
        (last_call,) = struct.unpack("<i", take(4, "the chunk count"))
        (ln,) = struct.unpack("<i", take(4, "the dataset name"))
        if ln < 0:
            raise ImatrixError(f"{path}: bad dataset name length {ln}")
        dataset = take(ln, "the dataset name").decode("utf-8", errors="replace")
    return DatFile(entries, last_call, dataset)


def mean_squares(dat: DatFile) -> dict[str, np.ndarray]:
    """Per-column weights for quantization: values / ncall (what llama-quantize loads)."""
    return {name: (vals / np.float32(ncall) if ncall > 0 else vals).astype(np.float32)
            for name, ncall, vals in dat.entries}
