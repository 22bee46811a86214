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
    p = SamplingParams.from_request({"max_tokens": 5, "stream": True, "model": "x", "adaptive_target": 0.5,
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


# =============================================================================================
# ik's other samplers: typical, tfs, xtc, top-n-sigma, dynatemp, DRY, mirostat, min_keep, order
# =============================================================================================

import copy  # noqa: E402

from engine.sampling import DEFAULT_SAMPLERS, DryVocab, parse_samplers  # noqa: E402

ALL_OFF = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)


def _srt(c):
    return sorted(c, key=lambda t: (-t[1], t[0]))


def _softmax(c):
    mx = max(v for _, v in c)
    e = [math.exp(v - mx) for _, v in c]
    z = sum(e)
    return [x / z for x in e]


def ref_chain(logits, samplers="dkfypmxnt", min_keep=0, top_k=0, top_p=1.0, min_p=0.0, tfs_z=1.0,
              typical_p=1.0, xtc_probability=0.0, xtc_threshold=1.0, top_n_sigma=0.0, temperature=1.0,
              dynatemp_range=0.0, dynatemp_exponent=1.0, dry=None) -> dict[int, float]:
    """ik's sampler_queue written out literally (common/sampling.cpp + src/llama-sampling.cpp):
    a list of (id, logit) candidates, full sorts, the temperature divides the logits in place.
    XTC's coin always fires here. dry: a function (candidates) -> candidates."""
    cand = [(i, float(v)) for i, v in enumerate(logits) if math.isfinite(v)]
    mk = max(1, min_keep)
    for s in samplers:
        if s == "d" and dry is not None:
            cand = dry(cand)
        elif s == "k":
            k = top_k if top_k > 0 else len(cand)
            cand = _srt(cand)[:min(max(k, mk), len(cand))]
        elif s == "f" and tfs_z < 1.0 and len(cand) > 2:
            cand = _srt(cand)
            p = _softmax(cand)
            d1 = [p[i] - p[i + 1] for i in range(len(p) - 1)]
            d2 = [abs(d1[i] - d1[i + 1]) for i in range(len(d1) - 1)]
            sm = sum(d2)
            d2 = [x / sm for x in d2] if sm > 1e-6 else [1.0 / len(d2)] * len(d2)
            cum, last = 0.0, len(cand)
            for i, x in enumerate(d2):
                cum += x
                if cum > tfs_z and i >= mk:
                    last = i
                    break
            cand = cand[:last]
        elif s == "y" and typical_p < 1.0:
            cand = _srt(cand)
            p = _softmax(cand)
            ent = -sum(x * math.log(x) for x in p if x > 0)
            score = [abs(-math.log(x) - ent) if x > 0 else math.inf for x in p]
            idx = sorted(range(len(cand)), key=lambda i: score[i])
            cum, last = 0.0, len(idx)
            for j, i in enumerate(idx):
                cum += p[i]
                if cum > typical_p and j + 1 >= mk:
                    last = j + 1
                    break
            cand = [cand[i] for i in idx[:last]]
        elif s == "p" and top_p < 1.0:
            cand = _srt(cand)
            p = _softmax(cand)
            cum, last = 0.0, len(cand)
            for i, x in enumerate(p):
                cum += x
                if cum >= top_p and i + 1 >= mk:
                    last = i + 1
                    break
            cand = cand[:last]
        elif s == "m" and min_p > 0.0:
            thr = max(v for _, v in cand) + math.log(min_p)
            kept = [t for t in cand if t[1] >= thr]
            if len(kept) >= mk:
                cand = kept
            else:                                       # ik's sorted path
                cand = _srt(cand)
                i = 1
                while i < len(cand) and not (cand[i][1] < thr and i >= mk):
                    i += 1
                cand = cand[:i]
        elif s == "x" and xtc_probability > 0 and xtc_threshold <= 0.5 and len(cand) >= 2:
            cand = _srt(cand)
            p = _softmax(cand)
            last = 0
            for i, x in enumerate(p):
                if x >= xtc_threshold:
                    last = i
                else:
                    break
            if len(cand) - last >= mk and last > 0:
                cand = cand[last:]
        elif s == "n" and top_n_sigma > 0 and len(cand) >= 4:
            ls = [v for _, v in cand]
            mean = sum(ls) / len(ls)
            sd = math.sqrt(sum((v - mean) ** 2 for v in ls) / len(ls))
            if sd > 0:
                thr = max(ls) - top_n_sigma * sd
                cand = [t for t in cand if t[1] >= thr]
        elif s == "t":
            if dynatemp_range > 0:
                if len(cand) > 1:
                    lo, hi = max(0.0, temperature - dynatemp_range), max(0.0, temperature + dynatemp_range)
                    p = _softmax(cand)
                    ent = -sum(x * math.log(x) for x in p if x > 0)
                    t = lo + (hi - lo) * (ent / math.log(len(cand))) ** dynatemp_exponent
                    cand = [(i, v / t) for i, v in cand]
            else:
                cand = [(i, v / temperature) for i, v in cand]
    return {i: x for (i, _), x in zip(cand, _softmax(cand))}


def assert_same_dist(sampler, logits, ref: dict, history=(), rtol=1e-6):
    ids, probs = sampler.distribution(f32(logits), list(history))
    got = dict(zip(ids.tolist(), probs.tolist()))
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for t in ref:
        assert got[t] == pytest.approx(ref[t], rel=rtol, abs=1e-12), t
    assert list(probs) == sorted(probs, reverse=True)      # most likely first


def test_default_order_is_iks():
    letters = {"dry": "d", "top_k": "k", "tfs_z": "f", "typical_p": "y", "top_p": "p", "min_p": "m",
               "xtc": "x", "top_n_sigma": "n", "temperature": "t", "adaptive_p": "w"}
    assert "".join(letters[s] for s in DEFAULT_SAMPLERS) == "dkfypmxntw"
    assert SamplingParams().samplers == DEFAULT_SAMPLERS
    assert parse_samplers("kpt") == ("top_k", "top_p", "temperature")
    assert parse_samplers(["top-k", "nucleus", "temp", "typical", "tfs"]) == \
        ("top_k", "top_p", "temperature", "typical_p", "tfs_z")
    assert parse_samplers([]) == () and parse_samplers("") == ()
    for bad in ("kz", ["top_k", "bogus"], 5, [1]):
        with pytest.raises(ValueError, match="'samplers'"):
            SamplingParams(samplers=bad)


def test_each_sampler_alone_hand_examples():
    lg = [math.log(p) for p in (0.5, 0.2, 0.15, 0.1, 0.05)]
    # typical: entropy ~1.33 nats; |surprise - H|: 0.64, 0.28, 0.56, 0.97, 1.67 -> order 1, 2, 0, 3, 4
    s = make(5, **ALL_OFF, typical_p=0.3)
    assert sorted(kept(s, lg)) == [1, 2]                # 0.2 + 0.15 = 0.35 > 0.3
    assert sorted(kept(make(5, **ALL_OFF, typical_p=0.2), lg)) == [1, 2]   # cum must exceed p
    assert kept(make(5, **ALL_OFF, typical_p=0.1), lg) == [1]
    # xtc threshold 0.14: 0.5, 0.2, 0.15 are above; all but the least likely of them go
    assert kept(make(5, **ALL_OFF, xtc_probability=1.0, xtc_threshold=0.14), lg) == [2, 3, 4]
    assert kept(make(5, **ALL_OFF, xtc_probability=1.0, xtc_threshold=0.6), lg) == [0, 1, 2, 3, 4]
    assert kept(make(5, **ALL_OFF, xtc_probability=1.0, xtc_threshold=0.51), lg) == [0, 1, 2, 3, 4]  # > 0.5: off
    # top_n_sigma on logits 0..9: sigma = 2.87, max 9 -> n=1 keeps >= 6.13
    s = make(10, **ALL_OFF, top_n_sigma=1.0)
    assert kept(s, np.arange(10.0)) == [9, 8, 7]
    assert len(kept(make(10, **ALL_OFF, top_n_sigma=0.0), np.arange(10.0))) == 10
    assert len(kept(make(10, **ALL_OFF, top_n_sigma=-1.0), np.arange(10.0))) == 10
    assert kept(make(3, **ALL_OFF, top_n_sigma=0.1), [0.0, 1.0, 2.0]) == [2, 1, 0]    # < 4 candidates: off
    # ik starts its max at 0 (keeps nothing on all-negative logits and aborts); here the true max
    assert kept(make(10, **ALL_OFF, top_n_sigma=1.0), np.arange(10.0) - 20) == [9, 8, 7]
    # tfs: a sharp head then a flat tail
    lg2 = [5.0, 4.0, 1.0, 0.9, 0.8, 0.7, 0.6]
    ref = ref_chain(lg2, tfs_z=0.5)
    assert kept(make(7, **ALL_OFF, tfs_z=0.5), lg2) == sorted(ref, key=lambda i: -lg2[i])
    assert len(kept(make(2, **ALL_OFF, tfs_z=0.0), [1.0, 0.0])) == 2       # <= 2 candidates: off


def test_random_chains_match_reference():
    """Random logits, random parameters, random orders: the same kept set and probabilities as the
    literal reference, for every sampler with and without min_keep."""
    rng = np.random.default_rng(11)
    letters = list("kfypmxnt")
    for trial in range(250):
        n = int(rng.integers(2, 70))
        logits = (rng.standard_normal(n) * rng.uniform(0.3, 4.0) + rng.uniform(-3, 3)).astype(np.float32)
        if trial % 5 == 0:
            logits[rng.choice(n, n // 3, replace=False)] = -np.inf
        if not np.isfinite(logits).any():
            continue
        order = "".join(rng.permutation(letters)[: int(rng.integers(0, len(letters) + 1))])
        kw = dict(
            min_keep=int(rng.choice([0, 0, 1, 3, 7])),
            top_k=int(rng.choice([0, 1, 5, 30])), top_p=float(rng.choice([1.0, 0.0, 0.5, 0.9])),
            min_p=float(rng.choice([0.0, 0.05, 0.3, 1.0])), tfs_z=float(rng.choice([1.0, 0.0, 0.5, 0.95])),
            typical_p=float(rng.choice([1.0, 0.0, 0.3, 0.9])),
            xtc_probability=float(rng.choice([0.0, 1.0])), xtc_threshold=float(rng.choice([0.0, 0.05, 0.1, 0.3, 0.6])),
            top_n_sigma=float(rng.choice([0.0, 0.5, 1.0, 2.5])), temperature=float(rng.choice([0.3, 1.0, 2.0])),
            dynatemp_range=float(rng.choice([0.0, 0.0, 0.5, 3.0])), dynatemp_exponent=float(rng.choice([0.5, 1.0, 2.0])),
        )
        ref = ref_chain(logits, samplers=order, **kw)
        s = make(n, samplers=order, **kw)
        assert_same_dist(s, logits, ref, rtol=1e-5)
        assert s.sample(logits, []) in ref


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=0.0), dict(min_p=1.0), dict(typical_p=0.0),
                                dict(tfs_z=0.0), dict(xtc_probability=1.0, xtc_threshold=0.0)])
