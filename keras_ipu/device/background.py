"""XLA compilations on a host thread, while the first executions run step by step.

On an accelerator, XLA compiles a program whose steps loop on the device
(a `while` loop round the training step) for seconds longer than the step
alone: on an H100, ResNet50's loop of 20 steps 10.6 s against 7.2 s for
plain Keras' step (BENCHMARKS.md). So a program's first executions can run
the step alone, dispatched once per step from the host (the `host` loop
form, which gives the same numbers), while the loop compiles on a thread of
its own; executions switch to the loop once it is ready. The user's first
step then waits for the step's compilation only, as in plain Keras, and
later executions still get the loop's throughput.

XLA releases Python's lock while it compiles, so the thread costs the host
loop nothing but a CPU core. Its threads are not daemons: the interpreter
waits for a compilation still running when the program ends, instead of
tearing XLA down under it.

`--background_loop_compile=auto|true|false` in `KERAS_IPU_FLAGS` decides:
`auto` (the default) compiles in the background on accelerators and not on
CPUs, where the loop compiles about as fast as the step and a second
compilation would only compete for the cores.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from keras_ipu.device import attachment, system

AUTO = "auto"
CHOICES = (AUTO, "true", "false")
THREAD_NAME = "keras_ipu-compile"


def enabled(platform: str) -> bool:
    """Whether programs on `platform` compile their loop in the background.

    Args:
        platform: The JAX platform of the program's devices.

    Returns:
        The configured `--background_loop_compile`: `true`, `false`, or for
        `auto` (the default, also with no system configured) whether the
        platform is an accelerator; `False` on a system that never runs
        executions (`PRE_COMPILE`, `NEVER`), where the loop is what gets
        compiled, checked and reported.

    Example:

    >>> enabled("gpu")  # no flag given
    True
    """
    configured = system.current()
    if not attachment.runs_programs():
        return False  # nothing runs to overlap: the loop is compiled, checked and reported
    choice = configured.option("background_loop_compile", AUTO) if configured else AUTO
    if choice == AUTO:
        return platform != "cpu"
    return choice == "true"


class Compilation:
    """`compile_fn(*args)` running on its own (non-daemon) thread.

    Args:
        compile_fn: What compiles, e.g. `compiler.compile_lowered`.
        *args: Its arguments.

    Example:

    >>> loop = Compilation(compiler.compile_lowered, lowered, options)
    >>> loop.done()
    False
    >>> compiled = loop.result()  # waits; re-raises the compilation's error
    """

    def __init__(self, compile_fn: Callable[..., Any], *args: Any):
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self.seconds = 0.0
        threading.Thread(target=self._run, args=(compile_fn, args), name=THREAD_NAME).start()

    def _run(self, compile_fn: Callable[..., Any], args: tuple) -> None:
        started = time.perf_counter()
        try:
            result, error = compile_fn(*args), None
        except BaseException as raised:  # handed to whoever takes the result
            result, error = None, raised
        # Timed before the future is done: whoever sees it done reads the time.
        self.seconds = time.perf_counter() - started
        if error is None:
            self._future.set_result(result)
        else:
            self._future.set_exception(error)

    def done(self) -> bool:
        """Whether the compilation has ended (compiled, or failed)."""
        return self._future.done()

    def result(self) -> Any:
        """The compiled program, once done (waits until then).

        Raises:
            Exception: The compilation's own error.
        """
        return self._future.result()


def wait_for_compilations(timeout: float | None = None) -> None:
    """Waits for every background compilation of the process to end.

    For measurements that must not share the host with a compilation, and
    for tests.

    Args:
        timeout: Seconds to wait for each, at most (`None`: until it ends).

    Example:

    >>> model.fit(x, y)                 # the loop compiles in the background
    >>> wait_for_compilations()         # now it has: the next fit runs it
    """
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME and thread is not threading.current_thread():
            thread.join(timeout)
