"""Importance matrices: per-column sums of squared activations of each weight, llama-imatrix style.

Collection (`Collector`, an engine.linear observer) follows ik_llama.cpp's llama-imatrix, which
sees ggml's graph nodes; the engine's products are mapped onto the nodes ik's graph would have:

* mul_mat with a weight whose name starts with "blk." (or is the output tensor, when asked
  for: --process-output, -lsim) and at least 16 activation rows: every row adds x**2 to the
  entry's sums and 1 to its counts (smaller batches are ignored, as ik does);  a 3-D per-head
  weight used through one batched product (DeepSeek's W_k_b / W_v_b, see engine.arch.deepseek2)
  is such a mul_mat in ik's graph, with one block of sums per head, under the same rules;
* mul_mat_id (MoE experts): each (expert, row) pair adds to that expert's block of sums; all
  batch sizes, all names;
* the fused dense up/gate product: ik's graph fuses it only for quantized up and gate of one
  type and shape, and then records it under the *up* tensor's name alone, whatever the batch
  size; otherwise it holds the two mul_mats (up, gate) and both are recorded as above.  The
  fused MoE one (-fmoe) likewise: fused for experts of one type and shape (recorded under up;
  ik's quantizer uses ffn_up_exps' data for ffn_gate_exps), else two mul_mat_ids;
* every recorded product adds 1 to the entry's call count (ncall); `last_call` is the largest.

`trace` (verbosity > 1) gets ik's line for each recorded product; `lsim` (-lsim) accumulates
ik's layer-similarity statistics from the same products (`LayerSimilarity`).

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
import re
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Optional

import numpy as np

from quant.types import BF16, F16, F32

MIN_ROWS = 16   # llama-imatrix ignores mul_mat products of fewer activation rows
OUTPUT_TENSOR = "output.weight"     # ik's default --output-tensor-name
_PER_HEAD = (".attn_k_b.", ".attn_v_b.")


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


def _fused_in_ik(gate, up, dense: bool) -> bool:
    """Whether ik's graph holds one fused up/gate node (else two plain products): ggml fuses
    experts of one type and shape, dense weights only when they are also quantized."""
    same = gate.qtype == up.qtype and tuple(gate.shape) == tuple(up.shape)
    return same and (not dense or up.qtype not in (F32, F16, BF16))


def _row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of a with the same row of b (0 where either is all zero)."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    ab = np.einsum("ij,ij->i", a, b)
    aa = np.einsum("ij,ij->i", a, a)
    bb = np.einsum("ij,ij->i", b, b)
    ok = (aa > 0) & (bb > 0)
    return np.where(ok, ab / np.sqrt(np.where(ok, aa * bb, 1.0)), 0.0)


@dataclass
class LayerSimilarity:
    """ik's -lsim statistics: mean cosine similarity, per token, of the activations entering
    the parts of the model, from the first recorded product of each part.

    layer[i]: layer i's input (the activations of its first product) against layer i+1's (the
    output tensor counts as the layer after the last one); attn[i]: layer i's input against the
    input of its first FFN product; ffn[i]: that FFN input against layer i+1's input.  Each maps
    a layer to [sum of cosines, rows]."""
    output_name: str = OUTPUT_TENSOR
    layer: dict = field(default_factory=dict)
    attn: dict = field(default_factory=dict)
    ffn: dict = field(default_factory=dict)
    _last_layer: int = 9999             # ik's "no layer seen yet"
    _last_ffn: int = -1
    _last_input: Optional[np.ndarray] = None
    _ffn_input: Optional[np.ndarray] = None

    def layer_index(self, name: str) -> Optional[int]:
        if name == self.output_name and self._last_layer < 199:
            return self._last_layer + 1
        m = re.match(r"blk\.(\d+)\.", name)
        return int(m.group(1)) if m else None

    def ffn_product(self, name: str, x: np.ndarray) -> None:
        """A recorded product of an ffn_* weight: the layer's first one gives its FFN input."""
        i = self.layer_index(name)
        if i is None or i != self._last_layer or i == self._last_ffn:
            return
        if self._last_input is None or self._last_input.shape != x.shape:
            raise ImatrixError(f"layer similarity: {name}: {x.shape} activations, {self._shape()} at the layer input")
        self._ffn_input = np.array(x, np.float32)
        _accumulate(self.attn, i, _row_cosines(self._ffn_input, self._last_input))
        self._last_ffn = i

    def plain_product(self, name: str, x: np.ndarray) -> None:
        """A recorded non-expert product: the first one of a new layer closes the previous one."""
        i = self.layer_index(name)
        if i is None or i == self._last_layer:
            return
        if i > 0 and self._last_input is not None:
            if self._last_input.shape != x.shape:
                raise ImatrixError(f"layer similarity: {name}: {x.shape} activations, {self._shape()} at the "
                                   f"previous layer's input")
            _accumulate(self.layer, i - 1, _row_cosines(self._last_input, x))
            if i == self._last_ffn + 1:
                _accumulate(self.ffn, i - 1, _row_cosines(self._ffn_input, x))
        self._last_layer = i
        self._last_input = np.array(x, np.float32)

    def _shape(self):
        return None if self._last_input is None else self._last_input.shape

    def report(self) -> list[str]:
        """ik's closing lines: per statistic, the layers sorted by |mean cosine| (least similar first)."""
        out: list[str] = []
        for what, sims in (("layer", self.layer), ("attention", self.attn), ("ffn", self.ffn)):
            order = sorted((np.float32(abs(s / n)), i) for i, (s, n) in sims.items() if n > 0)
            if order:
                out += ["", f"======================== sorted {what} importances"]
                out += [f"{j:3d}: Layer {i:3d}, <cos_sim> = {sims[i][0] / sims[i][1]:g}"
                        for j, (_, i) in enumerate(order)]
        return out


