"""Asynchronous callbacks: every step's results, to the batch callbacks, while the device runs.

With `set_asynchronous_callbacks(True)` a run's program streams its steps'
outputs out of its on-device loop in chunks (`device/outfeed.py`), and a host
thread of the run (`CallbackThread`) calls the batch hooks for each batch, in
order, while the device runs the later steps: `on_*_batch_begin(i)` then
`on_*_batch_end(i, logs)`, once per replica (as the reference's polling thread
does), with the logs reduced over the replicas as `set_replication_options`
says (`NONE`: each replica its own). A pipeline's training program is
dispatched one weight update at a time, each update's results streamed as it
is queued; programs that do not stream (pipeline inference, one pass per
execution) return every step's results with the execution, delivered the same
way when it ends.

The hooks need a thread of their own: on a CPU an execution that streams runs
on the thread that dispatched it. The run waits for an execution's hooks
before it dispatches the next one, so `stop_training` set by a hook ends
training at the next execution boundary. An exception in a hook mutes the
stream (the running execution finishes without waiting for a reader) and
reaches the caller of `fit` as it was raised, when the execution ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from keras_ipu.keras import context
from keras_ipu.keras.options import ReplicatedMetricReductionMethod as Reduction
from keras_ipu.keras.options import options_of
from keras_ipu.keras.thread_state import CallersState

# The thread the asynchronous batch hooks run on.
_THREAD_NAME = "keras_ipu-callbacks"
# On a hooks thread: whether its run is replicated (see `check_not_in_async_hooks`).
_HOOKS_OF = threading.local()
# One log entry's values over a chunk's batches, from its replicas' `[R, n]`.
_HOST_REDUCTIONS = {
    Reduction.SUM: lambda values: np.sum(values, axis=0),
    Reduction.MEAN: lambda values: np.mean(values, axis=0),
}


class StepDelivery:
    """Calls a run's batch hooks once per batch and replica, from chunks of steps.

    Args:
        mode: `"fit"`, `"evaluate"` or `"predict"`.
        replicas: The replication factor.
        batches_per_step: Batches in one program step, when its outputs
            have a leading axis of that many batches (gradient
            accumulation); `None` when a step is one batch without one.
        reduction: How the replicas' logs are combined.
        on_begin: The mode's `on_*_batch_begin`.
        on_end: The mode's `on_*_batch_end`.
        synthetic: Whether nothing comes back from the device
            (`--use_synthetic_data`): the hooks get zeros.

    Example:

    >>> delivery = StepDelivery("fit", 1, None, Reduction.NONE, cbs.on_train_batch_begin,
    ...                         cbs.on_train_batch_end)
    >>> delivery.deliver(begin=0, chunks=stream.chunks(16, finished=marker.is_ready))
    """

    def __init__(self, mode: str, replicas: int, batches_per_step: int | None,
                 reduction: Reduction, on_begin: Callable[..., Any],
                 on_end: Callable[..., Any], synthetic: bool = False):
        self.mode = mode
        self.synthetic = synthetic
        self.replicas = replicas
        self.batches_per_step = batches_per_step
        self.reduction = reduction
        self._on_begin = on_begin
        self._on_end = on_end

    def deliver(self, begin: int, chunks: Iterable[list[Any]],
                stopped: Callable[[], bool] = lambda: False) -> None:
        """Calls the hooks for each batch of `chunks`, from index `begin`, until `stopped()`.

        Each chunk is its replicas' outputs of some consecutive program steps
        (leading axis: the steps).
        """
        index = begin
        for per_replica in chunks:
            if self.synthetic:
                per_replica = jax.tree_util.tree_map(np.zeros_like, per_replica)
            per_batch = self._per_batch_logs(per_replica)
            for logs_of_replicas in zip(*per_batch):
                for logs in logs_of_replicas:
                    if stopped():
                        return
                    self._on_begin(index)
                    self._on_end(index, logs)
                index += 1

    def _per_batch_logs(self, per_replica: list[Any]) -> list[list[Any]]:
        """For each replica's call, the logs of each batch of the chunk (converted once)."""
        treedef = jax.tree_util.tree_structure(per_replica[0])
        leaves = [[self._by_batch(leaf) for leaf in jax.tree_util.tree_leaves(values)]
                  for values in per_replica]
        if self.mode == "predict":
            return [[{"outputs": treedef.unflatten(batch)} for batch in zip(*replica)]
                    for replica in leaves]
        if self.replicas > 1 and self.reduction != Reduction.NONE:
            leaves = [self._reduced(leaves)] * self.replicas
        return [[treedef.unflatten(batch) for batch in zip(*(_python(leaf) for leaf in replica))]
                for replica in leaves]

    def _by_batch(self, leaf: Any) -> np.ndarray:
        """A chunk's leaf with one entry per batch: `[steps × batches_per_step, ...]`."""
        # Predict hooks get writable arrays, as Keras' copies are: a hook may edit them in place.
        leaf = np.array(leaf) if self.mode == "predict" else np.asarray(leaf)
        if self.batches_per_step is None:
            return leaf
        return leaf.reshape(-1, *leaf.shape[2:])

    def _reduced(self, leaves: list[list[np.ndarray]]) -> list[Any]:
        """Each log entry reduced over the replicas (`LIST`: the list of their values)."""
        by_entry = [np.stack(values) for values in zip(*leaves)]  # [R, batches, ...]
        if self.reduction == Reduction.LIST:
            return [_ListOfReplicas(values) for values in by_entry]
        return [_HOST_REDUCTIONS[self.reduction](values) for values in by_entry]


