"""The serving engine: slots, continuous batching, stop strings, cancellation, the queue."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.context import Context
from engine.model import load_model, quiet_log
from engine.sampling import SamplingParams
from ikcli.defaults import demo_model


@pytest.fixture(scope="module")
def model():
    return load_model(demo_model(), quiet_log)


def engine(model, n_parallel, n_ctx=512, **kw):
    from engine.serving import ServingEngine
    e = ServingEngine(model, EngineConfig(demo_model(), n_ctx=n_ctx, n_threads=2, **kw), n_parallel, quiet_log)
    e.start()
    return e


def run_jobs(e, jobs):
    """jobs: list of (prompt, params, n_predict, stop); returns [(text, final event)] in order."""
    done = [threading.Event() for _ in jobs]
    texts = [[] for _ in jobs]
    finals = [None] * len(jobs)

    def cb(i):
        def on_event(ev):
            texts[i].append(ev.text)
            if ev.done:
                finals[i] = ev
                done[i].set()
        return on_event

    for i, (prompt, params, n, stop) in enumerate(jobs):
        e.submit(prompt, params, n, stop, cb(i))
    for d in done:
        assert d.wait(120), "a job did not finish"
    return [("".join(t), f) for t, f in zip(texts, finals)]


def prompt(model, text):
    return model.tokenizer.encode(text, add_special=True)


def test_greedy_matches_plain_decoding(model):
    p = prompt(model, "ROMEO:\nBut soft, what light")
    ctx = Context(model, EngineConfig(demo_model(), n_ctx=256, n_threads=2), quiet_log)
    lg = ctx.decode(np.array(p))[-1]
    want = []
    for _ in range(12):
        t = int(np.argmax(lg))
        want.append(t)
        lg = ctx.decode(np.array([t]))[-1]
    e = engine(model, 1)
    try:
        (text, fin), = run_jobs(e, [(p, SamplingParams(temperature=0), 12, [])])
    finally:
        e.shutdown()
    assert fin.finish_reason == "length" and fin.n_generated == 12
    assert text == model.tokenizer.decode(want)
    assert fin.timings.prompt_n == len(p) and fin.timings.predicted_n == 12


def test_slots_batched_together_give_the_same_text_as_alone(model):
    texts = ["ROMEO:\nBut soft", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed",
             "KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not", "MACBETH:\nIs this a dagger"]
    jobs = [(prompt(model, t), SamplingParams(temperature=0.8, seed=100 + i), 16, []) for i, t in enumerate(texts)]
    e1 = engine(model, 1, n_ctx=256)
    try:
        alone = [run_jobs(e1, [j])[0][0] for j in jobs]
    finally:
        e1.shutdown()
    e4 = engine(model, 4, n_ctx=1024)             # 6 jobs on 4 slots: two wait in the queue
    try:
        together = [t for t, _ in run_jobs(e4, jobs)]
    finally:
        e4.shutdown()
    assert together == alone


def test_stop_string_ends_and_is_not_returned(model):
    p = prompt(model, "ROMEO:\nBut soft, what light")
    e = engine(model, 1)
    try:
        (full, _), = run_jobs(e, [(p, SamplingParams(temperature=0), 24, [])])
        word = full[5:8]
        (text, fin), = run_jobs(e, [(p, SamplingParams(temperature=0), 24, [word])])
    finally:
        e.shutdown()
    assert fin.finish_reason == "stop" and fin.stopping_word == word
    assert text == full[:full.find(word)]


def test_cancel_frees_the_slot(model):
    e = engine(model, 1)
    try:
        started = threading.Event()
        finals = []

        def on_event(ev):
            started.set()
            if ev.done:
                finals.append(ev)
        job = e.submit(prompt(model, "ROMEO:"), SamplingParams(temperature=0.8, seed=1), 10_000, [], on_event)
        assert started.wait(60)
        job.cancel()
        (text, fin), = run_jobs(e, [(prompt(model, "JULIET:"), SamplingParams(temperature=0), 4, [])])
        assert fin.n_generated == 4
        assert finals and finals[0].finish_reason == "cancelled"
    finally:
        e.shutdown()


def test_prompt_longer_than_the_slot_is_refused(model):
    """Without context shift (with it the prompt is cut: tests/test_context_shift.py)."""
    from engine.serving import ServingEngine
    e = ServingEngine(model, EngineConfig(demo_model(), n_ctx=256, n_threads=2), 2, quiet_log, ctx_shift=False)
    e.start()                                    # 128 cells per slot
    try:
        with pytest.raises(ValueError, match="slot's context of 128"):
            e.submit(list(range(1, 200)), SamplingParams(), 4, [], lambda ev: None)
        with pytest.raises(ValueError, match="empty"):
            e.submit([], SamplingParams(), 4, [], lambda ev: None)
    finally:
        e.shutdown()


def test_utf8_is_released_whole():
    from engine.serving import ServingEngine
    b = bytearray("aé€".encode())
    assert ServingEngine._utf8_cut(b) == len(b)
    assert ServingEngine._utf8_cut(b[:-1]) == len(b) - 3      # € is 3 bytes: held back whole
    assert ServingEngine._utf8_cut(b[:2]) == 1                # first byte of é


def test_prompt_prefix_is_reused_across_requests(model):
    """Multi-turn: the second prompt extends the first conversation; only the new tokens are read,
    and the answer is the one a fresh slot gives."""
    first = prompt(model, "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and")
    assert len(first) > 16
    e = engine(model, 1, n_ctx=256)
    try:
        (t1, f1), = run_jobs(e, [(first, SamplingParams(temperature=0), 8, [])])
        second = first + model.tokenizer.encode(t1 + "\nJULIET:\nAy me!", add_special=False)
        (t2, f2), = run_jobs(e, [(second, SamplingParams(temperature=0), 8, [])])
    finally:
        e.shutdown()
    assert f1.timings.prompt_n == len(first)
    assert f2.timings.prompt_n < len(second) - len(first) + 10     # the first turn was not read again
    fresh = engine(model, 1, n_ctx=256)
    try:
        (t2_fresh, f2_fresh), = run_jobs(fresh, [(second, SamplingParams(temperature=0), 8, [])])
    finally:
        fresh.shutdown()
    assert f2_fresh.timings.prompt_n == len(second)
    assert t2 == t2_fresh