def test_min_keep_floor_for_each_filter(kw):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(30) * 3).astype(np.float32)
    for mk in (0, 1, 4, 29, 30, 50):
        ref = ref_chain(logits, min_keep=mk, **kw)
        s = make(30, **{**ALL_OFF, **kw, "min_keep": mk})
        assert_same_dist(s, logits, ref)
        if "xtc_probability" not in kw:
            assert len(ref) == min(max(1, mk), 30) or ("tfs_z" in kw and len(ref) >= max(1, mk))
    # top_n_sigma takes no min_keep in ik
    lg = np.array([10.0, 0, 0.1, 0.2, 0.3, 0.4], dtype=np.float32)
    assert kept(make(6, **ALL_OFF, top_n_sigma=1.0, min_keep=4), lg) == [0]


def test_all_masked_with_every_sampler():
    n = 8
    masked = np.full(n, -np.inf, dtype=np.float32)
    for kw in (dict(typical_p=0.5), dict(tfs_z=0.5), dict(xtc_probability=1.0, xtc_threshold=0.1),
               dict(top_n_sigma=1.0), dict(dynatemp_range=1.0), dict(dry_multiplier=1.0),
               dict(mirostat=1), dict(mirostat=2), dict(min_keep=5, top_k=2)):
        s = make(n, **kw)
        ids, probs = s.distribution(masked, [1, 2, 1, 2, 1, 2])
        assert ids.size == 0 and probs.size == 0
        assert 0 <= s.sample(masked, [1, 2, 1, 2, 1, 2]) < n
    # one token left: every sampler keeps it
    one = masked.copy()
    one[5] = -3.0
    for kw in (dict(typical_p=0.1), dict(tfs_z=0.1), dict(xtc_probability=1.0, xtc_threshold=0.0),
               dict(top_n_sigma=0.1), dict(dynatemp_range=1.0), dict(mirostat=1), dict(mirostat=2)):
        assert make(n, **kw).sample(one, []) == 5


