"""Fuzz the GGUF loader: seeded mutations of small test models, each loaded and run in-process.

    python scripts/fuzz_gguf.py [--cases 2000] [--seed 0] [--timeout 20] [--mem-mib 3000]

Every mutated file must either load and decode a few tokens, or fail with engine.gguf_file's
ModelFileError in one line that names the file.  Anything else (another exception type, a
traceback text, a hang past --timeout, memory past --mem-mib) is a finding; each case runs in a
child process (fork) so that a hang or a runaway allocation is caught, not suffered.
Mutations touch the header, the metadata and the tensor table (not the weights, whose edits
make another model, not a broken file): truncations, bit flips, absurd u64 counts and lengths,
other value / element / tensor type ids, shifted offsets, a key name copied over another.
"""
from __future__ import annotations

import argparse
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

BASES = [("llama", "f32", "tiny"), ("deepseek2", "q8_0", "tiny"), ("llama", "q4_0", "tiny-moe")]


def mutate(raw: bytes, head: int, rng: np.random.Generator) -> tuple[str, bytes]:
    b = bytearray(raw)
    kind = rng.choice(["truncate", "bitflip", "u64", "u32-type", "offset", "key-copy"])
    if kind == "truncate":
        return kind, bytes(b[:int(rng.integers(0, len(b)))])
    pos = int(rng.integers(24, max(25, head - 8)))
    if kind == "bitflip":
        for _ in range(int(rng.integers(1, 4))):
            p = int(rng.integers(0, head))
            b[p] ^= 1 << int(rng.integers(0, 8))
    elif kind == "u64":
        vals = [0, 1, 2 ** 31, 2 ** 40, 2 ** 63, 2 ** 64 - 1]
        b[pos:pos + 8] = vals[int(rng.integers(len(vals)))].to_bytes(8, "little")
    elif kind == "u32-type":
        vals = [0, 4, 8, 9, 12, 13, 30, 39, 208, 255]
        b[pos:pos + 4] = vals[int(rng.integers(len(vals)))].to_bytes(4, "little")
    elif kind == "offset":
        v = int.from_bytes(b[pos:pos + 8], "little")
        step = [-32, 32, 1, 1 << 20][int(rng.integers(4))]
        if 64 < v < 2 ** 62:
            b[pos:pos + 8] = (v + step).to_bytes(8, "little")
    else:                                            # a key (or tensor) name copied over another
        names = [i for i in range(24, head - 16) if b[i:i + 4] in (b"llam", b"deep", b"toke", b"blk.")]
        if len(names) >= 2:
            i, j = rng.choice(names, 2, replace=False)
            n = int(rng.integers(4, 24))
            b[j:j + n] = b[i:i + n]
    return kind, bytes(b)


def run_case(path: str, decode: bool = True) -> tuple[str, str]:
    """('ok' | 'error' | 'finding', detail) for one file, in this process (decode False: load and
    make a context only, which compiles no kernels)."""
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.gguf_file import ModelFileError
    from engine.model import load_model
    try:
        m = load_model(path, lambda s: None)
        ctx = Context(m, EngineConfig(path, n_ctx=64, n_threads=1), lambda s: None)
        if not decode:
            return "ok", ""
        n = min(4, m.n_vocab)
        ctx.decode(np.arange(n, dtype=np.int32) % max(1, m.n_vocab))
        return "ok", ""
    except ModelFileError as e:
        msg = str(e)
        if "\n" in msg or not msg.startswith(path) or "Traceback" in msg:
            return "finding", f"ModelFileError not one line naming the file: {msg[:300]!r}"
        return "error", msg[len(path) + 2:].split(":")[0][:60]
    except FloatingPointError as e:            # NaN weights or scales from a flipped type: stops cleanly
        return "error", f"FloatingPointError: {e}"[:60]
    except Exception as e:                    # noqa: BLE001 - the finding
        return "finding", f"{type(e).__name__}: {str(e)[:300]}"


class Worker:
    """A child process (this script with --worker) that loads and runs the files it is sent, one
    per line; restarted after a hang, a crash or a runaway allocation (RLIMIT_AS)."""

    def __init__(self, mem_mib: int, decode: bool = True) -> None:
        self.mem_mib, self.decode = mem_mib, decode
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--mem-mib",
                                      str(self.mem_mib)] + ([] if self.decode else ["--no-decode"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1)
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, path: str, timeout: float) -> tuple[str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return "finding", f"hang (> {timeout:g} s)"
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            self.proc = None
            return "finding", f"worker died (exit {rc})"
        status, _, detail = line.rstrip("\n").partition("\t")
        return status, detail


def worker_main(mem_mib: int, decode: bool) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (mem_mib << 20, mem_mib << 20))
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            status, detail = run_case(line.strip(), decode)
        except MemoryError:
            status, detail = "finding", "MemoryError"
        print(f"{status}\t{detail}".replace("\n", " "), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--mem-mib", type=int, default=3000)
    ap.add_argument("--no-decode", action="store_true",
                    help="load and make a context only (no kernels compiled: for the test suite on a cold cache)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker_main(a.mem_mib, not a.no_decode)
        return
    from gguf import GGUFReader

    from make_test_model import write_model
    rng = np.random.default_rng(a.seed)
    tally: Counter = Counter()
    findings: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        bases = []
        for arch, qt, preset in BASES:
            p = write_model(os.path.join(d, f"{arch}-{qt}.gguf"), arch, "ik", qt, preset)[0]
            raw = open(p, "rb").read()
            head = min(int(t.data_offset) for t in GGUFReader(p).tensors)
            bases.append((p, raw, head))
        worker = Worker(a.mem_mib, not a.no_decode)
        for p, _, _ in bases:                   # intact files load and run
            assert worker.run(p, 600)[0] == "ok", p
        path = os.path.join(d, "case.gguf")
        t0 = time.time()
        for i in range(a.cases):
            base, raw, head = bases[i % len(bases)]
            kind, data = mutate(raw, head, rng)
            with open(path, "wb") as fh:
                fh.write(data)
            status, detail = worker.run(path, a.timeout)
            tally[status] += 1
            if status == "finding":
                findings.append(f"case {i} ({os.path.basename(base)}, {kind}): {detail}")
                print(findings[-1], flush=True)
    print(f"{a.cases} cases in {time.time() - t0:.0f} s: {dict(tally)}")
    sys.exit(1 if findings else 0)


if __name__ == "__main__":
    main()
