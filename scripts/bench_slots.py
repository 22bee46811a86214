#!/usr/bin/env python3
"""Aggregate generation speed of the serving engine with 1 slot vs N slots (continuous batching).

    python scripts/bench_slots.py [-m MODEL] [--jobs 8] [--tokens 32] [--parallel 4] [-t 2]

Submits the same jobs (different prompts, fixed seeds) to an engine with one slot and to one
with N slots; prints wall time and generated tokens per second for both.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig  # noqa: E402
from engine.model import load_model, quiet_log  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.serving import ServingEngine  # noqa: E402


def run(model, path, n_parallel, jobs, n_tokens, threads, n_ctx_slot) -> tuple[float, int]:
    e = ServingEngine(model, EngineConfig(path, n_ctx=n_ctx_slot * n_parallel, n_threads=threads), n_parallel, quiet_log)
    e.start()
    left = threading.Semaphore(0)
    count = [0]

    def on_event(ev):
        if ev.done:
            count[0] += ev.n_generated
            left.release()
    t = time.perf_counter()
    for i, p in enumerate(jobs):
        e.submit(p, SamplingParams(temperature=0.8, seed=i), n_tokens, [], on_event)
    for _ in jobs:
        left.acquire()
    dt = time.perf_counter() - t
    e.shutdown()
    return dt, count[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    if not a.model:
        from ikcli.defaults import demo_model
        a.model = demo_model()
    m = load_model(a.model, quiet_log)
    prompts = [m.tokenizer.encode(f"Speaker {i}:\nWhat news", add_special=True) for i in range(a.jobs)]
    run(m, a.model, 1, prompts[:1], 4, a.t, 256)                      # warm up (compilation)
    for n in (1, a.parallel):
        dt, ng = run(m, a.model, n, prompts, a.tokens, a.t, 256)
        print(f"--parallel {n}: {a.jobs} jobs x {a.tokens} tokens in {dt:.2f} s = {ng / dt:.1f} generated tokens/s")


if __name__ == "__main__":
    main()
