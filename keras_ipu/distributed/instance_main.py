"""An instance of `keras-ipu run`: runs the script as `python` would; a failure ends it at once.

`python instance_main.py (SCRIPT | -m MODULE) [ARGS...]`. The launcher runs
this file by its path, so that nothing of keras_ipu or JAX is imported before
the script starts (a script may set JAX's environment first); the script gets
the `sys.argv`, `sys.path[0]` and `__main__` that `python SCRIPT` gives it.

An instance that joined the job and then fails (an uncaught exception,
`sys.exit(3)`, Ctrl-C) prints its traceback and ends at once with its exit
status, skipping the exit handlers. At a normal exit JAX's runtime waits in a
shutdown barrier for every instance: an instance still waiting in a
collective for the failed one would keep both waiting until the barrier's
timeout (minutes), after which the runtime aborts them all (SIGABRT), and the
launcher could not tell which one failed. An instance that succeeds exits as
usual, waiting there for the others to finish.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from collections.abc import Sequence


def exit_status(error: BaseException) -> int:
    """The status `python` exits with when `error` ends the script.

    Example:

    >>> exit_status(SystemExit(3)), exit_status(ValueError()), exit_status(SystemExit())
    (3, 1, 0)
    """
    if isinstance(error, SystemExit):
        if error.code is None:
            return 0
        return error.code if isinstance(error.code, int) else 1
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def _joined() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def _script_frames(trace):
    """`trace` without the frames of this file and of runpy, which run the script."""
    here = os.path.abspath(__file__)
    while trace is not None and (trace.tb_frame.f_globals.get("__name__") == "runpy"
                                 or os.path.abspath(trace.tb_frame.f_code.co_filename) == here):
        trace = trace.tb_next
    return trace


def _leave(error: BaseException) -> None:
    """Prints what `python` prints for `error`, then ends the process with its status."""
    if isinstance(error, SystemExit):
        if error.code is not None and not isinstance(error.code, int):
            print(error.code, file=sys.stderr)
    else:
        traceback.print_exception(type(error), error, _script_frames(error.__traceback__))
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status(error))


def main(argv: Sequence[str]) -> None:
    """Runs `SCRIPT ARGS...` or `-m MODULE ARGS...` as `__main__`.

    Args:
        argv: The command after `python`, without its options.
    """
    argv = list(argv)
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except BaseException as error:
        if exit_status(error) != 0 and _joined():
            _leave(error)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
