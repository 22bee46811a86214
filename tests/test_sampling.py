"""Token sampler: llama.cpp chain order and rules, determinism, masking, request parsing."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.sampling import SamplingParams, Sampler, apply_penalties, token_probabilities

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # every filter disabled


def make(n_vocab: int, **kw) -> Sampler:
    kw.setdefault("seed", 1234)
    return Sampler(SamplingParams(**kw), n_vocab)


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def ref_distribution(logits, top_k, top_p, min_p, temp) -> dict[int, float]:
    """Plain, literal llama.cpp chain on a full sort (no shortcuts) for comparison."""
    lg = [float(v) for v in logits]
    cand = sorted((i for i in range(len(lg)) if math.isfinite(lg[i])), key=lambda i: (-lg[i], i))
    if 0 < top_k < len(cand):
        cand = cand[:top_k]
    if top_p < 1.0:
        mx = lg[cand[0]]
        e = [math.exp(lg[i] - mx) for i in cand]
        z = sum(e)
        cum, cut = 0.0, len(cand)
        for j, v in enumerate(e):
            cum += v / z
            if cum >= top_p:
                cut = j + 1
                break
        cand = cand[:cut]
    if min_p > 0.0:
        thr = lg[cand[0]] + math.log(min_p)
        cand = [i for i in cand if lg[i] >= thr]
    mx = lg[cand[0]]
    e = [math.exp((lg[i] - mx) / temp) for i in cand]
    z = sum(e)
    return {i: v / z for i, v in zip(cand, e)}


def kept(sampler: Sampler, logits, history=()) -> list[int]:
    ids, _ = sampler.distribution(f32(logits), list(history))
    return ids.tolist()


# --- greedy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("temp", [0.0, -0.5])
def test_greedy_is_argmax(temp):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.standard_normal(1000).astype(np.float32)
        s = make(1000, temperature=temp)
        assert s.sample(logits, []) == int(np.argmax(logits))


def test_greedy_ignores_filters_and_uses_penalized_logits():
    logits = f32([0.1, 2.0, -1.0, 1.9])
    s = make(4, temperature=0.0, top_k=1, repeat_penalty=2.0)
    assert s.sample(logits, []) == 1
    assert s.sample(logits, [1]) == 3          # 2.0 / 2 = 1.0 < 1.9


def test_greedy_consumes_no_randomness():
    s = make(5, temperature=0.0)
    state = s.rng.bit_generator.state
    s.sample(f32([1, 2, 3, 4, 5]), [])
    assert s.rng.bit_generator.state == state


# --- filters on hand examples -----------------------------------------------------------------

def test_top_k_keeps_k():
    logits = np.arange(10, dtype=np.float32)
    s = make(10, temperature=1.0, **{**OFF, "top_k": 3})
    ids, probs = s.distribution(logits, [])
    assert ids.tolist() == [9, 8, 7]
    e = np.exp([0.0, -1.0, -2.0]) / np.exp([0.0, -1.0, -2.0]).sum()
    np.testing.assert_allclose(probs, e, rtol=1e-6)
    assert all(s.sample(logits, []) in (7, 8, 9) for _ in range(200))


def test_top_k_ties_keep_exactly_k_lower_ids_first():
    s = make(5, **{**OFF, "top_k": 2})
    assert kept(s, [1, 1, 1, 1, 0]) == [0, 1]


def test_top_k_larger_than_vocab_keeps_all():
    s = make(4, **{**OFF, "top_k": 100})
    assert sorted(kept(s, [0.0, 1.0, 2.0, 3.0])) == [0, 1, 2, 3]


def test_top_p_smallest_set_reaching_p():
    # probabilities 0.5 / 0.3 / 0.15 / 0.05, placed out of id order
    probs = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
    logits = [math.log(probs[i]) for i in range(4)]
    assert kept(make(4, **{**OFF, "top_p": 0.4}), logits) == [2]           # 0.5 >= 0.4
    assert kept(make(4, **{**OFF, "top_p": 0.75}), logits) == [2, 0]        # 0.8 >= 0.75
    assert kept(make(4, **{**OFF, "top_p": 0.85}), logits) == [2, 0, 3]     # 0.95 >= 0.85
    assert kept(make(4, **{**OFF, "top_p": 0.99}), logits) == [2, 0, 3, 1]
    assert kept(make(4, **{**OFF, "top_p": 0.0}), logits) == [2]            # min_keep = 1


def test_top_p_renormalizes_after_top_k():
    # probs 0.4/0.3/0.2/0.1: alone, top_p 0.5 needs two tokens; after top_k 2 the first has 4/7
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert kept(make(4, **{**OFF, "top_p": 0.5}), logits) == [0, 1]
    assert kept(make(4, **{**OFF, "top_p": 0.5, "top_k": 2}), logits) == [0]


def test_min_p_relative_to_max_probability():
    logits = [math.log(p) for p in (0.05, 0.6, 0.1, 0.25)]
    # min_p 0.2: threshold 0.12 -> 0.6, 0.25; min_p 0.1: threshold 0.06 -> adds 0.1
    assert kept(make(4, **{**OFF, "min_p": 0.2}), logits) == [1, 3]
    assert kept(make(4, **{**OFF, "min_p": 0.1}), logits) == [1, 3, 2]
    # relative, not absolute: a flat distribution keeps everything even with min_p 0.9
    assert sorted(kept(make(4, **{**OFF, "min_p": 0.9}), [0.0] * 4)) == [0, 1, 2, 3]


def test_min_p_and_top_p_combine_as_shorter_prefix():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.06, 0.04)]
    assert kept(make(5, **{**OFF, "top_p": 0.95, "min_p": 0.3}), logits) == [0, 1, 2]  # min_p cuts
    assert kept(make(5, **{**OFF, "top_p": 0.65, "min_p": 0.1}), logits) == [0, 1]     # top_p cuts


def test_temperature_applies_after_filters():
    logits = f32([3.0, 2.0, 1.0, 0.0, -5.0])
    for temp in (0.5, 1.0, 2.0):
        s = make(5, temperature=temp, top_k=3, top_p=1.0, min_p=0.0)
        ids, probs = s.distribution(logits, [])
        ref = ref_distribution(logits, 3, 1.0, 0.0, temp)
        assert ids.tolist() == list(ref)
        np.testing.assert_allclose(probs, list(ref.values()), rtol=1e-6)
    # the kept set is chosen at temperature 1: a high temperature does not let token 3 in via top_p
    logits = [math.log(p) for p in (0.7, 0.2, 0.1)]
    assert kept(make(3, **{**OFF, "top_p": 0.8, "temperature": 5.0}), logits) == [0, 1]


def test_temperature_sharpening_changes_empirical_distribution():
    logits = f32([1.0, 0.5, 0.0, -0.5])
    n = 4000

    def top_freq(temp: float) -> float:
        s = make(4, temperature=temp, seed=7, **OFF)
        return sum(s.sample(logits, []) == 0 for _ in range(n)) / n

    cold, mid, hot = top_freq(0.3), top_freq(1.0), top_freq(3.0)
    assert cold > mid > hot
    p = np.exp(logits / 0.3) / np.exp(logits / 0.3).sum()
    assert abs(cold - p[0]) < 0.03


# --- penalties --------------------------------------------------------------------------------

def test_penalties_hand_example():
    logits = f32([2.0, -1.0, 0.5, 3.0, 1.0])
    history = [0, 1, 1, 4, 3]  # the last 4 are 1, 1, 4, 3: token 0 falls outside the window
    p = SamplingParams(repeat_penalty=2.0, repeat_last_n=4, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, history, p)
    # t1: -1*2 - (2*0.5 + 0.25) = -3.25; t3: 3/2 - 0.75 = 0.75; t4: 1/2 - 0.75 = -0.25
    np.testing.assert_allclose(out, [2.0, -3.25, 0.5, 0.75, -0.25], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0, 1.0])  # input untouched


def test_penalties_window_and_off_switches():
    logits = f32([2.0, -1.0, 0.5])
    hist = [0, 1, 2, 2]
    whole = apply_penalties(logits, hist, SamplingParams(repeat_penalty=2.0, repeat_last_n=-1))
    np.testing.assert_allclose(whole, [1.0, -2.0, 0.25])
    none = apply_penalties(logits, hist, SamplingParams(repeat_penalty=2.0, repeat_last_n=0))
    np.testing.assert_array_equal(none, logits)
    off = apply_penalties(logits, hist, SamplingParams(repeat_last_n=64))
    np.testing.assert_array_equal(off, logits)
    # ids outside the vocab in the history are ignored, not an IndexError
    odd = apply_penalties(logits, [-1, 7, 0], SamplingParams(repeat_penalty=2.0))
    np.testing.assert_allclose(odd, [1.0, -1.0, 0.5])
    # history may be a NumPy array
    arr = apply_penalties(logits, np.array(hist), SamplingParams(repeat_penalty=2.0, repeat_last_n=2))
    np.testing.assert_allclose(arr, [2.0, -1.0, 0.25])


def test_penalties_run_before_top_k():
    logits = f32([5.0, 4.0, 3.0])
    s = make(3, **{**OFF, "top_k": 1, "presence_penalty": 3.0})
    assert kept(s, logits, [0]) == [1]   # 5 - 3 = 2 drops below 4


# --- determinism and the generator ------------------------------------------------------------

def _generate(sampler: Sampler, steps: int, n_vocab: int) -> list[int]:
    rng = np.random.default_rng(99)        # the "model": fixed logits per step
    hist = [1, 2, 3]
    out = []
    for _ in range(steps):
        tok = sampler.sample(rng.standard_normal(n_vocab).astype(np.float32), hist)
        hist.append(tok)
        out.append(tok)
    return out


def test_same_seed_same_tokens():
    kw = dict(temperature=1.2, top_k=50, top_p=0.9, min_p=0.01, repeat_penalty=1.1, seed=42)
    a = _generate(Sampler(SamplingParams(**kw), 500), 100, 500)
    b = _generate(Sampler(SamplingParams(**kw), 500), 100, 500)
    assert a == b


def test_different_seeds_differ():
    kw = dict(temperature=1.5, **OFF)
    a = _generate(Sampler(SamplingParams(seed=1, **kw), 500), 50, 500)
    b = _generate(Sampler(SamplingParams(seed=2, **kw), 500), 50, 500)
    assert a != b


def test_random_seed_is_exposed_and_reproducible():
    s = Sampler(SamplingParams(seed=-1, temperature=1.5, **OFF), 300)
    assert isinstance(s.seed, int) and s.seed >= 0
    again = Sampler(SamplingParams(seed=s.seed, temperature=1.5, **OFF), 300)
    assert _generate(s, 30, 300) == _generate(again, 30, 300)


def test_sampled_frequencies_match_filtered_softmax():
    logits = f32([2.0, 1.6, 1.5, 0.9, 0.3, -0.2, 0.8, -3.0])
    params = dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05)
    ref = ref_distribution(logits, **{"top_k": 6, "top_p": 0.9, "min_p": 0.05, "temp": 0.7})
    s = make(8, seed=2024, **params)
    ids, probs = s.distribution(logits, [])
    assert ids.tolist() == list(ref)
    np.testing.assert_allclose(probs, list(ref.values()), rtol=1e-6)

    n = 20000
    counts = np.bincount([s.sample(logits, []) for _ in range(n)], minlength=8)
    outside = [i for i in range(8) if i not in ref]
    assert counts[outside].sum() == 0
    exp = np.array([ref[i] * n for i in ref])
    obs = counts[list(ref)]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    # df <= 5: the 1e-5 tail starts near 28; the seed is fixed, so this cannot flake
    assert chi2 < 28.0, (chi2, obs, exp)


# --- masking and robustness -------------------------------------------------------------------

def test_neg_inf_logits_are_never_sampled():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(2000).astype(np.float32)
    allowed = rng.choice(2000, size=5, replace=False)
    mask = np.full(2000, -np.inf, dtype=np.float32)
    mask[allowed] = logits[allowed]
    for kw in (dict(), OFF, dict(top_k=100), dict(top_k=0, top_p=0.99, min_p=0.0)):
        s = make(2000, temperature=1.0, **kw)
        ids, probs = s.distribution(mask, [])
        assert set(ids.tolist()) <= set(allowed.tolist())
        assert np.isfinite(probs).all() and abs(probs.sum() - 1.0) < 1e-9
        assert all(s.sample(mask, [int(allowed[0])] * 3) in allowed for _ in range(100))
    assert make(2000, temperature=0.0).sample(mask, []) == int(allowed[np.argmax(logits[allowed])])


def test_degenerate_logits_stay_in_range():
    n = 6
    all_masked = np.full(n, -np.inf, dtype=np.float32)
    for temp in (0.0, 0.8):
        tok = make(n, temperature=temp).sample(all_masked, [])
        assert 0 <= tok < n
    ids, probs = make(n).distribution(all_masked, [])
    assert ids.size == 0 and probs.size == 0
    # NaN counts as masked, +inf wins outright (shared equally when several)
    weird = f32([np.nan, 1.0, np.inf, 0.0, np.inf, np.nan])
    s = make(n, temperature=1.0, **OFF)
    ids, probs = s.distribution(weird, [])
    assert ids.tolist() == [2, 4] and np.allclose(probs, 0.5)
    assert all(s.sample(weird, []) in (2, 4) for _ in range(50))
    assert make(n, temperature=0.0).sample(f32([np.nan, 1.0, 0.0, 0, 0, 0]), []) == 1
    # tiny temperature: no overflow into NaN
    s = make(3, temperature=1e-30, **OFF)
    ids, probs = s.distribution(f32([1.0, 1.0 - 1e-3, -1.0]), [])
    assert np.isfinite(probs).all() and probs[0] == pytest.approx(1.0)


def test_large_vocab_matches_reference():
    rng = np.random.default_rng(5)
    n = 120_000
    logits = (rng.standard_normal(n) * 2.5).astype(np.float32)
    logits[rng.choice(n, 1000, replace=False)] = -np.inf
    # top_k off + top_p on exercises the grow-until-p search instead of a full sort
    for kw in (dict(top_k=40, top_p=0.95, min_p=0.05), dict(top_k=0, top_p=0.9, min_p=0.0),
               dict(top_k=0, top_p=0.5, min_p=0.01), dict(top_k=2000, top_p=0.99, min_p=0.0)):
        s = make(n, temperature=0.9, **kw)
        ids, probs = s.distribution(logits, [])
        ref = ref_distribution(logits, temp=0.9, **kw)
        assert ids.tolist() == list(ref)
        np.testing.assert_allclose(probs, list(ref.values()), rtol=1e-5, atol=1e-12)
        assert all(s.sample(logits, []) in ref for _ in range(20))


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match="logits"):
        make(10).sample(np.zeros(9, dtype=np.float32), [])


def test_n_probs_report():
    logits = f32([0.0, 2.0, 1.0, -1.0])
    s = make(4, n_probs=2, temperature=0.0)
    tok = s.sample(logits, [])
    e = np.exp(logits - 2.0) / np.exp(logits - 2.0).sum()
    assert s.last_probs is not None and s.last_probs.token == tok == 1
    assert s.last_probs.prob == pytest.approx(e[1])
    assert [t for t, _ in s.last_probs.top] == [1, 2]
    assert [p for _, p in s.last_probs.top] == pytest.approx([e[1], e[2]])
    plain = make(4)
    plain.sample(logits, [])
    assert plain.last_probs is None
    assert len(token_probabilities(logits, 0, 99).top) == 4


# --- request parsing --------------------------------------------------------------------------

def test_from_request_reads_known_keys():
    body = {"temperature": 1, "top_k": 10, "top_p": 0.5, "min_p": 0, "repeat_penalty": 1.1,
            "repeat_last_n": -1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 7,
            "n_probs": 3}
    p = SamplingParams.from_request(body)
    assert p == SamplingParams(temperature=1.0, top_k=10, top_p=0.5, min_p=0.0, repeat_penalty=1.1,
                               repeat_last_n=-1, presence_penalty=0.5, frequency_penalty=-0.5,
                               seed=7, n_probs=3)
    assert isinstance(p.temperature, float) and isinstance(p.min_p, float)  # ints accepted


def test_from_request_defaults_unknown_keys_and_nulls():
    p = SamplingParams.from_request({"max_tokens": 5, "stream": True, "model": "x", "mirostat": 2,
                                     "temperature": None, "seed": None})
    assert p == SamplingParams()
    assert not hasattr(p, "max_tokens")
    assert SamplingParams.from_request({}) == SamplingParams()
    assert SamplingParams.from_request({"top_k": 40.0}).top_k == 40   # integral float is fine


@pytest.mark.parametrize("body, field", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "40"}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"seed": -2}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": [1.1]}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"presence_penalty": "a lot"}, "presence_penalty"),
    ({"frequency_penalty": {}}, "frequency_penalty"),
    ({"n_probs": -1}, "n_probs"),
    ({"n_probs": 2.5}, "n_probs"),
])
def test_from_request_rejects_bad_values(body, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams.from_request(body)


def test_from_request_rejects_non_object():
    with pytest.raises(ValueError, match="object"):
        SamplingParams.from_request(["temperature", 1.0])  # type: ignore[arg-type]


def test_newline_token_is_not_penalized_by_default():
    """llama.cpp's default penalize_nl = false: the newline token keeps its logit under the
    repetition / frequency / presence penalties; penalize_nl = true penalizes it like any token."""
    from engine.sampling import SamplingParams, apply_penalties
    logits = np.array([2.0, 1.0, -1.0, 3.0], dtype=np.float32)
    hist = [0, 1, 2, 3, 3]
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    y = apply_penalties(logits, hist, p, nl_token=1)
    assert y[1] == logits[1]
    assert y[0] == np.float32(2.0 / 2.0 - 0.5 - 0.25) and y[2] == np.float32(-2.0 - 0.75)
    y = apply_penalties(logits, hist, SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5,
                                                     presence_penalty=0.25, penalize_nl=True), nl_token=1)
    assert y[1] == np.float32(1.0 / 2.0 - 0.75)
    assert SamplingParams.from_request({"penalize_nl": True}).penalize_nl is True
    with pytest.raises(ValueError, match="penalize_nl"):
        SamplingParams.from_request({"penalize_nl": "yes"})


def test_logit_bias_and_ignore_eos_come_first_in_the_chain():
    """logit_bias is added before everything else (a -inf bans); ignore_eos bans every EOG token
    even when it has the largest logit; ids out of range are refused."""
    from engine.sampling import Sampler, SamplingParams
    logits = np.array([0.0, 5.0, 1.0, 4.0], dtype=np.float32)
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    assert Sampler(greedy, 4).sample(logits, []) == 1
    biased = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias=((1, -np.inf), (2, 3.5)))
    assert Sampler(biased, 4).sample(logits, []) == 2
    no_eos = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    assert Sampler(no_eos, 4, eog_ids=(1,)).sample(logits, []) == 3
    assert Sampler(greedy, 4, eog_ids=(1,)).sample(logits, []) == 1          # only with ignore_eos
    hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True, seed=3)
    s = Sampler(hot, 4, eog_ids=(1, 3))
    assert all(s.sample(logits, []) in (0, 2) for _ in range(200))
    with pytest.raises(ValueError, match="token id 7 out of range"):
        Sampler(SamplingParams(logit_bias=((7, 1.0),)), 4)
