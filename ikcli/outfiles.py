"""Output files of the writing tools (quantize, imatrix): the up-front path check, write errors
that name the file, SIGTERM / SIGHUP unwinding like Ctrl-C, and the temporary files a killed run
leaves behind."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading

from . import common
from .errors import CliError


def check_output_path(path: str) -> None:
    """Refuse, before any work, an output path the run could not write (CliError naming it)."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise CliError(f"cannot write {path}: it is a directory")
    if os.path.exists(path) and not os.path.isfile(path):
        raise CliError(f"cannot write {path}: it exists and is not a regular file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"cannot write {path}: folder '{folder}' does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"cannot write {path}: folder '{folder}' is not writable")


def write_error(path: str, e: OSError) -> CliError:
    """One line naming the output file for an error met while writing it.  NumPy's tofile reports a
    short write without errno ("294912 requested and 134016 written"): a full disk when the
    output's file system has (almost) no space left.  Call it before the partial file is removed."""
    if e.errno is not None:
        return CliError(f"cannot write {path}: {e.strerror or e}")
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        full = st.f_bavail * st.f_frsize < (1 << 20)
    except OSError:
        full = False
    return CliError(f"cannot write {path}: {'No space left on device' if full else 'short write'} ({e})")


class _Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def terminate_cleanly():
    """Inside the block SIGTERM and SIGHUP unwind the main thread like Ctrl-C (the same clean-up:
    temporary files removed); leaving the block then ends the run with `ikcli: terminated by
    SIGTERM` and exit status 128 + the signal's number.  A second signal while cleaning up is
    ignored; signals the parent ignores (nohup) stay ignored; outside the main thread: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise _Terminated(signum)

    saved = {}
    for sig in (getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)):
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                saved[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    try:
        yield
    except _Terminated as e:
        print(f"ikcli: terminated by {signal.Signals(e.signum).name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + e.signum) from None
    finally:
        for sig, prev in saved.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)


def temp_path(path: str) -> str:
    """The temporary file an output is written to before it is renamed: hidden, same folder."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # someone else's process
        return True
    except (OverflowError, ValueError, OSError):
        return pid > 0 and os.path.exists(f"/proc/{pid}")
    return True


def remove_stale_temps(path: str, tool: str) -> None:
    """Remove temp_path(path)'s of processes that are no longer running (a SIGKILL, a crash, a
    power cut leaves them), one log line each; those of running processes are left alone."""
    folder = os.path.dirname(os.path.abspath(path))
    pat = re.compile(r"\." + re.escape(os.path.basename(path)) + r"\.tmp-([0-9]+)")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = pat.fullmatch(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        stale = os.path.join(folder, name)
        try:
            if os.path.islink(stale) or not os.path.isfile(stale):
                continue
            size = os.path.getsize(stale)
            os.unlink(stale)
        except OSError:
            continue
        common.log(f"{tool}: removed {stale} ({size} bytes), left by an interrupted run "
                   f"(process {m.group(1)} is no longer running)")
