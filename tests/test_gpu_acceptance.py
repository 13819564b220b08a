"""benchmarks/gpu_acceptance.py: the verdicts it reads from the benchmarks' JSON files."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _acceptance():
    path = ROOT / "benchmarks" / "gpu_acceptance.py"
    spec = importlib.util.spec_from_file_location("gpu_acceptance", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _results(s1, s10, s100, ga8, dense, first):
    """The benchmarks' JSON, in the shapes they write (keys this script reads)."""
    small = {str(s): {"ratio_ipu_limit": r} for s, r in ((1, s1), (10, s10), (100, s100))}
    return {
        "single": {"small": small},
        "ga": {"ratios": {"ipu_ga8 / limit_ga8": ga8}},
        "table": {"cases": {"dense4096/single": {"warm_ratio": dense},
                            "resnet50/single": {"warm_ratio": 1.9, "first_ratio": first}}},
    }


def test_each_figure_is_judged_against_its_threshold():
    rows = _acceptance().verdicts(_results(0.62, 0.79, 0.93, 0.9, 1.06, 1.28))
    assert [(r["figure"], r["verdict"]) for r in rows] == [
        ("keras_ipu / limit, S = 1", "PASS"),
        ("keras_ipu / limit, S = 10", "MISS"),
        ("keras_ipu / limit, S = 100", "PASS"),
        ("GA 8 / its limit", "PASS"),  # at the threshold
        ("4 x Dense(4096) warm, keras_ipu / plain", "PASS"),
        ("ResNet50 first fit, keras_ipu / plain", "MISS"),  # a time: at most 1.1
        ("ResNet50 warm, keras_ipu / plain", "PASS"),
    ]


def test_a_step_that_did_not_finish_is_not_measured(tmp_path):
    acceptance = _acceptance()
    results = _results(0.62, 0.85, 0.93, 0.95, 1.06, 1.05)
    for name in ("single", "ga"):  # the table step ran out of time
        (tmp_path / f"{name}.json").write_text(json.dumps(results[name]))
    rows = acceptance.summarize(str(tmp_path))
    assert [r["verdict"] for r in rows] == ["PASS"] * 4 + ["NOT MEASURED"] * 3
    written = json.loads((tmp_path / "acceptance.json").read_text())
    assert written["figures"] == rows
    assert acceptance.main(["--summarize", str(tmp_path), "--check"]) == 1
