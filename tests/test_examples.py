"""The seed's Keras examples, ported by changing imports only, run unchanged."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

# The examples the implemented features make run; later features add theirs.
RUNNABLE = [
    "example_19_1_single_ipu.py",
    "example_19_2_steps_per_execution.py",
    "example_19_3_gradient_accumulation.py",
    "example_19_5_replication.py",
    "example_19_4_1_sequential_pipeline.py",
    "example_19_4_2_functional_pipeline.py",
    "example_19_4_2_existing_resnet50.py",
    "example_19_4_3_subclass_pipeline.py",
    "example_19_7_feed_options.py",
]


@pytest.mark.parametrize("script", RUNNABLE)
def test_example_runs_unchanged(script):
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, script], cwd=EXAMPLES, env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Program ran successfully" in result.stdout
