"""Array data kept on an accelerator for a whole run, cut into executions there.

On a GPU every execution's batches would otherwise cross from host memory:
a copy the program waits for, and for small steps a fixed cost (tens of
microseconds per array) that dwarfs the step itself. When the arrays of a
run fit comfortably in the device's free memory, they are copied once; each
pass over the data (a new shuffle order, when shuffling) is then cut into
the executions' batches by one device program, and an execution only takes
the next of those ready-made device arrays. The batches are the same as the
host feed's, in the same order (the shuffle order is still drawn on the
host), so training is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# Platforms whose programs copy host data in before they run. On CPU devices
# the dispatch reads host arrays directly, which costs less than any of this.
RESIDENT_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})
# Executions whose data is larger than this keep the threaded host infeed:
# their copy is bandwidth-bound and overlaps the previous execution, while a
# run's one upfront copy of all the data could not overlap anything.
MAX_EXECUTION_BYTES = 4 << 20
# The share of the device's free memory the data may take: it is held twice
# (the arrays and one pass cut into executions), with a copy's room to spare.
FREE_MEMORY_SHARE = 0.25
COPIES_HELD = 3
# Executions one device call cuts. Each call's dispatch is shared by this many
# executions, but its compile grows with them (a kernel per output on
# XLA:CPU). Against iterating a device array (JAX's own unstacking, an eager
# slice and unstack per 100 rows, compiled per leaf shape), on 2 vCPUs
# (benchmarks/bench_resident_cut.py): a pass's first cut 1.0-1.1 s -> 0.2 s
# with its compiles, and 34 -> 24 us per execution at S = 1.
EXECUTIONS_PER_CUT = 8


def fits_on(device: jax.Device, data_bytes: int, execution_bytes: int) -> bool:
    """Whether a run's data should be kept on `device`.

    Args:
        device: The program's device.
        data_bytes: Bytes of the run's arrays (inputs, targets, weights).
        execution_bytes: Bytes of one execution's batches.

    Returns:
        `True` on an accelerator whose free memory holds the data's copies
        within `FREE_MEMORY_SHARE`, for executions of at most
        `MAX_EXECUTION_BYTES`; `False` on CPU devices or when the device
        does not report its memory.

    Example:

    >>> fits_on(jax.devices()[0], 10_000_000, 16_384)
    """
    if device.platform not in RESIDENT_PLATFORMS or execution_bytes > MAX_EXECUTION_BYTES:
        return False
    stats = _memory_stats(device)
    if not stats or "bytes_limit" not in stats:
        return False
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return COPIES_HELD * data_bytes <= FREE_MEMORY_SHARE * free


def _memory_stats(device: jax.Device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # some backends do not implement it
        return None


class ResidentPasses:
    """A run's arrays on one device, one pass at a time cut into executions.

    Args:
        data: The run's host arrays (a pytree; rows on the leading axis).
        device: Where they stay.
        execution_shape: The leading axes of an execution's batches before
            the batch axis (`(steps,)` or `(steps, replicas)`).
        batch_size: Rows per batch.
        executions_per_pass: Whole executions a pass over the data makes.
        regroup: The program layout's regrouping of one execution's batches
            (`Layout.to_program`), applied to every execution of a pass at
            once.

    Example:

    >>> passes = ResidentPasses(data, device, (8,), 32, 10, layout.to_program)
    >>> passes.new_pass(order=None)
    >>> batches = passes.execution(0)  # device arrays, program-shaped
    """

    def __init__(self, data: Any, device: jax.Device, execution_shape: tuple[int, ...],
                 batch_size: int, executions_per_pass: int, regroup: Callable[[Any], Any]):
        self.device = device
        self._data = jax.device_put(data, device)
        self._executions_per_pass = executions_per_pass
        self._rows_per_execution = int(np.prod(execution_shape)) * batch_size
        self._per_cut = min(EXECUTIONS_PER_CUT, executions_per_pass)
        # One compiled cut per data shape and layout for the process, not per run.
        self._cut = functools.partial(
            _cut, shape=(self._per_cut, *execution_shape, batch_size), regroup=regroup)
        self._executions: list[Any] = []

    def new_pass(self, order: np.ndarray | None) -> None:
        """Cuts a pass: the rows in `order` (a host index), or in their stored order."""
        self._executions = []  # the last pass's buffers go before the next is made
        if order is not None:
            rows = self._executions_per_pass * self._rows_per_execution
            order = jax.device_put(np.asarray(order[:rows], np.int32), self.device)
        executions, per_cut = [], self._per_cut
        for first in range(0, self._executions_per_pass, per_cut):
            # The last cut ends at the pass's end, overlapping the one before
            # it: every cut keeps one shape, so one compiled program.
            start = min(first, self._executions_per_pass - per_cut)
            cut = self._cut(self._data, order, start * self._rows_per_execution)
            executions.extend(cut[first - start:])
        self._executions = executions

    def execution(self, index: int) -> Any:
        """The batches of the pass's execution `index` (device arrays)."""
        return self._executions[index]


@functools.partial(jax.jit, static_argnames=("shape", "regroup"))
def _cut(data: Any, order: jax.Array | None, first_row: jax.Array, *,
         shape: tuple[int, ...], regroup: Callable[[Any], Any]) -> list[Any]:
    """`shape[0]` executions' batches, one pytree each: rows from `first_row` on, of `order`
    when it is given."""
    rows = int(np.prod(shape))

    def take(a):
        if order is None:
            a = jax.lax.dynamic_slice_in_dim(a, first_row, rows)
        else:
            a = a[jax.lax.dynamic_slice_in_dim(order, first_row, rows)]
        return a.reshape(*shape, *a.shape[1:])

    stacked = jax.vmap(regroup)(jax.tree_util.tree_map(take, data))
    return [jax.tree_util.tree_map(lambda a, k=k: a[k], stacked) for k in range(shape[0])]
