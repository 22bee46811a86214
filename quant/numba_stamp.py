"""numba's on-disk kernel cache, stamped with the sources of the whole package.

numba checks a cached kernel against its own file only, but ikcli's kernels are built from
other modules too (IR generated in quant.simd*, jitted helpers compiled into their callers): an
edit there, or a `git pull` into the README's editable install, would leave the callers'
caches valid and running the old code.  The locator here adds a digest of every module of
quant/ (and for kernels outside it, of engine/ too) to the stamp numba compares, so any such
edit recompiles them.  install() puts it first in numba's list without importing numba (the
CLI's --help must not): through NUMBA_CACHE_LOCATOR_CLASSES before numba is imported, or in
numba's list itself after.
"""
from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
LOCATOR = "quant.numba_stamp.StampedLocator"
# the top-level folders whose kernels are ikcli's (tests/ and scripts/ in a source tree)
_OURS = ("quant", "engine", "ikcli", "tests", "scripts")


@lru_cache(maxsize=None)
def sources_digest(dirs: tuple[str, ...], root: Path = _ROOT) -> str:
    """sha256 over the names and bytes of the .py files of the folders dirs (under root: the
    package root); once per process, as numba reads a kernel's cache once."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted((root / d).glob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def digest_for(py_file: str) -> str | None:
    """The digest a kernel defined in py_file is stamped with; None for files not ikcli's."""
    try:
        top = Path(py_file).resolve().relative_to(_ROOT).parts[0]
    except (ValueError, IndexError):
        return None
    if top not in _OURS:
        return None
    return sources_digest(("quant",) if top == "quant" else ("quant", "engine"))


class _Stamped:
    """A numba locator whose source stamp also carries the package digest."""

    def __init__(self, inner, digest: str):
        self._inner, self._digest = inner, digest

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), self._digest)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class StampedLocator:
    """Finds numba's own locator for a function (its usual list, in order) and stamps it."""

    @classmethod
    def from_function(cls, py_func, py_file):
        from numba.core.caching import CacheImpl
        for base in CacheImpl._locator_classes:
            if base is cls:
                continue
            inner = base.from_function(py_func, py_file)
            if inner is not None:
                break
        else:
            return None
        _lock_cache_saves()
        digest = digest_for(py_file)
        return inner if digest is None else _Stamped(inner, digest)


def _lock_cache_saves() -> None:
    """Make numba's cache saves atomic across processes (flock on a file beside the index).
    numba's save reads the index, picks the first unused data file name for a new key, writes
    the index, then the data: two processes saving two overloads of one kernel at once (two
    test workers, or a server and a perplexity run on a first use; the run kernels of two type
    groups are one function with two closures) can both pick `.1.nbc`, and the index may then
    name the other one's code under a key.  Under the lock the index is read after the other's
    save."""
    from numba.core import caching
    cls = caching.IndexDataCacheFile
    if getattr(cls, "_ikcli_locked", False):
        return
    try:
        import fcntl
    except ImportError:          # no flock (Windows): numba's own behaviour
        return
    save = cls.save

    def locked_save(self, key, data):
        try:
            f = open(self._index_path + ".lock", "a")
        except OSError:
            return save(self, key, data)
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    cls.save = locked_save
    cls._ikcli_locked = True


def install() -> None:
    """Make numba stamp ikcli's kernels (a user's own NUMBA_CACHE_LOCATOR_CLASSES is left alone)."""
    if "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_CACHE_LOCATOR_CLASSES", LOCATOR)
        return
    from numba.core import caching, config
    if config.CACHE_LOCATOR_CLASSES:
        return
    if StampedLocator not in caching.CacheImpl._locator_classes:
        caching.CacheImpl._locator_classes = [StampedLocator, *caching.CacheImpl._locator_classes]
