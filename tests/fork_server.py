"""Fresh processes for the examples and the docs' code blocks, without Python's imports each time.

A server process imports what every script imports (keras_ipu, Keras, JAX, NumPy) and nothing
more: JAX's backends are not started and no other thread runs, so forking it is safe. For each
script it forks a child, which is a fresh process as far as the script can tell: its own
environment, folder and `sys.argv`, JAX starting its devices when the script configures its
IPUs, a normal interpreter exit. Each script saves the ~2 s its imports would take.

The server runs this file; the suite talks to it through `ForkServer`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback


class ForkServer:
    """The suite's side: starts the server once and runs scripts in children of it.

    Example:

    >>> server = ForkServer(env)
    >>> server.run(["example.py"], cwd, env, timeout=600)
    (0, 'Program ran successfully\\n', '')
    """

    def __init__(self, env: dict):
        self._process = subprocess.Popen(
            [sys.executable, __file__], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1)

    def run(self, argv: list[str], cwd: str, env: dict, timeout: float) -> tuple[int, str, str]:
        """Runs `python *argv` (a script path and its arguments, or `-c CODE`) in a child.

        Returns:
            `(exit status, stdout, stderr)`.
        """
        out, err = os.path.join(cwd, ".fork_stdout"), os.path.join(cwd, ".fork_stderr")
        request = {"argv": argv, "cwd": str(cwd), "env": env, "timeout": timeout,
                   "stdout": out, "stderr": err}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        ready, _, _ = select.select([self._process.stdout], [], [], timeout + 30)
        if not ready:
            raise TimeoutError(f"The fork server did not answer within {timeout + 30} s.")
        status = json.loads(self._process.stdout.readline())["status"]
        with open(out) as stdout, open(err) as stderr:
            texts = stdout.read(), stderr.read()
        os.remove(out)
        os.remove(err)
        return status, *texts

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)


def _serve() -> None:
    # keras_ipu first, as scripts import it: it selects Keras' JAX backend. JAX is
    # imported, its backends not started.
    import keras_ipu  # noqa: F401, I001
    import jax  # noqa: F401
    import keras  # noqa: F401
    import numpy  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns: the child's interpreter exits
        status = _wait(pid, request["timeout"])
        sys.stdout.write(json.dumps({"status": status}) + "\n")
        sys.stdout.flush()


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(code)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.02)


def _child(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    argv = request["argv"]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            import runpy

            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.exit(status)  # the interpreter's own exit: its handlers run, streams flush


if __name__ == "__main__":
    _serve()
