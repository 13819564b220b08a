"""Data handling for IPU executions: validation, batching, per-execution chunks.

The rules follow IPU Keras: no partial batches; `steps_per_execution` is
truncated to the steps of an epoch (with a warning) and must divide them;
the size of the data must be known or `steps` given; everything is checked
when the feed is made, before any weight changes. A feed then yields, per
execution, the host data of `steps_per_execution` batches stacked on a new
leading axis.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from keras import config as keras_config
from keras.src.trainers import data_adapters

from keras_ipu.device import integers
from keras_ipu.keras import host_data, sample_weights
from keras_ipu.keras.resident import ResidentPasses

logger = logging.getLogger("keras_ipu")

DEFAULT_BATCH_SIZE = 32

# One execution's host data: (first step, last step, stacked batches).
Execution = tuple[int, int, Any]

class Role(NamedTuple):
    """What a run's errors call its steps argument and its data (as object and subject)."""

    steps_argument: str
    data: str
    subject: str
    batch_argument: str = "batch_size"


_DATASET = ("the dataset provided", "The provided set of data")
ROLES = {
    "fit": Role("steps_per_epoch", *_DATASET),
    # Validation data is batched by `validation_batch_size` (else `batch_size`).
    "validation": Role("validation_steps", "the validation data provided",
                       "The provided validation data", "validation_batch_size"),
    "evaluate": Role("steps", *_DATASET),
    "predict": Role("steps", *_DATASET),
}


@dataclasses.dataclass(frozen=True)
class FeedPlan:
    """What the checks decided for a run.

    Args:
        steps: Batches per epoch and replica.
        steps_per_execution: Batches per execution and replica (after
            truncation).
        num_batches: Batches in the data, or `None` when unknown.
        replicas: The replication factor; an execution takes
            `steps_per_execution × replicas` batches from the data.
    """

    steps: int
    steps_per_execution: int
    num_batches: int | None
    replicas: int = 1

    @property
    def batches_per_execution(self) -> int:
        """Batches of the data one execution consumes (all replicas)."""
        return self.steps_per_execution * self.replicas


def make_feed(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    shuffle: bool | str = False,
    class_weight: dict | None = None,
    steps_per_execution: int = 1,
    epochs: int = 1,
    replicas: int = 1,
    role: str = "fit",
) -> ArrayFeed | AdapterFeed:
    """Checks the data of a run and returns the feed that batches it.

    Args:
        x, y, sample_weight: The data, as `keras.Model.fit` takes it.
        batch_size: Batch size for array data; by default, as in Keras, the
            size that makes `steps` batches of the data, or 32 without `steps`.
        steps: Batches per epoch, for all replicas together
            (`steps_per_epoch` / `steps`), or `None` for the size of the data.
        shuffle: Shuffle array data each pass (`True` or `"batch"`).
        class_weight: Class weights, turned into sample weights.
        steps_per_execution: The model's steps per execution.
        epochs: Epochs the run consumes (for the enough-data check).
        replicas: The replication factor: batch `i` goes to replica `i % R`.
        role: What the data is for, a key of `ROLES` (named by the errors).

    Returns:
        An `ArrayFeed` for arrays, an `AdapterFeed` for anything else Keras
        takes (PyDataset, generators, tf.data, ...).

    Raises:
        ValueError: For a partial batch, unknown size without `steps`, too
            little data, or a `steps_per_execution` that does not divide
            the steps.
    """
    steps_per_execution = positive_int("steps_per_execution", steps_per_execution)
    if steps is not None and steps != -1:
        steps = positive_int(ROLES[role].steps_argument, steps)
    steps = _capped_steps(steps)
    if class_weight is not None and sample_weight is not None:
        raise ValueError(
            "`sample_weight` and `class_weight` cannot both be given. "
            f"Received: class_weight={class_weight}."
        )
    plan_before_reading(x, steps, steps_per_execution, epochs, replicas, role)
    arrays = host_data.as_arrays((x, y, sample_weight))
    if arrays is not None:
        host_data.check_numeric(arrays, role)
        return ArrayFeed(
            arrays,
            batch_size=batch_size,
            steps=steps,
            shuffle=shuffle,
            class_weight=class_weight,
            steps_per_execution=steps_per_execution,
            epochs=epochs,
            replicas=replicas,
            role=role,
        )
    # Array-likes Keras slices (sparse matrices, data frames, objects with `__array__`)
    # take the batch size, as in plain Keras; other data brings its own batches.
    sliced = data_adapters.array_data_adapter.can_convert_arrays((x, y, sample_weight))
    if batch_size is not None and not sliced and not isinstance(
            x, data_adapters.data_adapter.DataAdapter):
        logger.info("`batch_size` is ignored for %s input.", type(x).__name__)
    adapter = data_adapters.get_data_adapter(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        steps_per_epoch=None if steps == -1 else steps,
        shuffle=shuffle,
        class_weight=class_weight,
    )
    return AdapterFeed(
        adapter,
        steps=steps,
        steps_per_execution=steps_per_execution,
        epochs=epochs,
        replicas=replicas,
        role=role,
    )


