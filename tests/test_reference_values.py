"""Perplexities that ik_llama.cpp's llama-perplexity printed for the same files and text.

The models are written deterministically by scripts/make_test_model.py (seeds below), the text is the
bundled Shakespeare test file, -c 128 --chunks 8, exactly as scripts/compare_perplexity.py runs
them. Reference figures: ik_llama.cpp commit 8337e4cd3, CPU build, `-mla 0 -fa off` (the mode
ikcli runs). The issue's bar is 0.5%; the measured differences here were all below 0.2%.
"""
from __future__ import annotations

import re

import pytest

from conftest import FINAL_PPL
from ikcli.app import main
from ikcli.defaults import demo_model, demo_text

IK = [
    # arch, layout, preset, type, seed, ik_llama.cpp PPL
    ("llama", "ik", "tiny", "q4_0", 1, 1630.2114),
    ("deepseek2", "ik", "tiny", "q8_0", 1, 1858.9690),
    ("deepseek2", "mainline-mla", "tiny-mla576", "q4_0", 1, 1835.6998),
    ("deepseek2", "ik", "tiny-v3", "f16", 1, 1972.2505),
    ("deepseek2", "mainline-old", "tiny-lite", "f16", 0, 1643.6874),
]


def _ppl(capsys, *args) -> str:
    try:
        main(["perplexity", *args])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err[-2000:]
    return capsys.readouterr().out


@pytest.mark.parametrize("arch,layout,preset,qtype,seed,ref", IK, ids=[f"{c[2]}-{c[1]}-{c[3]}" for c in IK])
def test_matches_ik_llama_cpp(make_model, capsys, arch, layout, preset, qtype, seed, ref):
    path = make_model(arch=arch, layout=layout, qtype=qtype, preset=preset, seed=seed)
    out = _ppl(capsys, "-m", path, "-f", demo_text(), "-c", "128", "--chunks", "8", "-t", "2", "-mla", "0", "-fa", "off")
    got = float(FINAL_PPL.search(out).group(1))
    assert got == pytest.approx(ref, rel=0.005)


def test_demo_model_first_chunks_match_ik_llama_cpp(capsys):
    """llama-perplexity -c 256 (default flags) on the demo model printed [1]9.8079,[2]12.9589,[3]12.1562;
    over all 193 chunks it gives 29.3740 (-mla 3 -fa on) and 29.3718 (-mla 0 -fa off)."""
    out = _ppl(capsys, "-m", demo_model(), "-f", demo_text(), "-c", "256", "--chunks", "3", "-t", "2")
    vals = [float(v) for v in re.findall(r"\[\d+\](\d+\.\d+),", out)]
    assert vals == pytest.approx([9.8079, 12.9589, 12.1562], rel=1e-3)