def _accumulate(sims: dict, i: int, cos: np.ndarray) -> None:
    s = sims.setdefault(i, [0.0, 0])
    s[0] += float(cos.sum())
    s[1] += cos.size


@dataclass
class Collector:
    """Accumulates llama-imatrix's statistics from engine.linear's observer calls.

    on_call(last_call): called whenever a product raises the largest call count (after that
    product is accumulated) — where llama-imatrix saves periodically.
    output_name: a weight outside the blocks to record too (ik: --process-output, -lsim).
    trace: gets ik's verbosity-2 line of each recorded product.
    lsim: -lsim's statistics, fed from the recorded products."""
    entries: dict[str, Entry] = field(default_factory=dict)
    last_call: int = 0
    on_call: Optional[Callable[[int], None]] = None
    output_name: Optional[str] = None
    trace: Optional[Callable[[str], None]] = None
    lsim: Optional[LayerSimilarity] = None
    _n_tokens: int = 0      # tokens of the current micro-batch: rows of the latest plain product

    # ---- collection (engine.linear observer) ---------------------------------------------
    def __call__(self, op: str, weights: tuple, x: np.ndarray, ids, rows) -> None:
        if op == "mul_mat_id":
            w = weights[0]
            if any(s in w.name for s in _PER_HEAD):
                self._heads(w, x, ids)
            else:
                self._experts("MUL_MAT_ID", w, x, ids, rows)
            return
        self._n_tokens = x.shape[0]      # the router / shared input precedes the expert products
        if op == "mul_mat":
            self._plain(weights[0], x)
        elif op == "fused_up_gate":
            gate, up = weights
            if _fused_in_ik(gate, up, dense=True):
                if up.name:                 # any batch size, any name, as ik
                    self._dense("FUSED_UP_GATE", up, x)
            else:
                self._plain(up, x)
                self._plain(gate, x)
        elif op == "moe_fused_up_gate":
            gate, up = weights
            if _fused_in_ik(gate, up, dense=False):
                self._experts("MOE_FUSED_UP_GATE", up, x, ids, rows)
            else:
                self._experts("MUL_MAT_ID", up, x, ids, rows)
                self._experts("MUL_MAT_ID", gate, x, ids, rows)

    def _wanted(self, name: str, n_rows: int) -> bool:
        """ik's rule for a plain mul_mat: a block's weight (or the output tensor when asked for),
        at least MIN_ROWS activation rows."""
        return n_rows >= MIN_ROWS and (name.startswith("blk.") or (bool(name) and name == self.output_name))

    def _entry(self, name: str, n: int, n_as: int) -> Entry:
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = _new_entry(n, n_as)
        elif e.values.size != n:
            raise ImatrixError(f"inconsistent size for {name} ({e.values.size} vs {n})")
        return e

    def _observe(self, name: str, x: np.ndarray, plain: bool) -> None:
        """-lsim's view of a recorded product (ik: FFN inputs from any op, layer inputs from plain ones)."""
        if self.lsim is None:
            return
        if ".ffn_" in name:
            self.lsim.ffn_product(name, x)
        if plain:
            self.lsim.plain_product(name, x)

    def _emit(self, op: str, name: str, cols: int, n: int) -> None:
        if self.trace is not None:        # ik prints the call count as it was before this product
            self.trace(f"collect_imatrix[{self.last_call}]: {name:>32s}, {op}, {cols:5d} x {n:5d}, 0")

    def _plain(self, w, x: np.ndarray) -> None:
        if self._wanted(w.name, x.shape[0]):
            self._dense("MUL_MAT", w, x)

    def _dense(self, op: str, w, x: np.ndarray) -> None:
        if len(w.shape) > 2:
            raise ImatrixError(f"{w.name}: a {len(w.shape)}-D weight in a plain product")
        self._observe(w.name, x, plain=True)
        e = self._entry(w.name, x.shape[1], 1)
        e.ncall += 1
        self._emit(op, w.name, x.shape[1], x.shape[0])
        sq = np.einsum("ij,ij->j", x, x, dtype=np.float64)
        if not np.isfinite(sq).all():
            raise ImatrixError(f"detected NaNs in {w.name}")
        e.values += sq
        e.counts += x.shape[0]
        self._bump(e)

    def _heads(self, w, x: np.ndarray, ids: np.ndarray) -> None:
        """A per-head weight (H, N, K) applied to x (T*H, K): ik's 3-D mul_mat, one block per head."""
        n_head = w.shape[0]
        n_tok = np.asarray(ids).size // max(n_head, 1)
        if not self._wanted(w.name, n_tok):
            return
        self._observe(w.name, x, plain=True)
        e = self._entry(w.name, x.shape[1] * n_head, n_head)
        e.ncall += 1
        self._emit("MUL_MAT", w.name, x.shape[1], n_tok)
        self._add_pairs(w.name, e, x, ids, np.arange(np.asarray(ids).size))

    def _experts(self, op: str, w, x: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        if not w.name:
            return
        self._observe(w.name, x, plain=False)
        n_as = w.shape[0] if len(w.shape) == 3 else 1
        e = self._entry(w.name, x.shape[1] * n_as, n_as)
        e.ncall += 1
        self._emit(op, w.name, x.shape[1], self._n_tokens)
        self._add_pairs(w.name, e, x, ids, rows)

    def _add_pairs(self, name: str, e: Entry, x: np.ndarray, ids, rows) -> None:
        """Each (block, row) pair adds x[row]**2 to that block's sums."""
        ids = np.asarray(ids, np.int64)
        rows = np.asarray(rows, np.int64)
        if ids.size:
            cols = e.cols
            order = np.argsort(ids, kind="stable")
            sid = ids[order]
            sq = x[rows[order]].astype(np.float64)
            sq *= sq
            starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
            sums = np.add.reduceat(sq, starts, axis=0)
            n_per = np.diff(np.r_[starts, sid.size])
            if not np.isfinite(sums).all():
                raise ImatrixError(f"detected NaNs in {name}")
            used = sid[starts]
            e.values.reshape(e.n_as, cols)[used] += sums
            e.counts.reshape(e.n_as, cols)[used] += n_per[:, None]
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
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):   # write_dat refuses non-finite
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
    """Write a legacy .dat file atomically (temporary file in the same folder, then rename).

    Every entry must have ncall > 0 and finite values (ImatrixError naming the entry otherwise,
    before anything is written): a reader would refuse the file."""
    for name, ncall, vals in entries:
        v = np.asarray(vals, dtype=np.float32)
        bad = np.flatnonzero(~np.isfinite(v))
        if bad.size:
            raise ImatrixError(f"{path}: not written: entry '{name}' has a non-finite value "
                               f"({v[bad[0]]} at index {bad[0]})")
        if int(ncall) <= 0:
            raise ImatrixError(f"{path}: not written: entry '{name}' has ncall {int(ncall)} (must be > 0)")
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
    """Read a legacy .dat file (ours or llama-imatrix's); ImatrixError with one line if it is bad.

    Refused, naming the file and the entry: counts that do not fit the file, ncall <= 0,
    negative or non-finite values, a name used twice, bytes after the dataset name."""
    try:
        with open(path, "rb") as fh:
            buf = fh.read()
    except OSError as e:
        raise ImatrixError(f"failed to open {path}: {e.strerror}") from None
    off = 0
    of = ""                 # "; the file claims N entries", once N is read

    def take(n: int, what: str) -> bytes:
        nonlocal off
        if off + n > len(buf):
            raise ImatrixError(f"{path}: truncated file (failed reading {what}{of})")
        b = buf[off:off + n]
        off += n
        return b

    if len(buf) < 4:
        raise ImatrixError(f"no data in file {path}")
    (n_entries,) = struct.unpack("<i", take(4, "the entry count"))
    if n_entries < 1:
        raise ImatrixError(f"no data in file {path}")
    of = f"; the file claims {n_entries} entries"
    entries = []
    seen: set[str] = set()
    for i in range(n_entries):
        (ln,) = struct.unpack("<i", take(4, f"the name of entry {i + 1}"))
        if ln < 0 or ln > 1 << 16 or ln > len(buf) - off:
            raise ImatrixError(f"{path}: bad name length {ln} for entry {i + 1} (not an imatrix .dat file?)")
        try:
            name = take(ln, f"the name of entry {i + 1}").decode("utf-8")
        except UnicodeDecodeError:
            raise ImatrixError(f"{path}: entry {i + 1} has a name that is not UTF-8 (not an imatrix .dat file?)") from None
        what = f"entry {i + 1} ('{name}')"
        ncall, nval = struct.unpack("<ii", take(8, f"the size of {what}"))
        if nval < 1:
            raise ImatrixError(f"{path}: failed reading number of values for {what}")
        if 4 * nval > len(buf) - off:
            raise ImatrixError(f"{path}: {what} claims {nval} values but only {len(buf) - off} bytes are left "
                               f"in the file")
        if ncall <= 0:
            raise ImatrixError(f"{path}: {what} has ncall {ncall} (must be > 0)")
        if name in seen:
            raise ImatrixError(f"{path}: {what} repeats an earlier entry's name")
        seen.add(name)
        vals = np.frombuffer(take(4 * nval, f"the data of {what}"), dtype="<f4").astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(vals))
        if bad.size:
            raise ImatrixError(f"{path}: {what} has a non-finite value ({vals[bad[0]]} at index {bad[0]})")
        bad = np.flatnonzero(vals < 0)
        if bad.size:
            raise ImatrixError(f"{path}: {what} has a negative value ({vals[bad[0]]:g} at index {bad[0]}); "
                               f"importance values are mean squares")
        entries.append((name, ncall, vals))
    last_call, dataset = 0, ""
    if off < len(buf):
        tail = f"after the last entry ({n_entries}: '{entries[-1][0]}')"
        of = f"; does the file hold more than the {n_entries} entries it claims?"
        (last_call,) = struct.unpack("<i", take(4, f"the chunk count {tail}"))
        (ln,) = struct.unpack("<i", take(4, f"the dataset name {tail}"))
        if last_call < 0 or ln < 0 or ln > len(buf) - off:
            raise ImatrixError(f"{path}: bad chunk count {last_call} or dataset name length {ln} {tail}{of}")
        dataset = take(ln, f"the dataset name {tail}").decode("utf-8", errors="replace")
        if off < len(buf):
            raise ImatrixError(f"{path}: {len(buf) - off} bytes of unexpected data {tail} and the dataset name{of}")
    return DatFile(entries, last_call, dataset)


def mean_squares(dat: DatFile) -> dict[str, np.ndarray]:
    """Per-column weights for quantization: values / ncall (what llama-quantize loads)."""
    return {name: (vals / np.float32(ncall) if ncall > 0 else vals).astype(np.float32)
            for name, ncall, vals in dat.entries}