def plan_before_reading(x: Any, steps: int | None, steps_per_execution: int, epochs: int,
                        replicas: int = 1, role: str = "fit") -> FeedPlan | None:
    """The plan of a Python generator given `steps`, made before any batch is read.

    Keras' adapter takes a generator's first batches as it is made: a run
    refused after that would have lost them. Checks that need only the plan
    run on this one first.

    Returns:
        The plan, or `None` for other data (read only when fed, or sliced).

    Raises:
        ValueError: As `make_feed`.
    """
    if not isinstance(x, types.GeneratorType) or steps is None or steps == -1:
        return None
    # Quiet: the feed's own plan warns. (Not `warnings.catch_warnings`, which resets
    # the record of warnings shown: each would show again at every call.)
    steps = _capped_steps(positive_int(ROLES[role].steps_argument, steps), warn=False)
    steps_per_execution = positive_int("steps_per_execution", steps_per_execution)
    return plan_steps(None, steps, steps_per_execution, epochs, replicas, role, warn=False)


def _dividing(num_batches: int, steps: int, replicas: int, steps_per_execution: int) -> str:
    """The remedy's choice of steps: dividing the data, whole executions of every replica."""
    unit = replicas * steps_per_execution
    if unit == 1:
        return f"dividing {num_batches}"
    choices = [n for n in range(unit, num_batches + 1, unit) if num_batches % n == 0]
    lower = ", or a smaller `steps_per_execution`" if steps_per_execution > 1 else ""
    named = " or ".join(map(str, choices)) or f"none: give a multiple of {unit} batches{lower}"
    reasons = ([f"{replicas} replicas"] if replicas > 1 else []) + (
        [f"`steps_per_execution` {steps_per_execution}"] if steps_per_execution > 1 else [])
    ran = (f"; {steps} runs {steps - steps % replicas} batches an epoch on {replicas} "
           f"replicas" if steps % replicas else "")
    return (f"a multiple of {unit} ({' x '.join(reasons)}) that divides {num_batches} "
            f"({named}{ran})")