def test_sampler_order_matters():
    # temperature 5 before top_p flattens the distribution, so top_p needs more tokens
    logits = f32([math.log(p) for p in (0.7, 0.2, 0.1)])
    before = make(3, **{**OFF, "top_p": 0.8, "temperature": 5.0}, samplers="pt")
    after = make(3, **{**OFF, "top_p": 0.8, "temperature": 5.0}, samplers="tp")
    assert kept(before, logits) == [0, 1]
    assert kept(after, logits) == [0, 1, 2]
    assert_same_dist(after, logits, ref_chain(logits, samplers="tp", top_p=0.8, temperature=5.0))
    # no samplers: no filter and no temperature (ik runs only what the list names)
    s = make(3, top_k=1, temperature=0.5, samplers=[])
    ids, probs = s.distribution(logits, [])
    np.testing.assert_allclose(probs, [0.7, 0.2, 0.1], rtol=1e-6)
    # greedy stays greedy whatever the list
    assert make(3, temperature=0.0, samplers="").sample(f32([0, 3, 1]), []) == 1


def test_dynatemp_maps_entropy_to_temperature():
    flat = f32([0.0] * 8)                      # max entropy: temp + range
    peaked = f32([20.0] + [0.0] * 7)           # ~0 entropy: max(0, temp - range)
    for lg in (flat, peaked, f32([2.0, 1.0, 0.5, 0.0, -1.0, -1.5, -2.0, -4.0])):
        for exp in (0.5, 1.0, 2.0):
            ref = ref_chain(lg, samplers="t", temperature=1.0, dynatemp_range=0.7, dynatemp_exponent=exp)
            assert_same_dist(make(8, **ALL_OFF, dynatemp_range=0.7, dynatemp_exponent=exp), lg, ref)
    # range larger than the temperature: the minimum is 0, and a 0 temperature is the argmax
    s = make(4, **{**ALL_OFF, "temperature": 0.5}, dynatemp_range=1.0)
    ids, probs = s.distribution(f32([2000.0, 0.0, 0.0, 0.0]), [])
    assert ids[0] == 0 and probs[0] == pytest.approx(1.0)


# --- XTC's coin -------------------------------------------------------------------------------

def test_xtc_coin_with_a_fixed_seed():
    # tokens 0 and 1 are above the threshold; when XTC fires, token 0 can never come
    logits = f32([3.0, 2.8] + [0.0] * 10)
    kw = dict(**ALL_OFF, xtc_probability=0.5, xtc_threshold=0.1, seed=77)
    s = make(12, **kw)
    fired, toks = 0, []
    for _ in range(300):
        coin = copy.deepcopy(s.xtc_rng).random() <= 0.5
        tok = s.sample(logits, [])
        toks.append(tok)
        if coin:
            fired += 1
            assert tok != 0
        assert s.distribution(logits, [], xtc_fires=coin)[0].tolist().count(0) == (0 if coin else 1)
    assert 120 < fired < 180
    assert toks.count(0) > 40                       # without the coin token 0 is the most likely
    # reproducible, and the main stream advances one draw per token whatever XTC does
    again = make(12, **kw)
    assert [again.sample(logits, []) for _ in range(300)] == toks
    plain = make(12, **ALL_OFF, seed=77)
    for _ in range(300):
        plain.sample(logits, [])
    assert plain.rng.bit_generator.state == s.rng.bit_generator.state
    # probability 1 always fires and draws no coin
    sure = make(12, **{**kw, "xtc_probability": 1.0})
    state = sure.xtc_rng.bit_generator.state
    assert all(sure.sample(logits, []) != 0 for _ in range(50))
    assert sure.xtc_rng.bit_generator.state == state


# --- mirostat ---------------------------------------------------------------------------------

def _ref_mirostat_v2(logits, temp, mu):
    c = _srt([(i, float(v) / temp) for i, v in enumerate(logits) if math.isfinite(v)])
    p = _softmax(c)
    k = next((i for i, x in enumerate(p) if -math.log2(x) > mu), len(c))
    c = c[:max(k, 1)]
    return dict(zip([i for i, _ in c], _softmax(c)))


def _ref_mirostat_v1(logits, temp, mu, n_vocab, m=100):
    c = _srt([(i, float(v) / temp) for i, v in enumerate(logits) if math.isfinite(v)])
    p = _softmax(c)
    num = den = 0.0
    for i in range(min(m - 1, len(c) - 1)):
        t = math.log((i + 2) / (i + 1))
        b = math.log(p[i] / p[i + 1])
        num, den = num + t * b, den + t * t
    s_hat = num / den
    eps = s_hat - 1
    k = (eps * 2 ** mu / (1 - n_vocab ** (-eps))) ** (1 / s_hat)
    kk = int(k) if math.isfinite(k) and k < 2 ** 31 else 0
    kk = len(c) if kk <= 0 else min(kk, len(c))            # ik's top_k(k <= 0): all of them
    full = dict(zip([i for i, _ in c], p))
    c = c[:kk]
    return dict(zip([i for i, _ in c], _softmax(c))), full


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_mu_update_over_tokens(version):
    n, tau, eta, temp = 300, 5.0, 0.2, 0.9
    rng = np.random.default_rng(version)
    s = make(n, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, temperature=temp, top_k=1, seed=5)
    mu = 0.0                                       # ik's common_sampler starts mu at 0
    assert s.mirostat_mu == mu
    mus, sizes = [], []
    hist: list[int] = []
    for step in range(40):
        logits = (rng.standard_normal(n) * 4.0).astype(np.float32)
        if version == 2:
            ref = _ref_mirostat_v2(logits, temp, mu)
            full = None
        else:
            ref, full = _ref_mirostat_v1(logits, temp, mu, n)
        assert_same_dist(s, logits, ref, history=hist, rtol=1e-6)
        tok = s.sample(logits, hist)
        assert tok in ref
        surprise = -math.log2(ref[tok] if version == 2 else full[tok])
        mu -= eta * (surprise - tau)
        assert s.mirostat_mu == pytest.approx(mu, rel=1e-9, abs=1e-9)
        mus.append(mu)
        sizes.append(len(ref))
        hist.append(tok)
    # mu climbs from 0 towards where the surprise averages tau; the cut widens with it (top_k=1 is ignored)
    assert mus[-1] > 1.0 and max(sizes) > 1
    # the same seed repeats the whole run
    again = make(n, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, temperature=temp, top_k=1, seed=5)
    rng = np.random.default_rng(version)
    h2: list[int] = []
    for _ in range(40):
        h2.append(again.sample((rng.standard_normal(n) * 4.0).astype(np.float32), h2))
    assert h2 == hist and again.mirostat_mu == s.mirostat_mu


