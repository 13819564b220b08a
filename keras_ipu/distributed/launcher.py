"""`keras-ipu run --num-instances N`: starts the instances of a job on this machine.

Like Graphcore's `poprun`: each instance is the same Python script in its own
process, told its place in the job through environment variables
(`runtime.COORDINATOR_ENV`, ...); the instances then meet through JAX's
distributed runtime. The launcher prefixes every line an instance prints with
`[INDEX]` (standard output and error kept apart), forwards Ctrl-C (SIGINT)
and SIGTERM to all of them (then exits with 128 + the signal's number, saying
so), and otherwise exits with the status of the first instance that failed
(0 when all succeed), naming it and why. Each instance runs the script through
`instance_main.py`, so that one failing ends at once with its own status
instead of waiting in JAX's shutdown barrier; the launcher then stops the
others (SIGTERM, then SIGKILL after `STOP_GRACE_SECONDS`). An instance that
succeeds while others still run is left waiting for them.

On several machines, start the same script with the cluster's own tools
(SLURM's `srun`, `mpirun`), which `jax.distributed.initialize()` detects, or
set the three variables in each process yourself (see docs/multi_host.md).
"""

from __future__ import annotations

import argparse
import errno
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from keras_ipu.distributed import runtime

# Stopped instances (SIGTERM) get this long to exit before they are killed.
STOP_GRACE_SECONDS = 5.0
# After Ctrl-C, instances get this long to exit before they are killed.
INTERRUPT_GRACE_SECONDS = 10.0
# Every instance has an IPU at least; the largest IPU system, a Bow Pod1024, has 1024.
MAX_INSTANCES = 1024
# What every instance runs: the script, ending at once when it fails.
INSTANCE_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "instance_main.py")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether a socket on this machine already holds TCP `port` (instance 0's
    coordination service listens on it on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # A port only in TIME_WAIT from an earlier job is free to listen on.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def instance_environment(index: int, num_instances: int, coordinator: str,
                         num_replicas: int | None = None, ipus_per_replica: int | None = None,
                         base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of instance `index`: `base` (default: this process's) plus the job's.

    Example:

    >>> instance_environment(1, 2, "127.0.0.1:4000")["KERAS_IPU_INSTANCE_INDEX"]
    '1'
    """
    env = dict(os.environ if base is None else base)
    env.update({
        runtime.COORDINATOR_ENV: coordinator,
        runtime.NUM_INSTANCES_ENV: str(num_instances),
        runtime.INSTANCE_INDEX_ENV: str(index),
        "PYTHONUNBUFFERED": "1",  # lines reach the prefixer as they are printed
    })
    if num_replicas is not None:
        env[runtime.NUM_REPLICAS_ENV] = str(num_replicas)
    if ipus_per_replica is not None:
        env[runtime.IPUS_PER_REPLICA_ENV] = str(ipus_per_replica)
    return env


def instance_command(command: Sequence[str]) -> list[str]:
    """The command an instance runs for `SCRIPT ARGS...` or `-m MODULE ARGS...`.

    The script runs through `instance_main.py` (see there); a command that
    starts with another Python option runs as it is.

    Example:

    >>> instance_command(["train.py", "--epochs", "3"])[-3:]
    ['train.py', '--epochs', '3']
    """
    command = list(command)
    if command[0].startswith("-") and command[0] != "-m":
        return [sys.executable, "-u", *command]
    return [sys.executable, "-u", INSTANCE_MAIN, *command]


_OPTIONS_WITH_VALUES = ("--num-instances", "--num-replicas", "--ipus-per-replica",
                        "--coordinator")
# The interpreter's long options, which an instance's command may start with.
_PYTHON_LONG_OPTIONS = ("--check-hash-based-pycs", "--help-env", "--help-xoptions",
                        "--help-all")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-ipu run",
        usage="keras-ipu run --num-instances N [options] [--] (SCRIPT | -m MODULE) [ARGS...]",
        description="Start N instances of a training script on this machine (multi-host "
                    "training over JAX's distributed runtime).",
    )
    parser.add_argument("--num-instances", type=int, required=True,
                        help="instances (processes) to start")
    parser.add_argument("--num-replicas", type=int, default=None,
                        help="global replicas over all instances (each instance configures "
                             "num_replicas / num_instances replicas via update_ipu_config)")
    parser.add_argument("--ipus-per-replica", type=int, default=None,
                        help="IPUs per replica (pipeline stages), for update_ipu_config")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="address of instance 0's coordination service "
                             "(default: a free port on 127.0.0.1)")
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """`(the launcher's options, the instances' command)`.

    The command starts at `--`, at `-m`, or at the first argument that is
    not one of the launcher's options, so that the script's own options
    (`-m`, `--epochs`) are never taken for the launcher's.

    Raises:
        ValueError: For a long option before the command that is neither the
            launcher's nor Python's (whose options are short: `-u`, `-X`): a
            misspelt option of the launcher's.
    """
    options, index = [], 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return options, argv[index + 1:]
        name = token.split("=", 1)[0]
        if name in _OPTIONS_WITH_VALUES and "=" not in token:
            options += argv[index:index + 2]
            index += 2
        elif name in _OPTIONS_WITH_VALUES or token in ("-h", "--help"):
            options.append(token)
            index += 1
        elif token.startswith("--") and name not in _PYTHON_LONG_OPTIONS:
            raise ValueError(f"unknown option {token} (the launcher's: "
                             f"{', '.join(_OPTIONS_WITH_VALUES)}; the script's own go after "
                             f"it, or after --)")
        else:
            return options, argv[index:]
    return options, []


def main(argv: Sequence[str]) -> int:
    """Runs `keras-ipu run --num-instances N [options] [--] SCRIPT ARGS...`.

    Args:
        argv: The arguments after `run`.

    Returns:
        The first failed instance's exit status (128 + signal number when a
        signal ended it), or 0 when every instance succeeded; 128 + the
        signal's number when the launcher was interrupted (Ctrl-C: 130),
        whatever the instances then exit with; 2 for bad arguments.

    Example:

    >>> main(["--num-instances", "2", "train.py", "--epochs", "3"])
    0
    """
    parser = _parser()
    try:
        options, command = _split(list(argv))
    except ValueError as unknown:
        parser.error(str(unknown))
    if "--num-instances" not in [o.split("=", 1)[0] for o in options] and any(
            a.split("=", 1)[0] == "--num-instances" for a in command):
        parser.error("give the launcher's options (--num-instances, ...) before the script")
    args = parser.parse_args(options)
    if not command or command == ["-m"]:
        parser.error("give the script to run: SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    if not 1 <= args.num_instances <= MAX_INSTANCES:
        print(f"error: --num-instances must be from 1 to {MAX_INSTANCES} (an instance has "
              f"an IPU at least, and the largest IPU system {MAX_INSTANCES}), got "
              f"{args.num_instances}", file=sys.stderr)
        return 2
    if args.ipus_per_replica is not None and args.ipus_per_replica < 1:
        print(f"error: --ipus-per-replica must be at least 1, got {args.ipus_per_replica}",
              file=sys.stderr)
        return 2
    if args.ipus_per_replica is not None and args.num_replicas is None:
        print(f"error: --ipus-per-replica ({args.ipus_per_replica}) needs --num-replicas: "
              f"the IPUs each instance takes are its replicas times their IPUs",
              file=sys.stderr)
        return 2
    if args.num_replicas is not None and (
            args.num_replicas < 1 or args.num_replicas % args.num_instances):
        print(f"error: --num-replicas ({args.num_replicas}) must be a positive multiple of "
              f"--num-instances ({args.num_instances}): each instance runs the same number "
              f"of replicas", file=sys.stderr)
        return 2
    if args.coordinator is not None and not _is_host_and_port(args.coordinator):
        print(f"error: --coordinator must be HOST:PORT (a port from 1 to 65535), got "
              f"{args.coordinator!r}", file=sys.stderr)
        return 2
    unreachable = args.coordinator and _not_local(args.coordinator.rpartition(":")[0])
    if unreachable:  # else every instance waits 2 minutes for it, then aborts
        print(f"error: --coordinator {args.coordinator}: {unreachable}", file=sys.stderr)
        return 2
    if args.coordinator is not None and port_in_use(int(args.coordinator.rpartition(":")[2])):
        # Instance 0 would fail to start its coordination service (a crash, SIGSEGV).
        print(f"error: --coordinator {args.coordinator}: its port is in use on this machine; "
              f"give a free port, or leave --coordinator out to have one picked",
              file=sys.stderr)
        return 2
    if not command[0].startswith("-") and not os.path.exists(command[0]):  # a zip, a folder
        parser.error(f"no script {command[0]!r} (from {os.getcwd()})")
    command = instance_command(command)
    coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
    return Job(command, args.num_instances, coordinator, args.num_replicas,
               args.ipus_per_replica).run()


def _is_host_and_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _not_local(host: str) -> str | None:
    """Why instances on this machine cannot reach a coordinator on `host`, or `None`."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return f"cannot resolve {host!r} ({error.strerror})"
    for family, _, _, _, address in addresses:  # `localhost` may give ::1 where IPv6 is off
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(address)
                return None
            except OSError:
                pass
    return (f"{host!r} ({', '.join(a[4][0] for a in addresses)}) is not an address of this "
            f"machine, where the launcher starts every instance")


def _signal_session(process: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to every process of an instance's session (its group: the
    instance's pid), ended or not: its workers may outlive it."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):  # none left
        pass


class Job:
    """The processes of one launched job, their output, and their end.

    Args:
        command: The command every instance runs.
        num_instances: How many instances to start.
        coordinator: `HOST:PORT` of instance 0's coordination service.
        num_replicas: Global replicas, passed on to `update_ipu_config`.
        ipus_per_replica: IPUs per replica, passed on to `update_ipu_config`.
        output: Where the instances' prefixed output lines go (default: standard output).
        errors: Where their prefixed error lines and the launcher's messages go
            (default: standard error).
    """

    def __init__(self, command: Sequence[str], num_instances: int, coordinator: str,
                 num_replicas: int | None = None, ipus_per_replica: int | None = None,
                 output=None, errors=None):
        self.command = list(command)
        self.num_instances = num_instances
        self.coordinator = coordinator
        self.num_replicas = num_replicas
        self.ipus_per_replica = ipus_per_replica
        self.output = output or sys.stdout
        self.errors = errors or sys.stderr
        self._lock = threading.Lock()
        self._processes: list[subprocess.Popen] = []
        # The reader of the output went away (`... | head`): the instances are stopped,
        # as a pipe's writer is, and what they still write is read and dropped.
        self._reader_gone = threading.Event()

    def _print(self, index: int, line: str, target) -> None:
        with self._lock:
            if target is self.output and self._reader_gone.is_set():
                return
            try:
                target.write(f"[{index}] {line}")
                if not line.endswith("\n"):
                    target.write("\n")
                target.flush()
            except BrokenPipeError:
                if target is not self.output:
                    return
                self._reader_gone.set()
                self._signal_all(signal.SIGTERM)

    def _pump(self, index: int, stream, target) -> None:
        for line in iter(stream.readline, ""):
            self._print(index, line, target)
        stream.close()

    def _start(self, interrupted: list[int]) -> list[threading.Thread]:
        threads = []
        for index in range(self.num_instances):
            if interrupted or self._reader_gone.is_set():
                break  # the forwarded signal would miss the instances started after it
            env = instance_environment(index, self.num_instances, self.coordinator,
                                       self.num_replicas, self.ipus_per_replica)
            # Own sessions: a terminal's Ctrl-C reaches the launcher only,
            # which forwards it once to every instance.
            # Standard output and error stay apart: the runtime's C++ logging
            # and Python's prints would otherwise mix within lines.
            process = subprocess.Popen(
                self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, errors="replace", start_new_session=True)
            self._processes.append(process)
            if interrupted:  # the signal came as it started: the forward missed it
                _signal_session(process, interrupted[0])
            for stream, target in ((process.stdout, self.output), (process.stderr, self.errors)):
                thread = threading.Thread(target=self._pump, args=(index, stream, target),
                                          daemon=True)
                thread.start()
                threads.append(thread)
        return threads

    def _signal_all(self, signum: int) -> None:
        # Each instance's session: its data-loader workers too, as a terminal's Ctrl-C
        # reaches a foreground job's (they were left running).
        for process in self._processes:
            if process.poll() is None:
                _signal_session(process, signum)

    def _stop_all(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for process in self._processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _signal_session(process, signal.SIGKILL)
                process.wait()

    def _end_sessions(self) -> None:
        """Kills what the instances left running (workers hold their output pipes), once
        they have ended (a session's id stays taken while any process of it runs)."""
        for process in self._processes:
            _signal_session(process, signal.SIGKILL)

    def run(self) -> int:
        """Starts the instances and waits for them.

        Returns:
            The exit status of the job (see `main`).
        """
        previous = {}
        interrupted: list[int] = []

        def forward(signum, frame):
            interrupted.append(signum)
            self._signal_all(signum)

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, forward)
        try:
            threads = self._start(interrupted)
            status = self._wait(interrupted)
            self._end_sessions()
            for thread in threads:
                thread.join(timeout=5.0)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for process in self._processes:  # an instance reaped long ago: its pid is free
                if process.poll() is None:
                    _signal_session(process, signal.SIGKILL)
        return status

    def _wait(self, interrupted: list[int]) -> int:
        # One waiter per instance: the instances' ends arrive in the order
        # they happen, so the first to fail is told from those it took down
        # (a peer's collective fails the moment the failed one's sockets close).
        ended: queue.Queue = queue.Queue()
        for index, process in enumerate(self._processes):
            threading.Thread(target=lambda i=index, p=process: ended.put((i, p.wait())),
                             daemon=True).start()
        failed: tuple[int, int] | None = None
        stop_at: float | None = None
        announced = False
        running = set(range(len(self._processes)))
        while running:
            if interrupted and not announced:
                # Instances ending by the forwarded signal are no failures of
                # their own: the job's status is the interrupt's.
                announced = True
                self._print_launcher(
                    f"interrupted by {signal.Signals(interrupted[0]).name}, forwarded to "
                    f"every instance; stopping them (at most {INTERRUPT_GRACE_SECONDS:g} s)")
                stop_at = time.monotonic() + INTERRUPT_GRACE_SECONDS
            if stop_at is not None and time.monotonic() >= stop_at:
                cause = "the interrupt" if failed is None else f"instance {failed[0]} failed"
                self._print_launcher(f"stopping instance(s) {sorted(running)}, still running "
                                     f"after {cause}")
                self._signal_all(signal.SIGTERM)
                self._stop_all(STOP_GRACE_SECONDS)
                break
            try:
                index, code = ended.get(timeout=0.05)
            except queue.Empty:
                continue
            running.discard(index)
            if code != 0 and failed is None and not interrupted and not self._reader_gone.is_set():
                failed = (index, code)
                self._report(index, code)
                stop_at = time.monotonic()  # the others at once
        if self._reader_gone.is_set():
            return 1  # as `keras-ipu show ... | head`
        if failed is None and interrupted:
            status = 128 + interrupted[0]
            self._print_launcher(f"job interrupted, exiting with status {status}")
            return status
        if failed is None:
            return 0
        code = failed[1]
        return 128 - code if code < 0 else code

    def _report(self, index: int, code: int) -> None:
        if code < 0:
            why = f"was killed by signal {signal.Signals(-code).name}"
        else:
            why = f"exited with status {code}"
        self._print_launcher(f"instance {index} failed: it {why}")

    def _print_launcher(self, text: str) -> None:
        with self._lock:
            self.errors.write(f"keras-ipu run: {text}\n")
            self.errors.flush()
