"""quant.registry: one record per type, the sets derived from it, and the import layering it
replaced a circle with (no module of quant/, engine/ or ikcli/ imports one that imports it back,
counting imports inside functions)."""
from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from quant import floats, iqk, iquants, kquants, ktquants, legacy, reference, registry
from quant.matmul import supported
from quant.types import ALL_TYPES, type_info

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (names resolved; `from a import b` counts a.b when
    b is a module)."""
    graph: dict[str, set[str]] = {}
    for pkg in ("quant", "engine", "ikcli"):
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            name = ".".join(parts)
            here = parts if is_pkg else parts[:-1]
            deps = set()
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom):
                    base = here[:len(here) - node.level + 1] if node.level else []
                    mod = ".".join(base + ([node.module] if node.module else []))
                    deps.add(mod)
                    deps.update(f"{mod}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
            graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    graph = _imports()
    assert "quant.registry" in graph and "quant.kernels" in graph["quant.matmul"]
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_one_record_per_type_and_families_disjoint():
    assert set(registry.TRAITS) == {t.id for t in ALL_TYPES}
    fams = [floats.TYPES, legacy.TYPES, kquants.TYPES, iqk.TYPES, iquants.TYPES, ktquants.TYPES]
    assert sum(len(f) for f in fams) == len(set().union(*fams))
    for f in fams:
        for t in f:
            assert registry.TRAITS[t].family is not None and not type_info(t).interleave


def test_derived_sets():
    for t, r in registry.TRAITS.items():
        assert supported(t) == (t in registry.COMPUTE_TYPES) == r.decodes
        if r.decodes:      # the engine computes only with types it can also write and read back
            assert r.dequantize is not None and r.dot is not None, r.name
            # ... but for ikcli's internal compute forms (quant.types), never written
            assert (r.quantize is not None) == (not type_info(t).internal), r.name
        if r.integer_dot:
            assert r.act in (registry.ACT_Q8_32, registry.ACT_Q8_16, registry.ACT_Q8_256)
        if r.dot == registry.DOT_UNPACK:
            assert type_info(t).interleave
    # what ikcli computes today: 37 plain types (floats, legacy, K-quants, IQK, i-quants, trellis)
    # and every _R4/_R8
    assert {type_info(t).name for t in registry.COMPUTE_TYPES} >= {"Q4_K", "IQ2_K_R4", "Q8_K_R8", "BF16", "IQ4_KSS"}
    assert registry.traits("q4_k").dot == registry.DOT_BLOCK and registry.traits("IQ3_K_R4").dot == registry.DOT_R4
    with pytest.raises(KeyError, match="unknown tensor type"):
        registry.traits("Q9_K")
    # what the kernels are today, written out (the asserts above only check the sets agree)
    assert len(registry.COMPUTE_TYPES) == 70 and len(registry.INT_DOT_TYPES) == 46
    want = {"F16": ("f32", -1), "IQ4_KSS": ("f32", -1), "Q8_0": ("q8", 0), "Q8_0_R8": ("q8", 8),
            "Q4_K": ("block", 0), "Q6_0": ("block", 0), "IQ2_KS": ("block", 0), "Q4_K_R4": ("r4", 4),
            "IQ4_KS_R4": ("r4", 4), "IQ4_XS_R8": ("unpack", -1), "Q8_K_R8": ("unpack", -1), "Q8_K": (None, -1),
            "IQ2_XXS": ("block", 0), "IQ1_M": ("block", 0), "MXFP4": ("block", 0), "IQ2_KT": ("block", 0),
            "IQ5_KS": ("block", 0), "IQ2_XXS_R4": ("unpack", -1), "IQ1_M_ROWS": ("block", 0),
            "IQ1_M_R4": ("unpack", -1), "IQ1_S_R4": ("unpack", -1)}
    assert registry.traits("IQ2_KT").matmul_scale == 1.05 and registry.traits("IQ4_KT").matmul_scale == 1.0
    assert {n: (registry.traits(n).dot, registry.traits(n).gemm) for n in want} == want


@pytest.mark.parametrize("name", sorted(type_info(t).name for t in registry.QUANTIZE_TYPES))
def test_front_door_round_trip(name):
    """reference.quantize -> reference.dequantize through each record: the error of a type of b bits
    per weight stays under 0.8 * 2^(2 - b) of the signal (a layout mix-up gives ~1.4)."""
    ti = type_info(name)
    n = 256 if ti.block_size > 1 else 64
    rows = max(1, ti.interleave)
    x = np.random.default_rng(ti.id).standard_normal((rows, n)).astype(np.float32)
    if registry.traits(name).needs_imatrix:
        with pytest.raises(ValueError):
            reference.quantize(x, ti.id)
    raw = reference.quantize(x, ti.id, np.ones(n, np.float32) if registry.traits(name).needs_imatrix else None)
    assert raw.size == rows * ti.row_bytes(n)
    y = reference.dequantize(raw, ti.id, rows * n, n).reshape(rows, n)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x * x))
    assert rel < max(0.8 * 2.0 ** (2 - ti.bpw), 0.004), (name, rel)    # BF16: 8 bits of mantissa