def test_mirostat_v1_k_below_one_keeps_every_token():
    # ik's top_k(int(k)) with int(k) <= 0 keeps the whole vocab: at mu = 0 on a flat-ish
    # distribution v1 samples from everything, and a high surprise pushes mu further down
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal(300) * 0.5).astype(np.float32)
    s = make(300, mirostat=1, temperature=1.0)
    ref, _ = _ref_mirostat_v1(logits, 1.0, 0.0, 300)
    assert len(ref) == 300 and len(kept(s, logits)) == 300
    s.sample(logits, [])
    assert s.mirostat_mu < 0


def test_mirostat_skips_the_chain_and_greedy_skips_mirostat():
    logits = f32([2.0, 1.9, 1.8, 1.7, -5.0])
    s = make(5, mirostat=2, top_k=1, min_p=0.9, dry_multiplier=5.0, xtc_probability=1.0, xtc_threshold=0.0)
    s.mirostat_mu = 50.0                           # a wide cut: every token
    assert sorted(kept(s, logits, [0, 1, 0, 1, 0])) == [0, 1, 2, 3, 4]
    g = make(5, mirostat=2, temperature=0.0)
    assert g.sample(logits, []) == 0 and g.mirostat_mu == 0.0


# --- DRY --------------------------------------------------------------------------------------

class ToyTokenizer:
    """Token pieces and a greedy longest-match encoder (what DryVocab.of reads from a tokenizer)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.n_vocab = len(pieces)

    def token_to_bytes(self, t: int, special: bool = True) -> bytes:
        return self.pieces[t]

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        b, out, i = text.encode("utf-8"), [], 0
        while i < len(b):
            j = max((j for j, p in enumerate(self.pieces) if p and b.startswith(p, i)), key=lambda j: len(self.pieces[j]))
            out.append(j)
            i += len(self.pieces[j])
        return out


TOY = ToyTokenizer([b"a", b"b", b"c", b"d", b"\n", b":", b" ", b"x", b"y", b"ab", b"x:", b"yx", b"##", b"#",
                    b"q#", b"end\n\nok", b"*", b"\"", b"z"])


def ref_breakers(tok: ToyTokenizer, breakers) -> dict[int, list[tuple]]:
    """ik's get_overlapping_token_sequences, literally, over every token."""
    out: dict[int, list[tuple]] = {}
    for s in breakers:
        b = s.encode("utf-8")[:40]
        if not b:
            continue
        for t, w in enumerate(tok.pieces):
            if b in w:
                out.setdefault(t, [])
                if () not in out[t]:
                    out[t].append(())
                continue
            pos = -1
            while True:
                pos = w.find(b[:1], pos + 1)
                if pos < 0:
                    break
                i, match = 1, True
                while i < len(b) and i + pos < len(w):
                    if w[pos + i] != b[i]:
                        match = False
                        break
                    i += 1
                if match:
                    tail = tuple(tok.encode(b[i:].decode()))[:20]
                    if tail not in out.setdefault(t, []):
                        out[t].append(tail)
    return out


def ref_dry(history, n_vocab, brk, mult, base, allowed, last_n) -> dict[int, float]:
    """ik's llama_sampler_dry_apply with a naive repeat count: token -> penalty."""
    L = min(len(history) if last_n == -1 else min(len(history), last_n), n_vocab)
    if L <= allowed:
        return {}
    w = list(history[len(history) - L:])

    def rat(i):
        return w[L - 1 - i]
    rep_limit = L
    for i in range(L):
        if rat(i) not in brk:
            continue
        longest = -1
        for tail in brk[rat(i)]:
            k = len(tail)
            if longest < k <= i and all(tail[o] == rat(i - o - 1) for o in range(k)):
                longest = k
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    best: dict[int, int] = {}
    for i in range(L - 1):                 # the repetition ending at i; w[i + 1] would extend it
        n = 0
        while n <= i and w[i - n] == w[L - 1 - n]:
            n += 1
        n = min(n, rep_limit)
        if n >= allowed:
            best[w[i + 1]] = max(best.get(w[i + 1], 0), n)
    single = {t for t, tails in brk.items() if () in tails}
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    out = {}
    for t, n in best.items():
        if t in single:
            continue
        e = n - allowed
        if max_exp > 0:
            e = min(e, max_exp)
        out[t] = mult * base ** e
    return out


def dry_logits(sampler, logits, history) -> np.ndarray:
    """The logits after the sampler's chain (DRY alone here: the other filters are off)."""
    c = sampler._candidates(f32(logits))
    for op in sampler._ops:
        op(c, list(history), True)
    out = np.full(len(logits), -np.inf)
    out[c.id_array()] = c.vals
    return out


def test_dry_breaker_mapping_matches_reference():
    for breakers in (["\n", ":", "\"", "*"], ["x:"], ["##"], ["q##"], ["end\n\nok"], ["\n\n"], ["", "ab"]):
        got = DryVocab.of(TOY).breakers(breakers)
        ref = ref_breakers(TOY, breakers)
        assert {t: sorted(v) for t, v in got.tails.items()} == {t: sorted(v) for t, v in ref.items()}, breakers
    b = DryVocab.of(TOY).breakers(["x:"])
    assert (7,) not in b.tails and b.tails[7] == [(5,)] and b.tails[10] == [()]     # "x" + ":" ; "x:" itself
    assert b.tails[11] == [(5,)]                                                       # "yx" ends with "x"
    assert DryVocab.of(TOY) is DryVocab.of(TOY)                                        # built once per tokenizer
    # no tokenizer: only tokens holding a whole breaker count
    plain = DryVocab([b"a", b"x", b"x:", b":"]).breakers(["x:"])
    assert plain.tails == {2: [()]}


