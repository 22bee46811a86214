"""Context shift (llama-server's --context-shift, n_keep, n_discard): cached keys re-rotated to their
new positions, and a generation that fills its slot going on with `truncated` set."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.arch.common import context_shift
from engine.config import EngineConfig
from engine.context import Context
from engine.model import load_model, quiet_log
from engine.sampling import SamplingParams
from ikcli.defaults import demo_model


def _layer0_rows(ctx: Context, n: int) -> np.ndarray:
    return np.array(ctx.cache.layers[0].k.read(n), dtype=np.float32)


@pytest.mark.parametrize("arch,kw", [("deepseek2", {"mla": 3}), ("deepseek2", {"mla": 0}), ("llama", {}),
                                     ("qwen3", {})])
def test_shifted_keys_are_the_keys_at_the_new_positions(make_model, arch, kw):
    """Layer 0's keys depend only on the token and its position, so after dropping positions
    [2, 5) the moved cells must hold what decoding those tokens at positions 2.. gives."""
    preset = {"qwen3": "qwen256"}.get(arch, "tiny-v3" if arch == "deepseek2" else "tiny")
    path = make_model(arch=arch, preset=preset, qtype="f32")
    toks = np.random.default_rng(3).integers(0, 200, 12).astype(np.int32)
    cfg = EngineConfig(path, n_ctx=256, type_k="f32", type_v="f32", **kw)
    a = Context(load_model(path, quiet_log, mla=cfg.mla), cfg, quiet_log)
    a.decode(toks)
    before = _layer0_rows(a, 12).copy()
    assert context_shift(a.model.arch, a.cache, 2, 3) == 3
    assert list(a.cache.pos[:a.cache.n]) == list(range(9))
    b = Context(a.model, cfg, quiet_log)
    b.decode(toks[5:], pos0=2)
    got, want = _layer0_rows(a, 9)[2:], _layer0_rows(b, 7)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    np.testing.assert_array_equal(_layer0_rows(a, 2), before[:2])          # the kept cells are untouched
    assert not np.allclose(before[5:], want)                                # a shift that did nothing fails


@pytest.fixture(scope="module")
def demo():
    return load_model(demo_model(), quiet_log)


def _generate(model, n_predict: int, ctx_shift: bool, **job):
    from engine.serving import ServingEngine
    e = ServingEngine(model, EngineConfig(demo_model(), n_ctx=256, n_threads=2), 1, quiet_log, ctx_shift=ctx_shift)
    e.start()
    try:
        done, final, text = threading.Event(), [], []

        def on_event(ev):
            text.append(ev.text)
            if ev.done:
                final.append(ev)
                done.set()
        p = model.tokenizer.encode("ROMEO:\nBut soft, what light", add_special=True)
        e.submit(p, SamplingParams(temperature=0.0, ignore_eos=True), n_predict, [], on_event, **job)
        assert done.wait(300)
        return final[0], "".join(text), len(p)
    finally:
        e.shutdown()


def test_generation_goes_past_the_context_with_a_shift(demo):
    ev, text, n_prompt = _generate(demo, 300, True, n_keep=-1)
    assert ev.finish_reason == "length" and ev.n_generated == 300 and ev.truncated
    off, text_off, _ = _generate(demo, 300, False)
    assert off.finish_reason == "length" and not off.truncated
    assert off.n_generated == 256 - n_prompt             # the slot's context, as before
    assert text.startswith(text_off)                      # identical up to the first shift
    with pytest.raises(TypeError):
        _generate(demo, 5, True, n_keeps=1)


def test_a_long_prompt_is_cut_to_fit_with_context_shift(demo):
    """ik's prompt truncation: n_keep tokens (+ the BOS) kept, blocks of half the rest dropped
    after them until the prompt fits; without context shift the prompt is refused."""
    from engine.serving import ServingEngine
    text = "ROMEO:\nBut soft, what light through yonder window breaks? " * 40
    p = demo.tokenizer.encode(text, add_special=True)
    assert len(p) > 256
    e = ServingEngine(demo, EngineConfig(demo_model(), n_ctx=256, n_threads=2), 1, quiet_log)
    done, final = threading.Event(), []
    e.start()
    try:
        job = e.submit(p, SamplingParams(temperature=0.0), 4, [], lambda ev: ev.done and (final.append(ev), done.set()),
                       n_keep=5)
        keep = 5 + (p[0] == demo.tokenizer.bos_id)
        step = (256 - keep) // 2
        gone = step * -(-(len(p) - 255) // step)          # whole blocks until it fits
        assert job.prompt == p[:keep] + p[keep + gone:] and len(job.prompt) < 256
        assert done.wait(120) and final[0].truncated and final[0].n_prompt == len(job.prompt)
    finally:
        e.shutdown()
    off = ServingEngine(demo, EngineConfig(demo_model(), n_ctx=256, n_threads=2), 1, quiet_log, ctx_shift=False)
    with pytest.raises(ValueError, match="more than the slot's context"):
        off.submit(p, SamplingParams(temperature=0.0), 4, [], lambda ev: None)
