"""An epoch's infeed: how its executions' batches reach the program's devices.

Host batches are regrouped into the program's layout and copied to the
devices, on the infeed thread where that overlaps the device's work (an
accelerator); arrays a one-replica accelerator program can hold stay there
for the whole run (`resident.py`); `--use_synthetic_data` moves nothing.

A warm `fit` spends a few milliseconds on the host before its first execution
(the program's lookup, the callbacks, the metrics' reset, the state) while the
device waits. `open_ahead` places the first epoch's first execution before
that setup, in the caller's thread (no thread to start, no GIL hand-over on
the way to the first dispatch), for feeds whose batches cannot depend on it;
the infeed's thread takes over from the second execution
(benchmarks/profile_fit_setup.py). This is for a threaded infeed (host data
bound for an accelerator): on CPU devices items are made as they are asked
for, and resident data is only copied to the device ahead.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from keras_ipu.device import system as ipu_system
from keras_ipu.device.infeed import Infeed
from keras_ipu.keras import data, feed_options, resident, thread_state
from keras_ipu.keras.options import options_of
from keras_ipu.keras.replication import ReplicaCodec
from keras_ipu.keras.run import Run


def open_infeed(model: Any, run: Run, feed: Any, ahead: bool = False) -> Infeed:
    """Starts the infeed of one epoch of `feed` for `run`.

    Args:
        model: The Keras model (its infeed options give the prefetch depth).
        run: The run whose program takes the batches.
        feed: The run's data feed.
        ahead: Whether it opens ahead of the run's setup: the first
            execution's data is then placed here, now, when the infeed is
            threaded (an accelerator's host data; otherwise items are made as
            they are asked for anyway), and the thread starts once the run
            asks for the second (no thread start or GIL hand-over
            before the first execution's dispatch).

    Returns:
        An `Infeed` of `(begin, end, placed batches)`; close it (or use it as
        a context manager) when done.

    Example:

    >>> with open_infeed(model, run, feed) as infeed:
    ...     for begin, end, batches in infeed:
    ...         state, outfeed = run.program(state, batches)
    """
    codec, layout = run.codec, run.layout
    if ipu_system.require().option("use_synthetic_data"):
        place = _synthetic_placer(codec, layout)
    elif _keep_data_on_device(feed, run):
        place = _already_placed
    else:
        place = _placer(codec, layout)
    depth = feed_options.prefetch_depth(options_of(model).infeed_kwargs)
    # Host data bound for an accelerator is copied on the infeed thread, so
    # the copy of the next execution overlaps the device's work on this one.
    threaded = feed.prefetch_in_thread or (
        place is not _already_placed and run.program.device.platform != "cpu")
    # The thread reads no more batches once the infeed closes (a Ctrl-C, say).
    stop = threading.Event()
    # On a thread, a generator's or `PyDataset`'s code sees the caller's Keras state.
    executions = thread_state.read_as_caller(feed.executions(stop.is_set))
    return Infeed(executions, place=place, depth=depth, threaded=threaded,
                  first_inline=ahead, stop=stop)


def open_ahead(model: Any, run: Run, feed: Any) -> Infeed | None:
    """The first epoch's infeed, opened before the run's setup, or `None`.

    Only for arrays in a fixed order: a shuffled pass draws its order from
    NumPy's global generator when the epoch begins, after the callbacks (which
    may draw from it too), and other feeds run user code (a generator, a
    `PyDataset`) that must not run before `on_train_begin`.

    Args:
        model: The Keras model.
        run: The run whose program takes the batches.
        feed: The run's data feed.

    Returns:
        The open `Infeed` (the caller hands it to the first epoch and closes it
        if that never runs), or `None` when the epoch opens its own.

    Example:

    >>> ahead = open_ahead(model, run, feed)   # before the callbacks and the reset
    """
    if not isinstance(feed, data.ArrayFeed) or feed.shuffles:
        return None
    return open_infeed(model, run, feed, ahead=True)


def _placer(codec, layout):
    """Regroups an execution's batches and copies them to the devices (infeed)."""

    # An instance with one replica of several gets batches without a replica axis.
    lone = getattr(codec, "lone_replica", False)

    def place(execution):
        begin, end, batches = execution
        if lone:
            batches = jax.tree_util.tree_map(lambda a: np.expand_dims(a, 1), batches)
        return begin, end, codec.place(layout.to_program(batches))

    return place


def _keep_data_on_device(feed: Any, run: Run) -> bool:
    """Keeps array data on a one-replica program's accelerator for the run, when it fits.

    See `resident.py`. Pipelines and replicated programs place their batches
    across several devices and keep the threaded host infeed.
    """
    if not isinstance(feed, data.ArrayFeed) or not isinstance(run.codec, ReplicaCodec):
        return False
    if run.replica_count != 1:
        return False
    device = run.program.device
    if not feed.resident and not resident.fits_on(
            device, feed.data_bytes, feed.execution_bytes):
        return False
    feed.keep_on_device(device, run.layout.to_program)
    return True


def _already_placed(execution):
    """Device-resident executions come program-shaped and on the device."""
    return execution


def _synthetic_placer(codec, layout):
    """`--use_synthetic_data`: no host data moves; the devices get zeros."""
    zeros: dict = {}

    def place(execution):
        begin, end, batches = execution
        batches = layout.to_program(batches)
        key = jax.tree_util.tree_structure(batches), tuple(
            (a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(batches)
        )
        if key not in zeros:
            zeros[key] = codec.place(
                jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), batches)
            )
        return begin, end, zeros[key]

    return place