def test_dry_on_iks_example():
    # Last N tokens: a b c c b c y a b c -> c extends a repeat of 3, y one of 2 (ik's comment)
    a, b, c, y = 0, 1, 2, 8
    hist = [a, b, c, c, b, c, y, a, b, c]
    logits = np.zeros(TOY.n_vocab, dtype=np.float32)
    s = Sampler(SamplingParams(**ALL_OFF, dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=2,
                               dry_sequence_breakers=()), TOY.n_vocab, vocab=TOY)
    got = dry_logits(s, logits, hist)
    exp = np.zeros(TOY.n_vocab)
    exp[c], exp[y] = -0.5 * 2.0, -0.5
    np.testing.assert_allclose(got, exp, atol=1e-6)


@pytest.mark.parametrize("breakers", [(), ("\n",), ("\n", ":"), ("x:",), ("q##",)])
def test_dry_repeated_sequence_with_and_without_breakers(breakers):
    toks = {p: i for i, p in enumerate(TOY.pieces)}
    a, b, c, nl, x, col, q, hh = (toks[k] for k in (b"a", b"b", b"c", b"\n", b"x", b":", b"q#", b"##"))
    hist = [a, b, c, x, col, a, b, c, nl, a, b, c, q, hh, a, b, c, nl, a, b]
    logits = np.linspace(0.0, 1.0, TOY.n_vocab).astype(np.float32)
    for mult, base, allowed, last_n in ((0.8, 1.75, 2, -1), (1.0, 3.0, 1, -1), (0.5, 1.0, 0, 12), (2.0, 1.75, 3, 7)):
        s = Sampler(SamplingParams(**ALL_OFF, dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed,
                                   dry_penalty_last_n=last_n, dry_sequence_breakers=breakers), TOY.n_vocab, vocab=TOY)
        pen = ref_dry(hist, TOY.n_vocab, ref_breakers(TOY, breakers), mult, base, allowed, last_n)
        exp = logits.astype(np.float64).copy()
        for t, v in pen.items():
            exp[t] -= v
        np.testing.assert_allclose(dry_logits(s, logits, hist), exp, rtol=1e-6, atol=1e-5)
    # the hand case: with "\n" a breaker the run "a b" after the last newline is short: c gets the
    # base penalty; without breakers "a b c \n a b" repeats (6 tokens): 2 ^ (6 - 2)
    s = Sampler(SamplingParams(**ALL_OFF, dry_multiplier=1.0, dry_base=2.0, dry_sequence_breakers=breakers),
                TOY.n_vocab, vocab=TOY)
    out = dry_logits(s, np.zeros(TOY.n_vocab, dtype=np.float32), hist)
    if "\n" in breakers:
        assert out[c] == pytest.approx(-1.0) and out[nl] == 0.0
    elif not breakers:
        assert out[c] == pytest.approx(-16.0)


def test_dry_random_histories_match_reference():
    rng = np.random.default_rng(21)
    breakers = ("\n", ":", "x:", "##")
    brk = ref_breakers(TOY, breakers)
    for trial in range(60):
        hist = rng.integers(0, 6, int(rng.integers(0, 120))).tolist()   # a small alphabet: many repeats
        if trial % 3 == 0:
            hist = (hist[:10] * 12)[: int(rng.integers(20, 120))]        # periodic
        mult = float(rng.choice([0.3, 1.0, -0.5]))
        base = float(rng.choice([1.0, 1.75, 5.0, 1000.0]))
        allowed = int(rng.integers(0, 5))
        last_n = int(rng.choice([-1, 5, 40, 500]))
        use = breakers if trial % 2 else ()
        logits = rng.standard_normal(TOY.n_vocab).astype(np.float32)
        s = Sampler(SamplingParams(**ALL_OFF, dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed,
                                   dry_penalty_last_n=last_n, dry_sequence_breakers=use), TOY.n_vocab, vocab=TOY)
        pen = ref_dry(hist, TOY.n_vocab, brk if use else {}, mult, base, allowed, last_n)
        exp = logits.astype(np.float64).copy()
        for t, v in pen.items():
            exp[t] -= v
        np.testing.assert_allclose(dry_logits(s, logits, hist), exp, rtol=1e-6, atol=1e-5)


def test_dry_window_limits_and_switches():
    hist = [0, 1, 2, 0, 1, 2, 0, 1]
    logits = np.zeros(TOY.n_vocab, dtype=np.float32)

    def pen(**kw):
        s = Sampler(SamplingParams(**ALL_OFF, dry_sequence_breakers=(), **kw), TOY.n_vocab, vocab=TOY)
        return -dry_logits(s, logits, hist)[2]
    assert pen(dry_multiplier=1.0) > 0
    assert pen(dry_multiplier=0.0) == 0                         # off
    assert pen(dry_multiplier=1.0, dry_penalty_last_n=0) == 0   # off
    assert pen(dry_multiplier=1.0, dry_base=0.5) == 0           # base < 1: off
    assert pen(dry_multiplier=1.0, dry_penalty_last_n=2) == 0   # window too short to repeat
    assert pen(dry_multiplier=1.0, dry_allowed_length=8) == 0   # window not longer than allowed
    # ik sizes DRY's context by the vocabulary: a 4-token vocab looks at the last 4 tokens only
    small = Sampler(SamplingParams(**ALL_OFF, dry_multiplier=1.0, dry_allowed_length=1, dry_sequence_breakers=()), 4)
    ids, probs = small.distribution(np.zeros(4, dtype=np.float32), [3, 3, 3, 3, 3, 0, 1, 2, 0, 1])
    assert dict(zip(ids.tolist(), probs.tolist()))[3] == pytest.approx(probs.max())   # the old 3s are out of sight
    # without a vocabulary DRY still runs, with no sequence breakers
    bare = Sampler(SamplingParams(**ALL_OFF, dry_multiplier=1.0), TOY.n_vocab)
    assert -dry_logits(bare, logits, hist)[2] > 0
    # a huge base is clamped so the penalty stays a float
    big = Sampler(SamplingParams(**ALL_OFF, dry_multiplier=1.0, dry_base=1e30, dry_allowed_length=0,
                                 dry_sequence_breakers=()), TOY.n_vocab, vocab=TOY)
    ids, probs = big.distribution(logits, [0] * 30)
    assert np.isfinite(probs).all() and 0 in ids.tolist()