class _ListOfReplicas:
    """`LIST` reduction of one log entry: per batch, an array of the replicas' values.

    An array, as the logs of a run without asynchronous callbacks give it.
    """

    def __init__(self, values: np.ndarray):
        self._values = values  # [R, batches, ...]

    def __iter__(self):
        return iter(np.moveaxis(self._values, 1, 0))  # per batch: [R, ...]


def _python(leaf: Any) -> Any:
    """A log entry's per-batch values as Python floats when they are scalars."""
    if isinstance(leaf, np.ndarray) and leaf.ndim == 1:
        return leaf.tolist()
    return leaf


class CallbackThread:
    """The host thread that runs a run's batch hooks, one execution's steps at a time.

    Args:
        delivery: Calls the hooks.
        on_error: Called on the thread when a hook raises (e.g. to mute the
            stream the execution sends its steps to).
        replicated: Whether the run's executions span replicas (they hold
            their IPUs until the hooks have taken their steps).

    Example:

    >>> with CallbackThread(delivery, stream.mute) as hooks:
    ...     hooks.submit(begin, stream.chunks(16, finished=lambda: done[0]))
    ...     state, outfeed = program(state, batches)
    ...     hooks.wait()  # raises a hook's exception
    """

    def __init__(self, delivery: StepDelivery, on_error: Callable[[], None],
                 replicated: bool = False):
        self._delivery = delivery
        self._replicated = replicated
        self._on_error = on_error
        self._jobs: queue.Queue = queue.Queue()
        self._done = threading.Semaphore(0)
        self._error: BaseException | None = None
        self._cancelled = threading.Event()  # the run failed: no more hooks
        self._callers = CallersState()  # hooks see the scope and Keras state of `fit`'s thread
        self._thread = threading.Thread(target=self._work, name=_THREAD_NAME,
                                        daemon=True)
        try:
            self._thread.start()
        except BaseException:
            # A Ctrl-C while it started: nobody gets this object to close it, and the
            # thread may be running: it ends at once.
            self._jobs.put(None)
            raise

    def submit(self, begin: int, chunks: Iterable[list[Any]]) -> None:
        """Hands over one execution's chunks of steps, numbered from `begin`."""
        self._jobs.put((begin, chunks))

    def wait(self) -> None:
        """Blocks until the submitted execution's hooks have run.

        Raises:
            BaseException: What a hook raised, as it was raised.
        """
        self._done.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _work(self) -> None:
        _HOOKS_OF.replicated = self._replicated
        while (job := self._jobs.get()) is not None:
            begin, chunks = job
            try:
                if self._error is None and not self._cancelled.is_set():
                    self._callers.run(self._delivery.deliver, begin, chunks,
                                      self._cancelled.is_set)
            except BaseException as error:  # handed to the run's thread
                self._on_error()
                self._error = error
            finally:
                self._done.release()

    def cancel(self) -> None:
        """Calls no more hooks (the one running ends): the run stopped with an error, or
        a Ctrl-C, which must not wait for the steps still streamed to be delivered."""
        self._cancelled.set()

    def close(self) -> None:
        """Ends the thread (after the submitted work, unless cancelled)."""
        self._jobs.put(None)
        self._thread.join()

    def __enter__(self) -> CallbackThread:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def returned_chunk(per_step: Any, replicas: int) -> list[list[Any]]:
    """An execution's returned per-step outputs `[steps, replicas, ...]` as one chunk.

    For programs that do not stream; the form `StepStream.chunks` yields.
    """
    per_step = jax.tree_util.tree_map(np.asarray, per_step)
    return [[jax.tree_util.tree_map(lambda a, r=r: a[:, r], per_step) for r in range(replicas)]]