def plan_steps(num_batches: int | None, steps: int | None, steps_per_execution: int,
               epochs: int, replicas: int = 1, role: str = "fit", warn: bool = True) -> FeedPlan:
    """Applies the step rules to the size of the data (`warn`: its warnings too).

    Raises:
        ValueError: As `make_feed`.
    """
    continues = steps is not None and steps != -1  # epochs continue through the data
    steps_argument, provided = ROLES[role].steps_argument, ROLES[role].data
    if not continues:
        if num_batches is None:
            # Named for the data of this role: validation data of unknown size
            # needs `validation_steps`, even when `steps_per_epoch` is given.
            call = "fit" if role == "validation" else role
            raise ValueError(
                f"Could not infer the size of {provided}. You must specify the "
                f"number of steps to run (`{steps_argument}` in `{call}`)."
            )
        steps = num_batches
    per_replica, dropped = divmod(steps, replicas)
    if per_replica == 0 and continues and (num_batches is None or num_batches >= replicas):
        # The data has enough: the steps argument is the one to change.
        raise ValueError(
            f"`{steps_argument}` ({steps}) counts the batches of all {replicas} replicas "
            f"together: each replica needs one at least. Set it to {replicas} or more.")
    if per_replica == 0:
        # The reference's words; validation's data named as such (it is not `x`).
        data = "validation data" if role == "validation" else "dataset"
        raise ValueError(
            f"The provided {data} contains {steps} items, but all {replicas} replicas "
            f"are requested to run 1 steps each. Make sure the {data} contains at "
            f"least {replicas} items (batches of `{ROLES[role].batch_argument}`)."
        )
    if dropped and warn:
        # `steps` is the steps argument when epochs continue, else the data's length.
        counted = f"`{steps_argument}` ({steps})" if continues else f"Dataset of length {steps}"
        warnings.warn(
            f"{counted} is being evenly distributed between {replicas} "
            f"replicas. The remaining {dropped} batch{'es' if dropped > 1 else ''} "
            f"will be dropped.",
            stacklevel=3,
        )
    consumed = per_replica * replicas
    # When epochs continue through the data, an epoch that begins inside a
    # pass must end inside it: the device cannot run the part-execution a
    # shortfall would leave. (Without `steps`, each epoch is a new pass.)
    if (continues and num_batches is not None and consumed * epochs > num_batches
            and (consumed > num_batches or num_batches % consumed)):
        raise ValueError(
            f"Your input does not have enough data. Make sure that your dataset "
            f"or generator can generate at least {consumed * epochs} batches "
            f"(currently it can only generate {num_batches} batches), or choose "
            f"`{steps_argument}` {_dividing(num_batches, steps, replicas, steps_per_execution)}."
        )
    to_this_replica = " to this replica" if replicas > 1 else ""
    if steps_per_execution > per_replica:
        if warn:
            warnings.warn(
                f"`steps_per_execution` has been set to {steps_per_execution} but "
                f"{provided}{to_this_replica} only contains {per_replica} batches. "
                f"Using {per_replica} as `steps_per_execution`.",
                stacklevel=3,
            )
        steps_per_execution = per_replica
    if per_replica % steps_per_execution:
        divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
        raise ValueError(
            f"`steps_per_execution` ({steps_per_execution}) must be a divisor of the "
            f"number of batches ({per_replica}) in {provided}{to_this_replica}. "
            f"Divisors of {per_replica}: {_short_list(divisors)}."
        )
    return FeedPlan(per_replica, steps_per_execution, num_batches, replicas)


