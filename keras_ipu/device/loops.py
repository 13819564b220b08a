"""How an execution strings its steps together: the loop forms, and the rule that picks one.

An execution runs `steps_per_execution` steps with the state on the device.
The steps can be strung together in two ways:

- `scan`: one compiled program loops over the steps on the device
  (`lax.scan`); nothing returns to the host between steps.
- `host`: one compiled step, dispatched once per step from the host without
  waiting for the previous one (the state stays on the device; the host only
  queues work, as plain Keras does).

Both give the same numbers. Which is faster depends on the program and the
platform: XLA's CPU backend rewrites the convolutions of a program's entry
computation into the layout its fast convolution kernels need, but not those
inside a loop body, where a convolution in any other layout (the weight and
input gradients autodiff emits) runs on a slow generic path (JAX issue 12868;
measured in BENCHMARKS.md). On CPUs keras_ipu traces programs with
`device.convolutions`, whose convolutions and gradients all keep the fast
layout, so the on-device loop stays fast; a step whose convolutions could not
be issued that way (forward-mode autodiff through one, code that calls XLA's
convolution by another route) is caught by the rule: the on-device loop,
unless the platform is a CPU and the step holds a convolution in another
layout. `--execution_loop=scan|host` in `KERAS_IPU_FLAGS` forces a form.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_ipu.device import conv_geometry, jaxprs

SCAN = "scan"
HOST = "host"
SCHEDULE = "schedule"  # pipelined programs: the schedule table is the loop
AUTO = "auto"
FORMS = (SCAN, HOST)
REQUESTS = (AUTO, *FORMS)


@dataclasses.dataclass(frozen=True)
class LoopChoice:
    """The loop form of an execution, and why it was chosen.

    Args:
        form: `"scan"`, `"host"` or `"schedule"` (pipelined programs).
        reason: Why, in words (shown in the execution report).

    Example:

    >>> choose_loop(jaxpr, platform="gpu").form
    'scan'
    """

    form: str
    reason: str


def check_request(request: str) -> str:
    """Validates a requested loop form.

    Args:
        request: `"auto"`, `"scan"` or `"host"`.

    Returns:
        The request.

    Raises:
        ValueError: For anything else, naming the valid forms.

    Example:

    >>> check_request("host")
    'host'
    """
    if request not in REQUESTS:
        raise ValueError(f"Unknown execution loop {request!r}; valid: {', '.join(REQUESTS)}.")
    return request


def choose_loop(jaxpr: Any, platform: str, request: str = AUTO) -> LoopChoice:
    """Picks the loop form for a step program.

    Args:
        jaxpr: The (closed) jaxpr of the program, loop included or not.
        platform: The JAX platform of its devices (`"cpu"`, `"gpu"`, ...).
        request: `"auto"` to decide by the rule, or a form to force.

    Returns:
        The `LoopChoice`.

    Raises:
        ValueError: For an unknown request.

    Example:

    >>> choose_loop(jax.make_jaxpr(step)(state, batch), platform="cpu").form
    'host'
    """
    if check_request(request) != AUTO:
        return LoopChoice(request, f"forced (--execution_loop={request})")
    if platform != "cpu":
        return LoopChoice(SCAN, f"on-device loop ({platform})")
    slow = slow_in_loops(jaxpr)
    if slow:
        return LoopChoice(
            HOST,
            f"{slow} convolution(s) of the step would leave XLA:CPU's fast path inside a "
            f"loop body",
        )
    kept = convolution_count(jaxpr)
    if kept:
        return LoopChoice(
            SCAN, f"on-device loop: its {kept} convolution(s) keep XLA:CPU's fast path in loops")
    return LoopChoice(SCAN, "on-device loop: nothing in the step is slow inside an XLA:CPU loop")


def choose_pipeline_loop(jaxprs: Any, platform: str, request: str = AUTO) -> LoopChoice:
    """Picks how a pipelined training execution walks its schedule table.

    `"schedule"`: one program runs the table on the device (each IPU picks
    its ops per block of ticks with `lax.switch`, so a stage's code appears
    once per block pattern that holds it). `"host"`: the host walks the
    table and dispatches each stage op, compiled once, to its IPU. Both give
    the same numbers. The device schedule has no per-op dispatch, which
    small stages need; but on CPUs compiling it for a convolutional model
    takes 2.4-2.8x plain Keras' first fit (BENCHMARKS.md), where per-op
    programs compile like one training step and their host dispatch costs
    nothing next to convolutions. So: the host form on CPUs when the stages
    hold convolutions, the device schedule otherwise; `--execution_loop=host`
    or `scan` forces one.

    Args:
        jaxprs: The forward ops of the stages (jaxprs or closed jaxprs).
        platform: The JAX platform of the IPUs' devices.
        request: `"auto"`, `"host"` or `"scan"` (the device schedule).

    Returns:
        The `LoopChoice` (`"host"` or `"schedule"`).

    Raises:
        ValueError: For an unknown request.

    Example:

    >>> choose_pipeline_loop([forward_0, forward_1], platform="cpu").form
    'host'
    """
    request = check_request(request)
    if request == HOST:
        return LoopChoice(HOST, "forced (--execution_loop=host): the host walks the schedule")
    if request == SCAN:
        return LoopChoice(SCHEDULE, "forced (--execution_loop=scan): the schedule runs on the "
                                    "device")
    if platform != "cpu":
        return LoopChoice(SCHEDULE, f"the schedule runs on the device ({platform})")
    if any(convolution_count(jaxpr) for jaxpr in jaxprs):
        return LoopChoice(
            HOST,
            "the host walks the schedule, one program per stage op: on CPUs the stages' "
            "convolutions compile much faster so than in one schedule program",
        )
    return LoopChoice(SCHEDULE, "the schedule runs on the device: no per-op dispatch")


def check_carried(state: Any, new_state: Any) -> None:
    """Checks that a step gives back its state as it took it, as a loop's carry must.

    A program of one step runs the step without a loop: this keeps its rule
    the rule of the programs of several steps.

    Args:
        state: The state the step took (arrays or shape structs).
        new_state: The state it returned.

    Raises:
        TypeError: When the structure, a shape or a dtype differs, naming it.

    Example:

    >>> check_carried([jnp.zeros(2)], [jnp.zeros(2, jnp.float16)])
    Traceback (most recent call last):
    TypeError: ...
    """
    before, after = (jax.tree_util.tree_flatten_with_path(s) for s in (state, new_state))
    if before[1] != after[1]:
        raise TypeError(f"The step returns its state in another structure than it takes it: "
                        f"{after[1]} for {before[1]}. It must return it as it takes it.")
    for (path, old), (_, new) in zip(before[0], after[0]):
        was, now = (f"{jnp.result_type(a).name}{list(jnp.shape(a))}" for a in (old, new))
        if was != now:
            raise TypeError(f"The step returns its state{jax.tree_util.keystr(path)} as {now}, "
                            f"and takes it as {was}: it must return its state with the types "
                            f"and shapes it takes.")


def slow_in_loops(jaxpr: Any) -> int:
    """Counts the convolutions that XLA:CPU runs slowly inside a loop body.

    Args:
        jaxpr: A jaxpr or closed jaxpr (sub-jaxprs are searched too).

    Returns:
        The number of convolutions not in the layout of XLA:CPU's fast path.

    Example:

    >>> slow_in_loops(jax.make_jaxpr(jax.grad(conv_loss))(kernel))
    2
    """
    return sum(1 for eqn in jaxprs.equations(jaxpr)
               if eqn.primitive.name == "conv_general_dilated" and not _canonical(eqn))


def convolution_count(jaxpr: Any) -> int:
    """Counts the convolutions of a jaxpr (sub-jaxprs included).

    Example:

    >>> convolution_count(jax.make_jaxpr(jax.grad(conv_loss))(kernel))
    3
    """
    return sum(1 for eqn in jaxprs.equations(jaxpr) if eqn.primitive.name == "conv_general_dilated")


def _canonical(eqn: Any) -> bool:
    """Whether a convolution is in the layout `conv_geometry` issues (XLA:CPU's fast path)."""
    numbers = eqn.params["dimension_numbers"]
    spatial = len(numbers.lhs_spec) - 2
    if not 1 <= spatial <= conv_geometry.MAX_SPATIAL_DIMS:
        return False
    canonical = conv_geometry.canonical_dimension_numbers(spatial)
    return (
        tuple(map(tuple, numbers)) == tuple(map(tuple, canonical))
        and eqn.params.get("batch_group_count", 1) == 1
        and np.dtype(eqn.invars[0].aval.dtype) in conv_geometry.CANONICAL_DTYPES
    )