def step_delivery(model: Any, run: Any, mode: str, on_begin: Callable[..., Any],
                  on_end: Callable[..., Any], synthetic: bool = False) -> StepDelivery | None:
    """The per-step delivery of a run with asynchronous callbacks, else `None`.

    Args:
        model: The running model (its options say whether hooks are asynchronous).
        run: The run (its program streams its steps, or returns them).
        mode: `"fit"`, `"evaluate"` or `"predict"`.
        on_begin: The mode's `on_*_batch_begin`.
        on_end: The mode's `on_*_batch_end`.
        synthetic: Whether nothing comes back from the device (zeros).

    Returns:
        A `StepDelivery`, or `None` (synchronous hooks, or a pipeline that
        accumulates its outfeed).

    Example:

    >>> step_delivery(model, run, "fit", cbs.on_train_batch_begin, cbs.on_train_batch_end)
    """
    options = options_of(model)
    if not options.asynchronous_callbacks:
        return None
    if run.program.stream is None and run.split_steps is None:
        return None  # the reference's exception: pipelines accumulating their outfeed
    return StepDelivery(mode, run.replica_count, run.batches_per_step,
                        options.replicated_metric_reduction_method, on_begin, on_end,
                        synthetic)


def submit_streamed(hooks: CallbackThread | None, stream: Any, begin: int,
                    batches: Any) -> list:
    """Hands the steps an execution will stream to the hooks' thread, before it runs.

    Args:
        hooks: The hooks' thread, or `None`.
        stream: The program's step stream, or `None`.
        begin: The index of the execution's first step.
        batches: The execution's batches (their leading axis counts its steps).

    Returns:
        A list that receives the execution's outfeed once dispatched: the
        stream is broken if that is ready and steps are missing.
    """
    ended: list = []
    if hooks is not None and stream is not None:
        steps = jax.tree_util.tree_leaves(batches)[0].shape[0]
        chunks = stream.chunks(steps, finished=lambda: bool(ended) and ended[0].is_ready())
        hooks.submit(begin, chunks)
    return ended


def split_steps(run: Any, outfeed: Any) -> tuple[Any, Any]:
    """`(outfeed, per-step outputs or None)`: programs that return every step split them.

    Args:
        run: The run.
        outfeed: What its execution returned.

    Returns:
        The outfeed as without asynchronous hooks, and the per-step outputs.
    """
    if run.split_steps is None:
        return outfeed, None
    return run.split_steps(outfeed)


def await_hooks(hooks: CallbackThread, ended: list, outfeed: Any, returned: Any,
                begin: int, replicas: int) -> None:
    """Waits for an execution's hooks (its steps streamed, or returned with it).

    Args:
        hooks: The hooks' thread.
        ended: What `submit_streamed` returned.
        outfeed: The execution's outfeed.
        returned: Its per-step outputs, for a program that does not stream.
        begin: The index of its first step.
        replicas: The replication factor.

    Raises:
        BaseException: What a hook raised.
    """
    if returned is None:
        ended.append(jax.tree_util.tree_leaves(outfeed)[0])
    else:
        hooks.submit(begin, returned_chunk(returned, replicas))
    hooks.wait()


