"""Kernels loaded back from numba's on-disk cache run as the freshly compiled ones did.

numba writes every compiled kernel to quant/__pycache__ and a later process loads it instead of
compiling.  A kernel can compile and run in the process that built it and still fail when loaded
back: a fresh process loading the cached Q8_0_R8 products of quant.kernels.matvec_act died with a
segmentation fault, twice over the sessions.  The cause (numba issue 8578): matvec_act, cached and
not parallel, calls the parallel matvec_int, and loaded from the cache it does not start numba's
thread pool; quant.kernels now starts it at import.  Here this process computes a few products
(compiling, or loading what an earlier run cached), then a fresh interpreter computes them again
from the cache, and both must agree bit for bit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Q8_0_R8 (quant.simd's 8-row kernels: the crash above) and Q5_0 (a legacy grouped row dot with
# the vector f16 conversion); one token and three (the pair kernels)
SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {root!r})
from quant import matmul as M
from quant.interleaved import repack
from quant.tensor import QTensor
rng = np.random.default_rng(11)
out = []
for name, qt in (("Q8_0_R8", 8), ("Q5_0", 6)):
    w = M.quantize_tensor(rng.standard_normal((64, 1024)).astype(np.float32), qt)
    if name.endswith("_R8"):
        w = QTensor(repack(w.data, qt, 64, 1024), 208, (64, 1024))
    for n in (1, 3):
        x = rng.standard_normal((n, 1024)).astype(np.float32)
        out.append(M.matmul(w, x))
np.save(sys.argv[1], np.concatenate([o.reshape(-1) for o in out]))
"""


def test_cached_kernels_run_in_a_new_process(tmp_path):
    script = tmp_path / "products.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    here, there = tmp_path / "here.npy", tmp_path / "there.npy"
    ns: dict = {}
    sys.argv, argv = ["products.py", str(here)], sys.argv
    try:
        exec(compile(script.read_text(), str(script), "exec"), ns)
    finally:
        sys.argv = argv
    proc = subprocess.run([sys.executable, str(script), str(there)], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(np.load(here), np.load(there))


def test_kernels_are_stamped_with_the_package_sources():
    """numba checks a cached kernel against its own file only; ikcli's kernels are built from
    other modules too (quant.simd*'s IR, jitted helpers), so quant.numba_stamp adds a digest of
    quant/ (engine kernels: quant/ and engine/) to the stamp numba compares."""
    from engine import rope
    from quant import kernels, numba_stamp
    for fn, dirs in ((kernels._sums32, ("quant",)), (rope._rotate, ("quant", "engine"))):
        stamp = fn._cache._impl.locator.get_source_stamp()
        assert isinstance(stamp, tuple) and stamp[1] == numba_stamp.sources_digest(dirs), fn


def test_sources_digest_follows_every_file(tmp_path):
    """An edit to any module of the folder, or a new one, changes the digest."""
    from quant.numba_stamp import sources_digest
    digest = sources_digest.__wrapped__      # numba's stamps are read once per process: cached there
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "a.py").write_text("x = 1\n")
    first = digest(("quant",), tmp_path)
    (tmp_path / "quant" / "a.py").write_text("x = 2\n")
    second = digest(("quant",), tmp_path)
    (tmp_path / "quant" / "b.py").write_text("")
    assert len({first, second, digest(("quant",), tmp_path)}) == 3


def test_concurrent_saves_of_two_overloads_keep_both(tmp_path, monkeypatch):
    """Two savers of one kernel's cache, each with a new overload, must not both take `.1.nbc`:
    numba reads the index, picks the first unused data name, then writes the index, so without
    quant.numba_stamp's lock the slower saver's index drops the other's key (a pause after the
    index read makes that interleaving certain here)."""
    import threading
    import time

    from numba.core import caching

    from quant.numba_stamp import _lock_cache_saves
    _lock_cache_saves()
    cls = caching.IndexDataCacheFile
    read_index = cls._load_index

    def slow_read(self):
        overloads = read_index(self)
        time.sleep(0.2)
        return overloads
    monkeypatch.setattr(cls, "_load_index", slow_read)
    stamp = ("stamp", 1)
    savers = [cls(str(tmp_path), "kernel-1", stamp) for _ in range(2)]
    threads = [threading.Thread(target=s.save, args=((f"sig{i}",), f"code{i}")) for i, s in enumerate(savers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(cls, "_load_index", read_index)
    reader = cls(str(tmp_path), "kernel-1", stamp)
    assert [reader.load((f"sig{i}",)) for i in range(2)] == ["code0", "code1"]
