"""`ipu.ipu_compiler`: `compile(computation, inputs)` for the scope's IPU (`device.feeds`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_ipu.device import feeds
from keras_ipu.keras import assignments, replica_gradients


def compile(computation: Callable, inputs: Any = None) -> list:  # noqa: A001 - the seed's name
    """Compiles `computation(*inputs)` for the current IPU device and runs it, replicated.

    The compiled program is kept: another call of the same `computation`
    with inputs of the same shapes runs it again without tracing, its loops
    taking the infeeds' next elements. As on the IPU, the computation runs
    once per replica (the device's IPUs divided by the shards it uses), and
    a loop over an infeed takes iterations × replicas elements.

    Keras variables the computation assigns (BatchNormalization's moving
    statistics in training mode, a seed generator's state) take their new
    values once it has run, as the IPU program's update ops give them.

    Args:
        computation: A JAX-traceable function of `len(inputs)` arguments.
        inputs: A list of arguments (arrays or structures of them), or `None`.

    Returns:
        The outputs as a list: `[]` for `None`, `[value]` for a single value,
        the values of a tuple or list (replica 0's). Outfeeds enqueued inside
        get their values.

    Raises:
        RuntimeError: Outside an `ipu_scope`.
        ValueError: When an infeed has fewer elements than the loops need
            (none is taken), or the device's IPUs are not a multiple of the
            computation's shards.

    Example:

    >>> with ipu.scopes.ipu_scope("/device:IPU:0"):
    ...     [total] = ipu.ipu_compiler.compile(lambda x: x.sum(), inputs=[np.ones(4)])
    """
    # A Keras optimizer's apply inside sums the replicas' gradients, as in `strategy.run`
    # (installed there by the strategy, which a graph-style program need not make).
    replica_gradients.install()
    return assignments.call_assigning(lambda fn: feeds.compile(fn, inputs)[0], computation,
                                      outputs=feeds.output_list)


__all__ = ["compile"]