def has_batch_hooks(callbacks: Any, *hooks: str) -> bool:
    """Whether a callback has one of `hooks` (or a generic batch hook) of its own.

    A hook is its own when its class overrides `keras.callbacks.Callback`'s
    or when the instance holds it (`keras.callbacks.LambdaCallback` sets the
    hooks it is given on the instance).

    Args:
        callbacks: Keras' `CallbackList` of the run.
        *hooks: The mode's batch hooks (`"on_train_batch_end"`, ...).

    Returns:
        True when calling the hooks could do anything.

    Example:

    >>> has_batch_hooks(CallbackList([keras.callbacks.History()]), "on_train_batch_end")
    False
    """
    from keras.src.callbacks.callback import Callback

    generic = ("on_batch_begin", "on_batch_end")
    return any(
        hook in vars(callback)
        or getattr(type(callback), hook, None) is not getattr(Callback, hook)
        for callback in callbacks.callbacks
        for hook in (*hooks, *generic)
    )


def only_read(model: Any, state: Any, parts: tuple[str, ...]) -> bool:
    """Whether the callbacks that synced the run's `state` to the model only read it.

    True when the last sync was of `state` itself (no nested run or batch
    method synced or replaced it since) and every variable still holds the
    very array that sync gave it (an assignment, or a batch method's step,
    replaces it).

    Args:
        model: The running model.
        state: The device state of the run's last execution.
        parts: The state parts of the run's mode.

    Returns:
        Whether the device's state may go on as it is.

    Example:

    >>> only_read(model, state, ("trainable_variables", "optimizer_variables"))
    True
    """
    model_state = context.state_of(model)
    synced = model_state.synced_state
    if state is None or synced is None or model_state.synced_from is not state:
        return False
    for part in parts:
        variables = _variables(model, part)
        values = synced.get(part) or ()
        if len(values) != len(variables) or any(
                variable.value is not value for variable, value in zip(variables, values)):
            return False
    return True


def hook_writes(model: Any, parts: tuple[str, ...],
                variables: dict[str, tuple] | None = None) -> list[tuple[Any, Any]]:
    """The `(variable, value)`s the hooks of an execution assigned, to land after it.

    The hooks ran while the device ran the next execution, on the state they
    synced (the previous execution's): a learning rate or weights a hook set
    is applied once that execution ends, as an assignment the reference queues
    behind the running program. A variable counts as assigned when its value
    is no longer the one the sync gave it. After the model's own
    `test_on_batch` (`IPUModelState.hooks_replaced_metrics`, taken here) every
    metric variable lands: it reset the metrics and added one batch, and a
    count it left as it was must not keep the running execution's.

    Args:
        model: The running model.
        parts: The state parts of the run's mode.
        variables: Each part's variables the state was gathered from
            (`state_variables`); the model's own by default.

    Returns:
        The assigned variables and their values, in state order.

    Example:

    >>> hook_writes(model, ("trainable_variables", "optimizer_variables"))
    [(<Variable path=SGD/learning_rate>, Array(0., dtype=float32))]
    """
    # The execution's state as the sync gave it (a hook's `train_on_batch` replaces
    # Keras' `_jax_state` with its own step's).
    model_state = context.state_of(model)
    synced = model_state.synced_state
    replaced, model_state.hooks_replaced_metrics = model_state.hooks_replaced_metrics, False
    if not model._jax_state_synced or not synced:
        return []  # no hook read the model: none wrote it through Keras
    written = []
    for part in parts:
        of_part = variables[part] if variables else _variables(model, part)
        for variable, value in zip(of_part, synced.get(part) or ()):
            if (replaced and part == "metrics_variables") or not _same_value(
                    variable.value, value):
                written.append((variable, variable.value))
    return written


