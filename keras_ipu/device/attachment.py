"""Whether a compiled program may run: its IPUs' memory, and the system's device connection.

Every program keras_ipu compiles passes here before it runs: an execution of
`fit`, Keras' step of `train_on_batch`, the computation of `strategy.run` or
`ipu_compiler.compile`. Two things can stop it, as on an IPU system:

- **memory**: the program needs more bytes than an IPU has
  (`IPUOutOfMemoryError`, before anything runs);
- **the device connection** (`DeviceConnectionType`): `ALWAYS` and
  `ON_DEMAND` run programs; `PRE_COMPILE` compiles them and gives zeros for
  everything the device would return; `NEVER` compiles them and refuses to
  run them (`IPUNotAttachedError`).

`CheckedFunction` applies both to a jitted function run on one IPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from keras_ipu.device import accounting, floating_point, precision, queues, system
from keras_ipu.errors import IPUNotAttachedError, IPUOutOfMemoryError

# Device connections on which no program runs (`DeviceConnectionType` names).
NEVER_RUNS = frozenset({"PRE_COMPILE", "NEVER"})


def connection() -> str:
    """The configured `DeviceConnectionType`'s name (`"ALWAYS"` with no system configured).

    Example:

    >>> connection()
    'ALWAYS'
    """
    configured = system.current()
    return configured.option("device_connection_type", "ALWAYS") if configured else "ALWAYS"


def runs_programs() -> bool:
    """Whether programs run on the configured system (not with `PRE_COMPILE` or `NEVER`).

    Example:

    >>> runs_programs()
    True
    """
    return connection() not in NEVER_RUNS


def check_attached(program: str) -> None:
    """Refuses to run a program on a system that never attaches to its IPUs (`NEVER`).

    Args:
        program: The program's name, for the message (`"fit"`, `"train_on_batch"`).

    Raises:
        IPUNotAttachedError: When the device connection is `NEVER`.

    Example:

    >>> check_attached("fit")   # ALWAYS: nothing happens
    """
    if connection() == "NEVER":
        raise IPUNotAttachedError(program)


def zeros_like(shapes: Any) -> Any:
    """Host zeros of a pytree's shapes and dtypes: what a program that did not run returns.

    Args:
        shapes: A pytree of arrays or shape structs.

    Returns:
        The same structure of NumPy zeros.

    Example:

    >>> zeros_like(jax.ShapeDtypeStruct((2,), "float32"))
    array([0., 0.], dtype=float32)
    """
    return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def check_fits(memory: Sequence[tuple[int, accounting.MemoryUse]], program: str,
               pipelined: bool = False, capacity: int | None = None) -> None:
    """Refuses a program that needs more memory than one of its IPUs has.

    Args:
        memory: `(IPU index, its MemoryUse)` for each IPU the program runs on.
        program: The program's name, for the message.
        pipelined: Whether the program runs a pipeline (the remedies differ).
        capacity: An IPU's bytes; by default the configured system's.

    Raises:
        IPUOutOfMemoryError: Naming the IPU that needs most (the first of equals).
        RuntimeError: When no IPU system is configured.

    Example:

    >>> check_fits([(0, accounting.MemoryUse(1_000, 0, 0))], "fit")   # it fits
    """
    if capacity is None:
        capacity = system.require().hardware.memory_capacity_bytes
    over = [(use.total_bytes, -ipu, use) for ipu, use in memory if use.total_bytes > capacity]
    if over:
        needed, ipu, use = max(over, key=lambda entry: entry[:2])
        recomputing = pipelined and system.require().recomputes
        raise IPUOutOfMemoryError(
            -ipu, needed, capacity, program, pipelined=pipelined, recomputing=recomputing,
            parts=(use.state_bytes, use.temporary_bytes + use.code_bytes, use.io_bytes))


def program_memory(compiled: Any, ipus_per_device: int = 1) -> accounting.MemoryUse:
    """An IPU's memory for a compiled program whose inputs and outputs are its own I/O.

    For programs that keep no state between calls (`strategy.run`'s): what
    XLA's memory analysis gives for arguments, outputs and temporaries, each
    IPU's share where IPUs share a device.

    Args:
        compiled: A `jax.stages.Compiled` program (per device, if replicated).
        ipus_per_device: IPUs batched in each device's program.

    Returns:
        One IPU's `MemoryUse`.

    Example:

    >>> program_memory(jax.jit(lambda x: x * 2).lower(np.ones(4)).compile()).io_bytes
    32
    """
    analysis = compiled.memory_analysis()
    io = sum(int(getattr(analysis, field, 0) or 0) for field in
             ("argument_size_in_bytes", "output_size_in_bytes")) if analysis else 0
    return accounting.memory_use(compiled, state_bytes=0, io_bytes=io // ipus_per_device,
                                 ipus_per_device=ipus_per_device)


def run_checked(executable: Any, program: str, *args: Any,
                unrun: Callable[[Any], Any] = lambda zeros: zeros) -> Any:
    """Runs a compiled, memory-checked program as the device connection allows.

    Args:
        executable: The compiled program (a `jax.stages.Compiled`).
        program: Its name, for `IPUNotAttachedError`.
        *args: Its arguments.
        unrun: Makes what a `PRE_COMPILE` system returns from the zeros of
            its outputs (to give the state back unchanged, say).

    Returns:
        The program's outputs; with `PRE_COMPILE`, `unrun(zeros)`, the zeros
        on the devices the outputs would be on.

    Raises:
        IPUNotAttachedError: With `NEVER`.

    Example:

    >>> run_checked(compiled, "fit", state, batches)
    """
    if runs_programs():
        return executable(*args)
    check_attached(program)
    return unrun(jax.device_put(zeros_like(executable.out_info), executable.output_shardings))


class CheckedFunction:
    """A jitted `fn(state, data) -> (outputs, state)` run as a program on one IPU.

    Made for the configured system, and run as it would run there:

    - compiled once per input signature, its memory checked against the
      IPU before its first run (the state counted whole, the data and the
      outputs as its I/O);
    - with floating point exceptions trapped (`floating_point_behaviour`),
      the first one raises `IPUFloatingPointError` and nothing is kept (the
      state it was given is then not consumed);
    - with `--use_synthetic_data` it gets zeros for the data and gives zeros
      for the outputs (the state still changes, as on the device);
    - with `PRE_COMPILE` the outputs are zeros and the state comes back as it
      was given; with `NEVER` it raises `IPUNotAttachedError`.

    Args:
        fn: The step, `(state, data) -> (outputs, new state)`, the new state of
            the given state's structure.
        ipu: The index of the IPU it runs on (for the memory error).
        program: Its name, for the errors (`"train_on_batch"`).

    Raises:
        RuntimeError: When no IPU system is configured.

    Example:

    >>> step = CheckedFunction(model.train_step, 0, "train_on_batch")
    >>> logs, state = step(state, batch, donate=True)
    """

    def __init__(self, fn: Callable, ipu: int, program: str):
        self.system = system.require()  # the system it runs as
        checks = floating_point.system_checks()
        self._checked = bool(checks)
        self._synthetic = queues.synthetic_data()

        def execution(state, data):  # (state, data) -> (state, outputs), as an execution's
            outputs, state = fn(state, data)
            return state, outputs

        execution = floating_point.checked(execution, checks) if checks else execution
        # Keeping the state, or consuming its buffers.
        self._jitted = {False: jax.jit(execution), True: jax.jit(execution, donate_argnums=0)}
        self._ipu, self._program = ipu, program
        self._executables: dict = {}

    def __call__(self, state: Any, data: Any, donate: bool = False) -> tuple[Any, Any]:
        """Runs the step (see the class docstring).

        Args:
            state: The state it takes.
            data: The batch.
            donate: Whether the run may consume the state's buffers (not
                while traps are on: a run that raises must leave the state).

        Returns:
            `(outputs, new state)`.

        Raises:
            IPUOutOfMemoryError: When the program does not fit the IPU.
            IPUNotAttachedError: With `NEVER`, once compiled and checked.
            IPUFloatingPointError: When an operation raised an exception the
                system traps.
        """
        if self._synthetic:  # no host data reaches the device
            data = zeros_like(data)
        compiled = self._compiled(state, data, donate and not self._checked)
        state_out, outputs = run_checked(compiled, self._program, state, data,
                                         unrun=lambda zeros: (state, zeros[1]))
        if self._checked:
            outputs, error = outputs
            floating_point.raise_first(error, self._program)
        if self._synthetic:  # nothing comes back to the host
            outputs = zeros_like(outputs)
        return outputs, state_out

    def _compiled(self, state: Any, data: Any, donate: bool) -> Any:
        leaves, structure = jax.tree_util.tree_flatten((state, data))
        signature = (donate, structure, tuple(
            (np.shape(leaf), getattr(leaf, "dtype", type(leaf)), getattr(leaf, "sharding", None))
            for leaf in leaves))
        compiled = self._executables.get(signature)
        if compiled is None:
            traced = self._jitted[donate].trace(state, data)
            compiled = traced.lower().compile()
            memory = accounting.memory_use(
                compiled, state_bytes=accounting.tree_bytes(state),
                io_bytes=accounting.tree_bytes((data, compiled.out_info[1])))
            memory = precision.held_in_16_bits(memory, traced.jaxpr, _platform(compiled))
            check_fits([(self._ipu, memory)], self._program)
            self._executables[signature] = compiled
        return compiled


def _platform(compiled: Any) -> str:
    """The JAX platform a compiled program runs on."""
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    return next(iter(shardings[0].device_set)).platform if shardings else jax.default_backend()