class ArrayFeed:
    """Batches NumPy/JAX arrays (nested structures too) per execution.

    One execution takes `steps_per_execution × batch_size` rows at once: a
    slice of the arrays (or of a shuffled index) reshaped to
    `[steps_per_execution, batch_size, ...]`.
    """

    # A slice costs less than handing it over between threads (BENCHMARKS.md).
    prefetch_in_thread = False

    def __init__(
        self,
        arrays: Any,
        *,
        batch_size: int | None,
        steps: int | None,
        shuffle: bool | str,
        class_weight: dict | None,
        steps_per_execution: int,
        epochs: int,
        replicas: int,
        role: str = "fit",
    ):
        data = sample_weights.packed_data(*arrays, class_weight)
        self._data = jax.tree_util.tree_map(host_data.host_array, data)
        rows = host_data.common_length(self._data)
        if batch_size is None:
            batch_size = -(-rows // steps) if steps and steps > 0 else DEFAULT_BATCH_SIZE
        batch_size = positive_int(ROLES[role].batch_argument, batch_size)
        if rows % batch_size:
            raise ValueError(
                f"{ROLES[role].subject} has a partial batch, which could result "
                f"in data being dropped. Either adjust the `{ROLES[role].batch_argument}` "
                f"of your model (currently set to {batch_size}) or pad your dataset to "
                f"ensure there are no partial batches ({rows} samples is not a "
                f"multiple of {batch_size})."
            )
        self.batch_size = batch_size
        self.plan = plan_steps(rows // batch_size, steps, steps_per_execution, epochs, replicas,
                               role)
        self._shuffle = shuffle
        self._order: np.ndarray | None = None
        self._offset = self.plan.num_batches  # start a new pass first
        self._resident: ResidentPasses | None = None

    @property
    def data_bytes(self) -> int:
        """Bytes of the run's arrays."""
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self._data))

    @property
    def execution_bytes(self) -> int:
        """Bytes of one execution's batches."""
        rows = self.plan.batches_per_execution * self.batch_size
        return self.data_bytes * rows // host_data.common_length(self._data)

    def keep_on_device(self, device: jax.Device, regroup: Callable[[Any], Any]) -> None:
        """From now on, keeps the arrays on `device` and cuts executions there.

        Each execution is then given as device arrays already regrouped by
        `regroup` (the program layout's `to_program`), the same batches in
        the same order as the host feed's. Called again for the same device,
        it changes nothing.

        Args:
            device: The program's (only) device.
            regroup: Regroups one execution's batches for the program.
        """
        if self._resident is not None and self._resident.device == device:
            return
        plan = self.plan
        self._resident = ResidentPasses(
            self._data, device, _execution_shape(plan), self.batch_size,
            plan.num_batches // plan.batches_per_execution, regroup)
        if self._offset < plan.num_batches:  # a pass is under way: cut it too
            self._resident.new_pass(self._order)

    @property
    def resident(self) -> bool:
        """Whether the executions come from device-resident data (`keep_on_device`)."""
        return self._resident is not None

    @property
    def shuffles(self) -> bool:
        """Whether each pass draws an order (`shuffle=True` or `"batch"`)."""
        return bool(self._shuffle)

    def first_batch(self) -> Any:
        """One batch (host arrays), for building the model."""
        return jax.tree_util.tree_map(lambda a: a[: self.batch_size], self._data)

    def executions(self, stopped: Callable[[], bool] = lambda: False) -> Iterator[Execution]:
        """One epoch's executions: `[steps, (replicas,) batch, ...]` each (`stopped`: as
        `AdapterFeed.executions`; slicing arrays, it is not asked)."""
        plan, batch = self.plan, self.batch_size
        shape = _execution_shape(plan)
        for begin in range(0, plan.steps, plan.steps_per_execution):
            if self._offset + plan.batches_per_execution > plan.num_batches:
                self._new_pass()
            if self._resident is not None:
                chunk = self._resident.execution(self._offset // plan.batches_per_execution)
            else:
                rows = self._rows(self._offset * batch, plan.batches_per_execution * batch)
                chunk = jax.tree_util.tree_map(
                    lambda a, rows=rows: a[rows].reshape(*shape, batch, *a.shape[1:]),
                    self._data,
                )
            self._offset += plan.batches_per_execution
            yield begin, begin + plan.steps_per_execution - 1, chunk

    def _new_pass(self) -> None:
        # Drawn from NumPy's global generator, which `keras.utils.set_random_seed`
        # seeds, in the order plain Keras' array adapter draws: one permutation
        # of the rows per pass, or (`"batch"`) one of each batch's rows.
        self._offset = 0
        num_batches, size = self.plan.num_batches, self.batch_size
        if self._shuffle == "batch":
            self._order = np.concatenate(
                [np.random.permutation(size) + b * size for b in range(num_batches)])
        elif self._shuffle:
            rows = host_data.common_length(self._data)
            self._order = np.random.permutation(rows)[: num_batches * size]
        if self._resident is not None:
            self._resident.new_pass(self._order)

    def draw_build_pass(self) -> None:
        """Draws (and drops) what a pass of Keras' array adapter draws for its first batch.

        Keras' `fit` takes the batch that builds a model from a pass of its
        own (on the CPU, without look-ahead): one permutation of the rows,
        or (`"batch"`) of the first batch's rows.
        """
        if self._shuffle == "batch":
            np.random.permutation(self.batch_size)
        elif self._shuffle:
            np.random.permutation(host_data.common_length(self._data))

    def rewind(self) -> None:
        """Starts the next execution at the beginning of a new pass over the data."""
        self._offset = self.plan.num_batches

    reset = rewind  # arrays have no epoch hooks: Keras' reset only starts a new pass

    def _rows(self, start: int, count: int) -> slice | np.ndarray:
        if self._order is None:
            return slice(start, start + count)
        return self._order[start : start + count]

    def end_pass(self) -> None:
        """Nothing to end for arrays (no epoch hooks)."""

    def close(self) -> None:
        """Nothing to release for arrays."""


class AdapterFeed:
    """Batches any input a Keras data adapter takes, per execution.

    Batches are pulled from the adapter's NumPy iterator; every batch must
    have the shapes of the first (no partial batches).
    """

    # Python data pipelines (generators, PyDataset) overlap with the device.
    prefetch_in_thread = True

    def __init__(
        self,
        adapter: Any,
        *,
        steps: int | None,
        steps_per_execution: int,
        epochs: int,
        replicas: int,
        role: str = "fit",
    ):
        self._adapter = adapter
        if _has_partial_batch(adapter):
            raise ValueError(
                f"{ROLES[role].subject} has a partial batch of "
                f"{adapter.partial_batch_size} samples, which could result in "
                f"data being dropped. Pad your dataset, or drop the remainder when "
                f"batching, to ensure there are no partial batches."
            )
        self.plan = plan_steps(adapter.num_batches, steps, steps_per_execution, epochs, replicas,
                               role)
        self._role, self._epochs = role, epochs
        self._iterator: Iterator | None = None
        self._pending: list[Any] = []
        self._seen = 0
        self._shapes: Any = None
        self._first: Any = None
        self._started = False
        self._in_pass = False  # between the adapter's `on_epoch_begin` and `on_epoch_end`
        self.ran_out_of_data = False
        self._executions = 0  # taken from the source in this run

    @property
    def batch_size(self) -> int:
        """Batch size (from the first batch)."""
        return jax.tree_util.tree_leaves(self.first_batch())[0].shape[0]

    def first_batch(self) -> Any:
        """The first batch seen (pulled now, and kept for the first execution, if none was).

        It is pulled inside a pass (after the adapter's `on_epoch_begin`), as
        Keras reads every batch: a `PyDataset` may prepare its batches there.
        """
        if self._first is None:
            dataset = getattr(self._adapter, "py_dataset", None)
            if self._role == "validation" and dataset is not None:
                # Read where Keras reads none, before training: by index, in a pass of
                # the dataset's own (the adapter's would start its workers, whose queue
                # of batches the reset before the first validation throws away).
                if not self._in_pass:
                    with host_data.random_state_kept():  # its draws come before training
                        dataset.on_epoch_begin()
                    self._in_pass = True
                self._first = host_data.read_by_index(dataset, 0)
                self._check_shapes(self._first)
            else:
                self._begin_pass()
                # A copy: kept while the source goes on, which may refill what it yielded.
                self._first = jax.tree_util.tree_map(np.copy, self._next_batch())
                self._pending.append(self._first)
            self._check_last_batch(self._last_batch())
        return self._first

    def _last_batch(self) -> Any:
        """A `PyDataset`'s last batch when the run may read it (shuffled, or the epochs reach
        it), else `None`: it can be read out of order, so it is looked at once, before
        any execution (a generator's partial batch is refused as it comes)."""
        dataset, plan = getattr(self._adapter, "py_dataset", None), self.plan
        reads = plan.steps * plan.replicas * self._epochs
        if dataset is None or not plan.num_batches or not (
                getattr(self._adapter, "shuffle", False) or reads >= plan.num_batches):
            return None
        # Workers draw from the dataset's own generators meanwhile: those stay as they are.
        return host_data.read_by_index(dataset, plan.num_batches - 1, own_generators=not getattr(
            self._adapter, "enqueuer", None))

    def _check_last_batch(self, last: Any) -> None:
        """Refuses a `PyDataset` whose last batch is partial before any execution runs."""
        if last is None:
            return
        count, size = self.plan.num_batches, host_data.batch_size_of(self._first)
        last_size = host_data.batch_size_of(last)
        if last_size is not None and last_size != size:
            raise ValueError(
                f"{ROLES[self._role].subject} has a partial batch: its last batch (index "
                f"{count - 1}) has {last_size} samples, its first {size}. Executing on IPU "
                f"requires all batches to have the same fully defined shapes: drop or pad "
                f"the remainder in the PyDataset's `__getitem__`."
            )

    def executions(self, stopped: Callable[[], bool] = lambda: False) -> Iterator[Execution]:
        """One epoch's executions; stops early, with a warning, if data runs out.

        Args:
            stopped: Asked before each batch is read: once it is true (the
                run was interrupted), no more batch is read from the source.
        """
        plan = self.plan
        shape = _execution_shape(plan)
        self._started = True
        self._begin_pass()
        for begin in range(0, plan.steps, plan.steps_per_execution):
            try:
                batches = host_data.Stacked(plan.batches_per_execution)
                for _ in range(plan.batches_per_execution):
                    if stopped():
                        return
                    batches.add(self._next_batch())
            except StopIteration:
                self._iterator = None
                self.ran_out_of_data = True
                host_data.ran_out(ROLES[self._role], plan, batches.added, self._executions)
                return
            stacked = jax.tree_util.tree_map(
                lambda a: a.reshape(*shape, *a.shape[1:]), batches.result
            )
            self._executions += 1
            yield begin, begin + plan.steps_per_execution - 1, stacked
        if plan.num_batches is not None and self._seen + plan.steps * plan.replicas > (
            plan.num_batches
        ):
            self._iterator = None
            self._seen = 0

    def end_pass(self) -> None:
        """Ends the pass once its executions were all taken (or its data ran out).

        Called by whoever takes the executions, not by `executions` itself: a
        thread that prepares them ahead reaches the end first. As Keras' epoch
        iterator, when asked for more: a `PyDataset`'s `on_epoch_end` runs.
        """
        self._end_pass()

    def draw_build_pass(self) -> None:
        """Takes the first batch from a pass of its own, as Keras' `fit` does; `reset` ends it.

        Keras builds a model from a new iterator's first batch and resets
        before the first epoch, which starts another: a shuffled
        `PyDataset` draws its order twice.
        """
        self.first_batch()

    def reset(self) -> None:
        """Ends the pass under way, or none, as Keras' `fit` resets its epoch iterator.

        Keras' `fit` resets after building the model, whether the build took
        a pass or not: the adapter's `on_epoch_end` runs once (a `PyDataset`
        that reshuffles itself there does so before the first epoch), and
        the first epoch reads from a new iterator (a generator's replays the
        batches Keras peeked at).
        """
        self._iterator, self._pending, self._seen = None, [], 0
        self._started = False
        self._in_pass = False
        self._adapter.on_epoch_end()

    def rewind(self) -> None:
        """Starts the next execution with a new iterator from the adapter.

        As Keras' epoch iterator after `reset()`: a `PyDataset` starts again
        at its first batch, a generator replays the batches Keras peeked at
        and goes on. Before the first execution, nothing changes (the batch
        taken for building the model is kept for it).
        """
        if self._started:
            self._iterator, self._pending, self._seen = None, [], 0
            self._started = False

    def _next_batch(self) -> Any:
        if self._pending:
            return self._pending.pop(0)
        if self._iterator is None:
            self._iterator = iter(self._adapter.get_numpy_iterator())
        batch = host_data.as_tuple(next(self._iterator))
        batch = host_data.batch_arrays(batch)
        self._seen += 1
        self._check_shapes(batch)
        return batch

    def _check_shapes(self, batch: Any) -> None:
        shapes = jax.tree_util.tree_map(np.shape, batch)
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError(host_data.batch_change(ROLES[self._role].subject, shapes,
                                                    self._shapes))

    def close(self) -> None:
        """Releases the workers of a pass left under way, without the adapter's `on_epoch_end`.

        A pass is left under way by an error, an interrupt, or `stop_training`
        inside an epoch: Keras' epoch iterator never reaches its `on_epoch_end`
        then, and a `PyDataset` that reshuffles there must not, for an epoch
        that did not end (`BackupAndRestore` resumes in Keras' order).
        """
        if self._in_pass:
            self._in_pass = False
            # Keras' PyDataset adapter runs its workers' enqueuer (tests/test_keras_contracts.py).
            enqueuer = getattr(self._adapter, "enqueuer", None)
            if enqueuer is not None:
                enqueuer.stop()

    def _begin_pass(self) -> None:
        if not self._in_pass:
            self._adapter.on_epoch_begin()
            self._in_pass = True

    def _end_pass(self) -> None:
        # Once per pass: a `PyDataset`'s `on_epoch_end` (often a reshuffle) runs
        # as often as in Keras, and not again when the run ends.
        if self._in_pass:
            self._in_pass = False
            self._adapter.on_epoch_end()


def _execution_shape(plan: FeedPlan) -> tuple[int, ...]:
    """The leading axes of an execution's data: steps, then replicas if several."""
    if plan.replicas == 1:
        return (plan.steps_per_execution,)
    return (plan.steps_per_execution, plan.replicas)


def _has_partial_batch(adapter: Any) -> bool:
    try:
        return bool(adapter.has_partial_batch)
    except NotImplementedError:  # unknown until the data is seen
        return False


def _capped_steps(steps: int | None, warn: bool = True) -> int | None:
    """`steps`, capped by `keras.config.set_max_steps_per_epoch` as Keras' epoch iterator."""
    max_steps = keras_config.max_steps_per_epoch()
    if max_steps and (not steps or max_steps < steps):
        if warn:
            warnings.warn(f"Limiting steps_per_epoch to {max_steps}", stacklevel=5)
        return max_steps
    return steps


def positive_int(name: str, value: Any) -> int:
    """`value` as a Python int, or a `ValueError` naming `name`.

    Integer scalars of any kind count: a 0-d NumPy or JAX integer array as
    well as an int (IPU TensorFlow code passes a data set's `cardinality()`).
    """
    number = integers.integer_of(value)
    if number is None or number < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return number


def _short_list(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")