def test_dry_vocab_from_the_demo_tokenizer():
    from ikcli.defaults import demo_model
    from engine.tokenizer import Tokenizer
    import os
    if not os.path.exists(demo_model()):
        pytest.skip("no demo model")
    tk = Tokenizer.from_gguf(demo_model())
    dv = DryVocab.of(tk)
    assert DryVocab.of(tk) is dv
    brk = dv.breakers(SamplingParams().dry_sequence_breakers)
    with_nl = [t for t in range(tk.n_vocab) if b"\n" in tk.token_to_bytes(t)]
    assert with_nl and set(with_nl) <= set(brk.single.tolist())
    # through the params, as the server passes it
    p = SamplingParams(dry_multiplier=0.8, seed=1)
    p.vocab = tk
    s = Sampler(p, tk.n_vocab)
    assert s._dry_breakers is brk
    ids = tk.encode("to be or not to be, to be or not to be, to be or", add_special=False)
    assert 0 <= s.sample(np.zeros(tk.n_vocab, dtype=np.float32), ids) < tk.n_vocab


# --- request fields ---------------------------------------------------------------------------

def test_from_request_new_fields():
    body = {"min_keep": 2, "typical_p": 0.9, "tfs_z": 0.95, "dynatemp_range": 0.5, "dynatemp_exponent": 2,
            "mirostat": 2, "mirostat_tau": 4, "mirostat_eta": 0.2, "xtc_probability": 0.5, "xtc_threshold": 0.1,
            "top_n_sigma": 1.5, "dry_multiplier": 0.8, "dry_base": 2, "dry_allowed_length": 3,
            "dry_penalty_last_n": 256, "dry_sequence_breakers": ["\n", "###"], "samplers": "dkt"}
    p = SamplingParams.from_request(body)
    for k, v in body.items():
        if k == "samplers":
            assert p.samplers == ("dry", "top_k", "temperature")
        elif k == "dry_sequence_breakers":
            assert p.dry_sequence_breakers == ("\n", "###")
        else:
            assert getattr(p, k) == v and type(getattr(p, k)) is type(getattr(SamplingParams(), k)), k
    d = SamplingParams()
    assert (d.min_keep, d.typical_p, d.tfs_z, d.mirostat, d.mirostat_tau, d.mirostat_eta, d.xtc_probability,
            d.xtc_threshold, d.top_n_sigma, d.dry_multiplier, d.dry_base, d.dry_allowed_length,
            d.dry_penalty_last_n, d.dry_sequence_breakers, d.dynatemp_range, d.dynatemp_exponent) == \
        (0, 1.0, 1.0, 0, 5.0, 0.1, 0.0, 1.0, 0.0, 0.0, 1.75, 2, -1, ("\n", ":", "\"", "*"), 0.0, 1.0)


@pytest.mark.parametrize("body, field", [
    ({"mirostat": 3}, "mirostat"), ({"mirostat": True}, "mirostat"), ({"typical_p": 1.5}, "typical_p"),
    ({"tfs_z": -0.1}, "tfs_z"), ({"min_keep": -1}, "min_keep"), ({"xtc_probability": 2}, "xtc_probability"),
    ({"top_n_sigma": "x"}, "top_n_sigma"), ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"dry_allowed_length": 1.5}, "dry_allowed_length"), ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": [1]}, "dry_sequence_breakers"), ({"samplers": ["top_k", "dist"]}, "samplers"),
    ({"samplers": 3}, "samplers"), ({"dynatemp_range": float("inf")}, "dynatemp_range"),
])
def test_from_request_rejects_bad_new_values(body, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams.from_request(body)


def test_params_vocab_is_shared_not_copied_or_reported():
    import dataclasses
    p = SamplingParams(dry_multiplier=0.5)
    p.vocab = TOY
    q = copy.deepcopy(p)                        # the server deep-copies params per prompt
    assert q.vocab is TOY and q == p and q is not p
    assert "vocab" not in dataclasses.asdict(p) and SamplingParams().vocab is None
    assert "vocab" not in {f.name for f in dataclasses.fields(SamplingParams)}
    assert SamplingParams.from_request({"vocab": "x"}).vocab is None         # never read from a request


# --- penalties as ik_llama.cpp applies them ---------------------------------------------------
# ik's per-candidate arithmetic (src/llama-sampling.cpp, llama_sample_repetition_penalties_impl), in
# float32: logit <= 0 ? logit * repeat : logit / repeat, then logit -= count * freq + present; the
# tokens are the last min(len, repeat_last_n) of the list it is given (common/sampling.cpp), and the
# newline token gets its logit back unless penalize_nl.

def ik_penalties(logits, tokens, rp, fq, pr, last_n, nl=None, penalize_nl=False) -> np.ndarray:
    """A literal, scalar float32 transcription of ik's formulas (for comparing bit for bit)."""
    x = [np.float32(v) for v in logits]
    n_used = len(tokens) if last_n < 0 else min(len(tokens), last_n)
    if n_used == 0 or (rp == 1.0 and fq == 0.0 and pr == 0.0):
        return np.array(x, dtype=np.float32)
    window = list(tokens)[len(tokens) - n_used:]
    counts: dict[int, int] = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    keep = x[nl] if nl is not None else None
    rp32, fq32, pr32 = np.float32(rp), np.float32(fq), np.float32(pr)
    for t, c in counts.items():
        v = x[t] * rp32 if x[t] <= 0 else x[t] / rp32
        x[t] = np.float32(v - (np.float32(c) * fq32 + np.float32(c > 0) * pr32))
    if nl is not None and not penalize_nl:
        x[nl] = keep
    return np.array(x, dtype=np.float32)


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def test_penalty_arithmetic_by_hand_negative_zero_and_counts():
    logits = f32([3.0, -2.0, 0.0, 1.5, -0.5, 4.0])
    hist = [0, 0, 1, 3, 3, 3, 2]          # counts: t0 2, t1 1, t2 1, t3 3
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=-1)
    out = apply_penalties(logits, hist, p)
    # t0: 3/2 - (2*0.5 + 0.25); t1: -2*2 - 0.75; t2: 0 is multiplied (0) - 0.75; t3: 1.5/2 - (1.5 + 0.25)
    np.testing.assert_array_equal(out, f32([0.25, -4.75, -0.75, -1.0, -0.5, 4.0]))
    # repeat_penalty alone: a negative logit goes down (multiplied), a positive one down (divided)
    only_rp = apply_penalties(logits, hist, SamplingParams(repeat_penalty=1.25, repeat_last_n=-1))
    np.testing.assert_array_equal(only_rp, f32([2.4, -2.5, 0.0, 1.2, -0.5, 4.0]))
    # a repeat_penalty below 1 raises them instead, as in ik (no clamping)
    low = apply_penalties(logits, hist, SamplingParams(repeat_penalty=0.5, repeat_last_n=-1))
    np.testing.assert_array_equal(low, f32([6.0, -1.0, 0.0, 3.0, -0.5, 4.0]))
    # presence alone: once per distinct token whatever its count; frequency: per occurrence
    pres = apply_penalties(logits, hist, SamplingParams(presence_penalty=1.0, repeat_last_n=-1))
    np.testing.assert_array_equal(pres, f32([2.0, -3.0, -1.0, 0.5, -0.5, 4.0]))
    freq = apply_penalties(logits, hist, SamplingParams(frequency_penalty=1.0, repeat_last_n=-1))
    np.testing.assert_array_equal(freq, f32([1.0, -3.0, -1.0, -1.5, -0.5, 4.0]))
    # negative presence / frequency penalties favour the repeated tokens
    neg = apply_penalties(logits, hist, SamplingParams(frequency_penalty=-0.5, presence_penalty=-0.25,
                                                       repeat_last_n=-1))
    np.testing.assert_array_equal(neg, f32([4.25, -1.25, 0.75, 3.25, -0.5, 4.0]))


