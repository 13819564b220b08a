"""The notebooks run top to bottom in a fresh kernel (a failing cell fails the test)."""

from __future__ import annotations

import pathlib
import signal
import time

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import use_fresh_process_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_five_notebooks_stored_without_outputs():
    assert [n.stem[:2] for n in NOTEBOOKS] == ["01", "02", "03", "04", "05"]
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_runs_top_to_bottom(path, monkeypatch):
    # The kernel starts as a user's would: no test settings, keras_ipu importable.
    use_fresh_process_env(monkeypatch)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.get("output_type") == "error"]
    assert errors == []
    # The pictures show as pictures, without pyplot's inline backend (MPLBACKEND=Agg).
    for cell in notebook.cells:
        if cell.cell_type == "code" and "plot_" in cell.source:
            kinds = {kind for output in cell.outputs for kind in output.get("data", {})}
            assert "image/png" in kinds, (cell.source, kinds)


def test_the_porting_notebook_holds_the_examples_verbatim():
    """Each example cell is an `examples/` file: the seed's code with its imports changed."""
    notebook = nbformat.read(ROOT / "notebooks" / "05_porting_from_ipu_tensorflow.ipynb",
                             as_version=4)
    named = [cell.source for cell in notebook.cells if cell.cell_type == "markdown"
             and cell.source.startswith("`examples/")]
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"][1:]
    assert len(named) == len(code) >= 7
    for name, source in zip(named, code):
        path = ROOT / name.strip("`")
        assert source.strip() == path.read_text().strip(), path.name


def test_interrupting_the_kernel_during_fit_leaves_the_model_usable(tmp_path, monkeypatch):
    """Ctrl-C in Jupyter (a kernel interrupt) while `fit` runs; the next cells go on."""
    from jupyter_client.manager import start_new_kernel

    use_fresh_process_env(monkeypatch)
    started, stacks = tmp_path / "started", tmp_path / "stacks.txt"
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        def run(code, timeout=120):
            reply = client.execute_interactive(code, timeout=timeout, output_hook=lambda m: None)
            return reply["content"]

        assert run(_STACKS_ON_SIGUSR1.format(stacks=str(stacks)))["status"] == "ok"
        assert run(_SETUP)["status"] == "ok"
        client.execute(_LONG_FIT.format(started=str(started)))
        for _ in range(600):  # until the fit has run a few executions
            if started.exists():
                break
            time.sleep(0.1)
        assert started.exists()
        manager.interrupt_kernel()
        reply = _shell_reply(client, manager, stacks)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
        check = run(_AFTER)
        if check["status"] == "aborted":
            # ipykernel aborts what arrives while it still clears the interrupted cell's
            # queue (seen under load): the cell never ran, and a user runs it again.
            check = run(_AFTER)
        assert check["status"] == "ok", check.get("traceback")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _shell_reply(client, manager, stacks, timeout=60) -> dict:
    """The kernel's reply to an interrupted cell.

    An interrupt that went unanswered (seen once in CI, under load) is
    reported with every thread's stack in the kernel, then repeated as a user
    would press the button again; the test goes on, and a second miss fails it.
    """
    import queue
    import warnings

    try:
        return client.get_shell_msg(timeout=timeout)["content"]
    except queue.Empty:
        warnings.warn(f"the kernel did not answer an interrupt in {timeout} s; its threads:\n"
                      f"{_kernel_stacks(manager, stacks)}", stacklevel=2)
    manager.interrupt_kernel()
    try:
        return client.get_shell_msg(timeout=timeout)["content"]
    except queue.Empty:
        pytest.fail(f"the kernel answered neither of two interrupts; its threads, twice:\n"
                    f"{_kernel_stacks(manager, stacks)}")


def _kernel_stacks(manager, stacks) -> str:
    """Every kernel thread's stack, dumped by the kernel into `stacks` (appended)."""
    manager.provisioner.process.send_signal(signal.SIGUSR1)
    time.sleep(2)
    return stacks.read_text()


# Test instrumentation, not a user's: lets a hung kernel tell where it hangs.
_STACKS_ON_SIGUSR1 = """
import faulthandler, signal
faulthandler.register(signal.SIGUSR1, all_threads=True, file=open({stacks!r}, "w"))
"""

_SETUP = """
import keras_ipu as ipu
import keras
import numpy as np
config = ipu.config.IPUConfig()
config.auto_select_ipus = 1
config.configure_ipu_system()
x = np.random.rand(4096, 32).astype("float32")
y = np.random.rand(4096, 1).astype("float32")
with ipu.ipu_strategy.IPUStrategy().scope():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse", steps_per_execution=8)
"""

_LONG_FIT = """
import pathlib, time
def mark(batch, logs):
    if batch >= 16:
        pathlib.Path({started!r}).touch()
    time.sleep(0.01)
model.fit(x, y, batch_size=8, epochs=1000, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=mark)])
"""

_AFTER = """
weights = model.get_weights()
assert all(np.isfinite(w).all() for w in weights)
loss = model.evaluate(x, y, batch_size=8, verbose=0)
model.fit(x[:512], y[:512], batch_size=8, epochs=1, verbose=0)
assert np.isfinite(loss)
"""
