"""Every Python code block of the README and the guide runs as written; the site builds strictly."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from conftest import fresh_process_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{page.relative_to(ROOT)}:{index}")
    for page in PAGES
    for index, block in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(),
                                             flags=re.S | re.M))
]


def test_the_docs_have_code_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("block", BLOCKS)
def test_a_code_block_runs_as_written(block, tmp_path, fork_server):
    # As `python -c BLOCK` in a fresh process (forked from one that has done the imports).
    status, _, stderr = fork_server.run(["-c", block], tmp_path, fresh_process_env(), 300)
    assert status == 0, stderr[-3000:]


def test_the_guide_builds_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=ROOT, env=fresh_process_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").exists()