@pytest.mark.parametrize("last_n, want", [
    (0, [3.0, -2.0, 0.0, 1.5, -0.5, 4.0]),          # off
    (1, [3.0, -2.0, -0.75, 1.5, -0.5, 4.0]),        # [2]
    (2, [3.0, -2.0, -0.75, 0.0, -0.5, 4.0]),        # [3, 2]: t3 once
    (4, [3.0, -2.0, -0.75, -1.0, -0.5, 4.0]),       # [3, 3, 3, 2]: t3 three times, t1 just outside
    (5, [3.0, -4.75, -0.75, -1.0, -0.5, 4.0]),      # t1 just inside, t0 outside
    (6, [0.75, -4.75, -0.75, -1.0, -0.5, 4.0]),     # one t0 in
    (7, [0.25, -4.75, -0.75, -1.0, -0.5, 4.0]),     # the whole history
    (8, [0.25, -4.75, -0.75, -1.0, -0.5, 4.0]),     # longer than the history: all of it
    (-1, [0.25, -4.75, -0.75, -1.0, -0.5, 4.0]),    # -1: all of it
])
def test_penalty_window_edges(last_n, want):
    logits = f32([3.0, -2.0, 0.0, 1.5, -0.5, 4.0])
    hist = [0, 0, 1, 3, 3, 3, 2]
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=last_n)
    got = apply_penalties(logits, hist, p)
    np.testing.assert_array_equal(got, f32(want))
    np.testing.assert_array_equal(bits(got), bits(ik_penalties(logits, hist, 2.0, 0.5, 0.25, last_n)))


def test_penalize_nl_restores_the_newline_logit_after_the_penalties():
    logits = f32([3.0, -2.0, 0.0, 1.5])
    hist = [1, 1, 3]                 # token 1 is the newline
    kw = dict(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    kept_nl = apply_penalties(logits, hist, SamplingParams(**kw), nl_token=1)
    np.testing.assert_array_equal(kept_nl, f32([3.0, -2.0, 0.0, 0.0]))
    hit_nl = apply_penalties(logits, hist, SamplingParams(penalize_nl=True, **kw), nl_token=1)
    np.testing.assert_array_equal(hit_nl, f32([3.0, -5.25, 0.0, 0.0]))
    # a newline outside the window is untouched either way; so is one with repeat_last_n 0
    np.testing.assert_array_equal(apply_penalties(logits, [3], SamplingParams(penalize_nl=True, **kw), 1),
                                  f32([3.0, -2.0, 0.0, 0.0]))
    np.testing.assert_array_equal(apply_penalties(logits, hist, SamplingParams(penalize_nl=True, repeat_last_n=0,
                                                                               **kw), 1), logits)


def test_penalties_bit_for_bit_with_iks_float32_formulas():
    rng = np.random.default_rng(7)
    special = f32([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, 1e-45])
    for trial in range(300):
        n = 64
        logits = (rng.standard_normal(n) * rng.choice([0.1, 1.0, 30.0])).astype(np.float32)
        logits[rng.choice(n, len(special), replace=False)] = special
        hist = [int(t) for t in rng.integers(0, rng.choice([4, 16, n]), int(rng.integers(0, 90)))]
        rp = float(rng.choice([1.0, 1.1, 1.18, 0.7, float(rng.uniform(0.2, 3.0))]))
        fq = float(rng.choice([0.0, 0.5, float(rng.uniform(-2, 2))]))
        pr = float(rng.choice([0.0, -1.0, float(rng.uniform(-2, 2))]))
        last_n = int(rng.choice([-1, 0, 1, 3, 64, 89, 200]))
        nl = int(rng.integers(0, n)) if trial % 2 else None
        pnl = bool(trial % 3 == 0)
        p = SamplingParams(repeat_penalty=rp, frequency_penalty=fq, presence_penalty=pr, repeat_last_n=last_n,
                           penalize_nl=pnl)
        with np.errstate(over="ignore"):
            got = apply_penalties(logits, hist, p, nl)
            want = ik_penalties(logits, hist, rp, fq, pr, last_n, nl, pnl)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"trial {trial}")