def check_not_in_async_hooks(model: Any, mode: str) -> None:
    """Refuses `fit`/`evaluate`/`predict` from asynchronous batch hooks where it cannot run.

    Those hooks run while the device runs the next execution: a run of the
    same model there would start from the device's state, not from what the
    hook assigned (which was lost); and a replicated execution holds its IPUs
    until the hooks take its steps, so a run of any IPU model there waits for
    them for ever.

    Raises:
        RuntimeError: On the hooks' thread of a run of `model`, or of a
            replicated run, with asynchronous callbacks.

    Example:

    >>> check_not_in_async_hooks(model, "evaluate")   # from the main thread: fine
    """
    if not on_hooks_thread():
        return
    if context.state_of(model).asynchronous_hooks:
        whose = "the model's own run"
    elif getattr(_HOOKS_OF, "replicated", False):
        whose = "a replicated run (which holds the IPUs until its hooks have run)"
    else:
        return
    raise RuntimeError(
        f"model.{mode}() was called from an asynchronous batch hook of {whose}, which "
        f"runs while the device runs the next execution. Call it from `on_epoch_end`, use "
        f"`predict_on_batch`/`test_on_batch`, or turn asynchronous callbacks off "
        f"(`model.set_asynchronous_callbacks(False)`).")


def on_hooks_thread() -> bool:
    """Whether the caller is an asynchronous batch hook (of any model's run).

    A run started there must not consume the arrays it gathers: they may be
    the running model's synced state (a sub-model sharing its layers), from
    which that run tells what its hooks assigned.

    Example:

    >>> on_hooks_thread()   # from the main thread
    False
    """
    return threading.current_thread().name == _THREAD_NAME


def unshared(gathered: Any, donated: bool) -> Any:
    """The state a run gathered from its variables, copied where the run would consume
    arrays it may share with the run whose asynchronous hook it runs in.

    Args:
        gathered: The state, as `model._get_jax_state` gives it.
        donated: Whether the run's program consumes the state it is given.

    Returns:
        `gathered`, or a copy of it on the hooks thread when `donated`.

    Example:

    >>> unshared(model._get_jax_state(trainable_variables=True), donated=True)
    """
    return jax.tree_util.tree_map(jax.numpy.copy, gathered) if (
        donated and on_hooks_thread()) else gathered


def state_variables(model: Any, parts: tuple[str, ...]) -> dict[str, tuple]:
    """Each state part's variables, as a run gathers its state from them.

    Example:

    >>> state_variables(model, ("trainable_variables",))["trainable_variables"][0].path
    'dense/kernel'
    """
    return {part: tuple(_variables(model, part)) for part in parts}


def variables_moved(model: Any, variables: dict[str, tuple]) -> bool:
    """Whether the model's state parts hold other variables than `variables` (a callback
    froze or unfroze a layer since the state was gathered).

    Args:
        model: The running model.
        variables: Each part's variables, from `state_variables`.

    Returns:
        `True` when a part's variables differ, by identity or in number.

    Example:

    >>> variables_moved(model, state_variables(model, ("trainable_variables",)))
    False
    """
    return any(len(now := _variables(model, part)) != len(of_part)
               or any(a is not b for a, b in zip(now, of_part))
               for part, of_part in variables.items())


def assign_state(variables: dict[str, tuple], keras_state: dict[str, Any]) -> None:
    """Assigns a state in Keras' form to the variables it was gathered from (which a
    frozen layer has since moved to another part of the model's).

    Args:
        variables: Each part's variables, from `state_variables`.
        keras_state: Each part's values, in the same order (`codec.to_keras`).

    Example:

    >>> assign_state(variables, codec.to_keras(state))
    """
    for part, of_part in variables.items():
        for variable, value in zip(of_part, keras_state.get(part) or ()):
            variable.assign(value)


def _variables(model: Any, part: str) -> list:
    """The model's variables of a state part (`"trainable_variables"`, ...), in state order."""
    return model.optimizer.variables if part == "optimizer_variables" else getattr(model, part)


def _same_value(now: Any, synced: Any) -> bool:
    # The sync assigns the state's own arrays: identity is the common answer.
    if now is synced:
        return True
    return (np.shape(now) == np.shape(synced)
            and np.array_equal(np.asarray(now), np.asarray(synced), equal_nan=True))


__all__ = ["CallbackThread", "StepDelivery", "assign_state", "await_hooks",
           "check_not_in_async_hooks", "has_batch_hooks", "hook_writes", "on_hooks_thread",
           "only_read", "returned_chunk", "split_steps", "state_variables", "step_delivery",
           "submit_streamed", "unshared", "variables_moved"]
