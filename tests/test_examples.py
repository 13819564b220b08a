"""The seed's Keras examples, ported by changing imports only, run unchanged."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import fresh_process_env

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
    "example_19_9_1_export_non_pipelined.py",
    "example_19_9_2_export_pipelined.py",
]


def _run(args, cwd):
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=fresh_process_env(), capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("script", RUNNABLE)
def test_example_runs_unchanged(script, tmp_path, fork_server):
    # A copy, so the examples' outputs (exports) land in a temporary folder. Run as
    # `python SCRIPT` in a fresh process (forked from one that has done the imports).
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    status, stdout, stderr = fork_server.run([script], tmp_path / "examples",
                                             fresh_process_env(), 600)
    assert status == 0, stderr[-4000:]
    assert "Program ran successfully" in stdout
    if script in EXPORTS:
        export_dir, expected = EXPORTS[script]
        assert _printed_numbers(stdout) == expected
        # The export alone, in a fresh process without Keras: the same numbers.
        loaded = _run(["-c", _LOAD_AND_RUN.format(export_dir=export_dir)],
                      tmp_path / "examples")
        assert _printed_numbers(loaded) == expected


# The seed's exports: where they write, and the numbers they print (one row each).
EXPORTS = {
    "example_19_9_1_export_non_pipelined.py": ("my_saved_model_ipu/003", list(range(2, 18))),
    "example_19_9_2_export_pipelined.py": ("my_saved_model_ipu/004", list(range(2, 33, 2))),
}

_LOAD_AND_RUN = """
import sys
import numpy as np
import keras_ipu as ipu
runtime = ipu.serving.load({export_dir!r})
for i in range(16):
    print(runtime(np.ones((1, 4), np.float32) * i, np.ones((1, 4), np.float32) * 2))
assert "keras" not in sys.modules, sorted(m for m in sys.modules if m.startswith("keras"))
"""


def _printed_numbers(stdout: str) -> list[int]:
    """The value of each printed `[[v v v v]]` row."""
    rows = re.findall(r"\[\[([-0-9. ]+)\]\]", stdout)
    values = [sorted(set(float(v) for v in row.split())) for row in rows]
    assert all(len(v) == 1 for v in values), rows
    return [int(v[0]) for v in values]