def test_penalty_tokens_are_the_latest_token_only():
    """ik's common_sampler keeps its penalty tokens in a vector that its reset empties and its accept
    keeps at the same length (oldest out, newest in), so after the server's reset + prompt loop it holds
    one token: the prompt's last, then each generated token in turn."""
    from engine.sampling import penalty_tokens
    assert list(penalty_tokens([])) == []
    assert list(penalty_tokens([5])) == [5]
    assert list(penalty_tokens([1, 2, 3, 3])) == [3]
    assert penalty_tokens(np.array([4, 5, 6])).tolist() == [6]


@pytest.mark.parametrize("last_n", [-1, 1, 64, 4096])
def test_sampler_penalizes_only_the_latest_token(last_n):
    logits = f32([3.0, -2.0, 0.0, 1.5, -0.5, 4.0])
    hist = [0, 0, 1, 3, 3, 3, 2, 5, 5, 3]     # older repeats of 0, 3, 5 count for nothing
    kw = dict(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=last_n)
    s = Sampler(SamplingParams(**kw), 6)
    want = ik_penalties(logits, hist[-1:], 2.0, 0.5, 0.25, last_n)
    np.testing.assert_array_equal(want, f32([3.0, -2.0, 0.0, 1.5 / 2 - 0.75, -0.5, 4.0]))
    np.testing.assert_array_equal(bits(s._penalized(logits, hist)), bits(want))
    # greedy: 5 is the argmax; it is penalized only while it is the latest token
    g = Sampler(SamplingParams(temperature=0.0, **kw), 6)
    assert g.sample(logits, [5, 5, 5, 0]) == 5
    assert g.sample(logits, [0, 5]) == 0             # 4/2 - 0.75 = 1.25 < 3
    off = Sampler(SamplingParams(temperature=0.0, **{**kw, "repeat_last_n": 0}), 6)
    assert off.sample(logits, [0, 5]) == 5


def test_newline_token_as_iks_llama_token_nl():
    from engine.sampling import newline_token

    class Spm:
        type = "spm"
        def __init__(self, t2i): self.token_to_id = t2i
        def encode(self, text, add_special=True): return [29871, 13]     # "▁" + "<0x0A>": never used

    class Bpe:
        type = "bpe"
        def __init__(self, ids): self.ids = ids
        def encode(self, text, add_special=True): return list(self.ids)

    assert newline_token(Spm({"<0x0A>": 13, "\n": 5})) == 13        # the byte token first
    assert newline_token(Spm({"\n": 403})) == 403                    # else the token "\n" itself
    assert newline_token(Spm({"a": 1})) is None
    assert newline_token(Bpe([198])) == 198
    assert newline_token(Bpe([198, 7])) == 198                       # the first of several, as ik
    assert newline_token(Bpe([])) is None
    assert newline_token(object()) is None                            # no way to encode: nothing kept

    from ikcli.defaults import demo_model
    from engine.tokenizer import Tokenizer
    import os
    if os.path.exists(demo_model()):
        assert newline_token(Tokenizer.from_gguf(demo_model())) == 10    # libllama's llama_token_nl: 10


# ik_llama.cpp's greedy tokens on the demo model, recorded from its compiled common_sampler driven as its
# server drives a slot (common_sampler_reset, common_sampler_accept of every prompt token, then sample /
# accept / decode), temperature 0, 16 tokens.  Before the penalty window matched, ikcli's text differed
# from these at token 2, 1 and 2 respectively.
IK_PENALTY_STREAMS = [
    ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.",
     [1023, 640, 417, 890, 58, 10, 769, 555, 331, 581, 306, 315, 806, 271, 361, 700, 44, 677, 320, 621, 46, 10, 10,
      65, 273, 58, 10, 83, 112, 583, 44, 621, 46],
     dict(repeat_penalty=1.5, repeat_last_n=64),
     [10, 10, 640, 536, 280, 303, 270, 58, 10, 73, 358, 321, 817, 308, 363, 44]),
    ("JULIET:\nO Romeo, Romeo, wherefore art thou",
     [1023, 944, 58, 10, 79, 747, 111, 44, 747, 111, 44, 721, 555, 738, 343],
     dict(repeat_penalty=2.0, repeat_last_n=64, penalize_nl=True),
     [63, 10, 65, 108, 660, 44, 343, 738, 258, 268, 283, 107, 44, 298, 343, 738]),
    ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.",
     [1023, 640, 417, 890, 58, 10, 769, 555, 331, 581, 306, 315, 806, 271, 361, 700, 44, 677, 320, 621, 46, 10, 10,
      65, 273, 58, 10, 83, 112, 583, 44, 621, 46],
     dict(repeat_penalty=2.0, repeat_last_n=-1, penalize_nl=True),
     [10, 352, 121, 429, 266, 966, 111, 784, 44, 298, 266, 966, 111, 784, 319, 288]),
]


def test_serving_penalty_history_and_iks_text(monkeypatch):
    """Serving level: the penalties of a slot see the prompt's last token for the first generated
    token and then only the previous generated token (the prompt's other tokens never), and the
    greedy text with penalties is ik_llama.cpp's."""
    import os
    import threading
    import engine.sampling as sampling
    from engine.config import EngineConfig
    from engine.model import load_model, quiet_log
    from engine.serving import ServingEngine
    from ikcli.defaults import demo_model
    if not os.path.exists(demo_model()):
        pytest.skip("no demo model")
    model = load_model(demo_model(), quiet_log)
    seen: list[list[int]] = []
    real = sampling.apply_penalties

    def spy(logits, history, params, nl_token=None):
        seen.append([int(t) for t in history])
        return real(logits, history, params, nl_token)

    monkeypatch.setattr(sampling, "apply_penalties", spy)
    e = ServingEngine(model, EngineConfig(demo_model(), n_ctx=256, n_threads=2), 1, quiet_log)
    e.start()
    try:
        for text, prompt, kw, want in IK_PENALTY_STREAMS:
            assert model.tokenizer.encode(text, add_special=True) == prompt
            seen.clear()
            out: list[int] = []
            done = threading.Event()

            def on_event(ev):
                if ev.done:
                    done.set()

            e.submit(prompt, SamplingParams(temperature=0.0, **kw), len(want), [], on_event)
            assert done.wait(120)
            out = list(e.slots[0].generated)
            assert out == want, (kw, out)
            assert seen == [[prompt[-1]]] + [[t] for t in out[:-1]]
    finally:
        e.shutdown()
