"""The IPU trainer: `fit`, `evaluate` and `predict` as executions on the IPU system.

Data flow: the data feed checks and batches the data, dealing batch `i` to replica `i % R`
(`data.py`); the infeed thread regroups each execution's batches for the program and moves them
to the replicas' devices; the execution program (`programs.py`) runs `steps_per_execution` steps
per replica in one compiled on-device loop (gradient accumulation and the cross-replica gradient
sum inside) and returns the per-step logs (the outfeed); callbacks run once per execution with
the last step's logs, replicas reduced as `set_replication_options` says. A pipelined model (one
with a stage assignment) gets its program from `pipelined` instead: the same interfaces, with
the stages on their IPUs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any

import jax
import numpy as np
from keras import config as keras_config
from keras.src import callbacks as callbacks_module
from keras.src import optimizers as optimizers_module
from keras.src import tree
from keras.src.utils.python_utils import pythonify_logs

from keras_ipu.device import attachment, interrupts
from keras_ipu.device import system as ipu_system
from keras_ipu.keras import (
    batch_norm_groups,
    context,
    data,
    fit_checks,
    fit_validation,
    infeeds,
    metric_reset,
    pipelined,
    programs,
    replication,
    saving,
    step_callbacks,
)
from keras_ipu.keras.options import IPUOptions, options_of
from keras_ipu.keras.run import Placement, Run
from keras_ipu.keras.step_callbacks import CallbackThread
from keras_ipu.keras.steps import STATE_PARTS

logger = logging.getLogger("keras_ipu")

_FUNCTIONS_USED_BY_KERAS_ONLY = {
    "fit": "make_train_function",
    "evaluate": "make_test_function",
    "predict": "make_predict_function",
}


def fit(
    model,
    *,
    x,
    y,
    batch_size,
    epochs,
    verbose,
    callbacks,
    validation_split,
    validation_data,
    shuffle,
    class_weight,
    sample_weight,
    initial_epoch,
    steps_per_epoch,
    validation_steps,
    validation_batch_size,
    validation_freq,
):
    """Keras `fit` on the IPU system (see `ExtensionBase.fit`)."""
    model._assert_compile_called("fit")
    fit_checks.check_epochs(epochs, initial_epoch)
    epochs = _capped_epochs(epochs)
    options = options_of(model)
    placement = _placement(model, "fit", options, x)
    replicas = placement.replicas
    fit_checks.check_train_step(model, options, replicas, placement.plan)
    fit_checks.check_targets(model, x, y, "fit")
    fit_checks.check_callbacks(callbacks, options, replicas)
    if validation_data is not None or validation_split:  # its validation runs test_step
        _check_function_not_overridden(model, "evaluate")
        programs.check_pipelined_overrides(model, "evaluate", placement.plan)
        fit_checks.check_validation_freq(validation_freq)
    batch_norm_groups.check(model, replicas, placement.plan is not None)
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = fit_validation.validation_split(
            x, y, sample_weight, validation_split
        )
    steps = replication.instance_steps(steps_per_epoch, replicas, "steps_per_epoch")
    run_epochs = max(epochs - (model._initial_epoch or initial_epoch), 1)
    validation_source = None
    if validation_data is not None:
        val_x, val_y, val_sw = _unpack(validation_data)
        fit_checks.check_targets(model, val_x, val_y, "evaluate", "validation_data")
        val_steps = replication.instance_steps(validation_steps, replicas, "validation_steps")
        validation_source = (val_x, val_steps, 1)
    fit_checks.check_before_reading(model, options, placement.plan, replicas.local_count,
                                    training=(x, steps, run_epochs),
                                    validation=validation_source)
    feed = data.make_feed(x, y, sample_weight, batch_size=batch_size, steps=steps,
                          shuffle=shuffle, class_weight=class_weight,
                          steps_per_execution=model.steps_per_execution, epochs=run_epochs,
                          replicas=replicas.local_count)
    with _closed_on_error(feed):
        accumulation = fit_checks.check_accumulation(model, feed.plan, options, placement.plan)
        validation = None
        if validation_data is not None:
            validation = fit_validation.FitValidation(
                functools.partial(
                    data.make_feed, val_x, val_y, val_sw,
                    batch_size=validation_batch_size or batch_size, steps=val_steps,
                    steps_per_execution=model.steps_per_execution,
                    replicas=replicas.local_count, role="validation"),
                lambda val_feed: programs.prepare(model, "evaluate", placement, val_feed,
                                                  options),
                data.plan_before_reading(val_x, val_steps, model.steps_per_execution, 1,
                                         replicas.local_count, "validation"))
    with _closed_on_error(feed, validation):
        replication.check_instance_steps(replicas, "fit", {
            "fit": feed.plan, "validation": validation.plan if validation else None},
            epochs=(epochs, initial_epoch))
        _symbolic_build(model, feed)
        feed.reset()  # as Keras' `fit`, after the build
        # Its batch size is read inside the first epoch.
        fit_checks.log_plan(model, feed, accumulation)
        run = programs.prepare(model, "fit", placement, feed, options)
        if validation is not None and not validation.deferred:
            validation.prepared()
        attachment.check_attached("fit")
        # On an accelerator the first execution's data moves while the callbacks are set up.
        ahead = infeeds.open_ahead(model, run, feed)
        with _closed_on_error(ahead):
            callbacks = _callback_list(model, callbacks, verbose, epochs, feed,
                                       add_history=True)
            model.stop_training = False
            callbacks.on_train_begin()
    training_logs: dict = {}
    training_finished = False
    # After `on_train_begin`: `BackupAndRestore` sets the epoch to resume from there.
    initial_epoch = model._initial_epoch or initial_epoch
    replication.check_instances_agree(replicas, "fit", "the epoch it starts at", initial_epoch)
    replication.check_instances_agree(replicas, "fit", "the epochs it validates (1 for each)", [
        validation is not None and model._should_eval(e, validation_freq)
        for e in range(epochs)])
    try:
        for epoch in range(initial_epoch, epochs):
            metric_reset.reset_metrics(model)
            callbacks.on_epoch_begin(epoch)
            logs = _run_epoch(model, run, feed, "fit", callbacks, infeed=ahead)
            ahead = None  # closed by the epoch
            model.jax_state_sync()
            epoch_logs = (_epoch_logs(model, run, logs) if logs else  # no step: the last ones
                          {k: v for k, v in training_logs.items() if not k.startswith("val_")})
            if validation is not None and model._should_eval(epoch, validation_freq):
                val_logs = _validate(model, validation, callbacks, x=val_x, y=val_y,
                                     sample_weight=val_sw,
                                     batch_size=validation_batch_size or batch_size,
                                     steps=validation_steps)
                epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            replication.check_instances_agree(replicas, "fit", "model.stop_training",
                                              int(bool(model.stop_training)))
            if model.stop_training:
                break
        training_finished = True
    finally:
        # The weights first (the sync holds Ctrl-C back itself): whatever stops the
        # rest, a Ctrl-C in a close that waits for a data source, say, they are the model's.
        try:
            _sync(model)
            _forget_state(model)
        finally:  # a Ctrl-C held back by the sync is raised after the feeds closed
            _close_all(ahead, feed, validation)
        if isinstance(model.optimizer, optimizers_module.Optimizer) and epochs > 0:
            model.optimizer.finalize_variable_values(model.trainable_weights)
        if training_finished:
            callbacks.on_train_end(logs=training_logs)
    return model.history


def _close_all(*closables) -> None:
    """Closes each (`None`s skipped), also when an earlier one raised (raised after)."""
    with contextlib.ExitStack() as stack:
        for closable in reversed(closables):  # the stack closes the last pushed first
            if closable is not None:
                stack.callback(closable.close)


@contextlib.contextmanager
def _closed_on_error(*closables):
    """Closes what it is given (feeds, an infeed; `None`s skipped) if the block raises:
    a call that fails before it runs must not leave a data pipeline's workers behind."""
    try:
        yield
    except BaseException:
        for closable in closables:
            if closable is not None:
                closable.close()
        raise


def _symbolic_build(model, feed) -> None:
    """Keras' symbolic build of the model, its metrics, loss and optimizer, on `feed`'s
    first batch."""
    # A Ctrl-C waits for the build: Keras marks the optimizer built before it makes its
    # slots (a second one, for a source that never yields, stops it at once).
    with interrupts.deferred(second_raises=True):
        model._symbolic_build(iterator=_BuildPass(feed))


class _BuildPass:
    """The first batch for Keras' symbolic build, given as its epoch iterator gives it.

    Keras' `fit` (and `evaluate`) starts a pass over the data when it builds
    an unbuilt model (or its metrics or loss) and another for the first
    epoch, so a shuffled pass draws its permutation twice. Keras pulls the
    batch only when it builds: the feed then draws what that pass drew, and
    after `keras.utils.set_random_seed` the epochs see plain Keras' order.
    Either way Keras then resets its iterator: the caller calls `feed.reset()`.
    """

    def __init__(self, feed):
        self._feed = feed

    def __iter__(self):
        self._feed.draw_build_pass()
        yield 0, 0, [self._feed.first_batch()]


def evaluate(
    model,
    *,
    x,
    y,
    batch_size,
    verbose,
    sample_weight,
    steps,
    callbacks,
    return_dict,
    **kwargs,
):
    """Keras `evaluate` on the IPU system (see `ExtensionBase.evaluate`)."""
    validation = context.state_of(model).validation
    if kwargs.pop("_use_cached_eval_dataset", False) and validation is not None:
        # Fit's validation (its feed and run made now, the first time, for a generator).
        logs = _evaluate_feed(model, *validation.prepared(), callbacks, restart=True)
        return logs if return_dict else model._flatten_metrics_in_order(logs)
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    model._assert_compile_called("evaluate")
    placement = _placement(model, "evaluate", options_of(model), x)
    replicas = placement.replicas
    programs.check_pipelined_overrides(model, "evaluate", placement.plan)
    fit_checks.check_targets(model, x, y, "evaluate")
    feed = data.make_feed(
        x,
        y,
        sample_weight,
        batch_size=batch_size,
        steps=replication.instance_steps(steps, replicas),
        steps_per_execution=model.steps_per_execution,
        replicas=replicas.local_count,
        role="evaluate",
    )
    with _closed_on_error(feed):
        replication.check_instance_steps(replicas, "evaluate", {"evaluate": feed.plan})
        _symbolic_build(model, feed)
        feed.reset()  # as Keras' `evaluate`, after the build
        run = programs.prepare(model, "evaluate", placement, feed, options_of(model))
        attachment.check_attached("evaluate")
        callbacks = _callback_list(model, callbacks, verbose, 1, feed)
    try:
        logs = _evaluate_feed(model, run, feed, callbacks)
    finally:
        feed.close()
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def _validate(model, validation: fit_validation.FitValidation, callbacks,
              **data_arguments) -> dict:
    """A `fit`'s validation through the model's own `evaluate`, as Keras' `fit` calls it
    (an override of it runs), on the validation run prepared with the fit."""
    model_state = context.state_of(model)
    model_state.validation = validation
    try:
        return model.evaluate(**data_arguments, callbacks=callbacks, return_dict=True,
                              _use_cached_eval_dataset=True)
    finally:
        model_state.validation = None


def _evaluate_feed(model, run: Run, feed, callbacks, restart: bool = False) -> dict:
    # Each evaluation starts at the beginning of its data, as Keras' `evaluate` does
    # (with `validation_steps`, every epoch's validation reads the same batches). A
    # validation in `fit` (`restart`) resets the data first, as Keras resets its cached
    # iterator: a `PyDataset`'s `on_epoch_end` runs before each validation too.
    if restart:
        feed.reset()
    else:
        feed.rewind()
    model.stop_evaluating = False
    callbacks.on_test_begin()
    metric_reset.reset_metrics(model)
    try:
        logs = _run_epoch(model, run, feed, "evaluate", callbacks)
    finally:
        _sync(model)
    logs = _epoch_logs(model, run, logs)
    callbacks.on_test_end(logs)
    _forget_state(model)
    return logs


def predict(model, x, *, batch_size, verbose, steps, callbacks):
    """Keras `predict` on the IPU system (see `ExtensionBase.predict`)."""
    placement = _placement(model, "predict", options_of(model), x)
    replicas = placement.replicas
    programs.check_pipelined_overrides(model, "predict", placement.plan)
    feed = data.make_feed(
        x,
        batch_size=batch_size,
        steps=replication.instance_steps(steps, replicas),
        steps_per_execution=model.steps_per_execution,
        replicas=replicas.local_count,
        role="predict",
    )
    with _closed_on_error(feed):
        replication.check_instance_steps(replicas, "predict", {"predict": feed.plan})
        _build_for_predict(model, feed.first_batch())
        run = programs.prepare(model, "predict", placement, feed, options_of(model))
        attachment.check_attached("predict")
        callbacks = _callback_list(model, callbacks, verbose, 1, feed)
        model.stop_predicting = False
        callbacks.on_predict_begin()
    outputs: list = []  # per execution, in input order; never reduced over replicas

    def collect(outfeed):  # this instance's predictions, kept and handed to the hooks
        if replicas.spans_processes:
            outfeed = replication.local_predictions(replicas, outfeed)
        outputs.append(outfeed)
        return outfeed
    try:
        _run_epoch(model, run, feed, "predict", callbacks, collect=collect)
    finally:
        try:
            _sync(model)  # first, as in fit
        finally:
            feed.close()
    callbacks.on_predict_end()
    _forget_state(model)
    if not outputs:
        raise ValueError("Expect x to be a non-empty array or dataset.")
    return tree.map_structure_up_to(
        outputs[0], lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *outputs
    )


# Per mode: the batch hooks, how the outfeed reaches them, the stop flag.
_BATCH_HOOKS = {
    "fit": ("on_train_batch_begin", "on_train_batch_end", lambda logs: logs, "stop_training"),
    "evaluate": ("on_test_batch_begin", "on_test_batch_end", lambda logs: logs,
                 "stop_evaluating"),
    # Copies, as Keras': a hook's in-place edit must not change the predictions.
    "predict": ("on_predict_batch_begin", "on_predict_batch_end",
                lambda out: {"outputs": jax.tree_util.tree_map(np.array, out)}, "stop_predicting"),
}


def _run_epoch(model, run: Run, feed, mode, callbacks, collect=None, infeed=None):
    """Runs one epoch of executions (from `infeed` when one is open); returns the last
    outfeed (logs)."""
    # Since the run was prepared: a callback froze a layer, or compiled the model again?
    programs.check_unchanged(model, mode)
    begin_hook, end_hook, as_logs, stop_flag = _BATCH_HOOKS[mode]
    # Batch hooks cost a host sync per execution (Keras converts the logs):
    # call them only when some callback has one.
    hooked = step_callbacks.has_batch_hooks(callbacks, begin_hook, end_hook)
    # A hook of one instance alone must not stop it: the others would wait for it in the
    # next execution's collectives for ever. (Only hooks can stop a run mid-epoch.)
    agree_on_stops = (run.program.replicas.spans_processes
                      and replication.any_instance(run.program.replicas, hooked))
    on_begin = getattr(callbacks, begin_hook) if hooked else _ignore
    on_end = getattr(callbacks, end_hook) if hooked else _ignore
    # PRE_COMPILE: programs compile but never run; their outfeed is zeros,
    # handed to the hooks as they return (nothing streams from a device).
    attached = attachment.runs_programs()
    execute = run.program if attached else run.program.unattached
    synthetic = bool(ipu_system.require().option("use_synthetic_data"))
    delivery = (step_callbacks.step_delivery(model, run, mode, on_begin, on_end, synthetic)
                if hooked and attached else None)
    stream = run.program.stream
    if stream is not None:
        # Nobody reads a stream without hooks: the device drops its steps.
        stream.unmute() if delivery is not None else stream.mute()
    hooks = (CallbackThread(delivery, stream.mute if stream else _ignore,
                           replicated=run.replica_count > 1) if delivery else None)
    context.state_of(model).asynchronous_hooks = hooks is not None
    compiled_at = programs.compilations(model)
    parts = STATE_PARTS[mode]
    codec = run.codec
    logs: Any = {}
    state = None  # the device's, from the first execution on
    model._jax_state_synced = True
    try:
        if infeed is None:
            infeed = infeeds.open_infeed(model, run, feed)
        executions = infeed
        if run.program.replicas.spans_processes and feed.plan.num_batches is None:
            # A generator of each instance's own: they stop where the first runs out.
            executions = replication.agreed_executions(run.program.replicas, infeed)
        with infeed:
            for begin, end, batches in executions:
                programs.check_current(model, mode)  # an option set by a callback?
                if hooks is None:
                    on_begin(begin)
                if model._jax_state_synced and step_callbacks.only_read(model, state, parts):
                    # A callback read the model and wrote nothing (a checkpoint): the
                    # device's state goes on, as on an IPU. Taking it back would also be
                    # a collective that the instances of a job which did not read skip.
                    programs.check_unchanged(model, mode)
                    _keep_state(model, state, codec)
                    model._get_jax_state(**dict.fromkeys(parts, True), purge_model_variables=True)
                    model._jax_state_synced = False
                if model._jax_state_synced:
                    # First execution, or a callback synced the variables (and froze a
                    # layer? checked before the purge). A Ctrl-C between the purge and
                    # the keeping would lose the weights.
                    if state is not None:
                        programs.check_unchanged(model, mode)
                    with interrupts.deferred():
                        variables = step_callbacks.state_variables(model, parts)
                        state = replication.resumed_state(codec, parts, step_callbacks.unshared(
                            model._get_jax_state(**dict.fromkeys(parts, True),
                                                 purge_model_variables=True),
                            run.program.donates_state), state)
                        model._jax_state_synced = False
                        # The variables are purged: until the execution's own
                        # state comes back, this is the model's (a hook reading the
                        # model while it runs, or a call that fails before it does).
                        _keep_state(model, state, codec)
                if hooks is not None and run.program.donates_state:
                    # Hooks read the model while the execution consumes its state
                    # (a pipeline's): they read a copy of it.
                    _keep_state(model, jax.tree_util.tree_map(jax.numpy.copy, state), codec)
                ended = step_callbacks.submit_streamed(hooks, stream, begin, batches)
                # A Ctrl-C between the execution and keeping its state would lose both.
                with interrupts.deferred():
                    new_state, outfeed = execute(state, batches)
                    if hooks is None:
                        # The old state may be consumed: the new one is the model's now.
                        _keep_state(model, new_state, codec)
                outfeed, returned = step_callbacks.split_steps(run, outfeed)
                if synthetic:  # --use_synthetic_data: nothing comes back to the host
                    outfeed, returned = jax.tree_util.tree_map(jax.numpy.zeros_like,
                                                               (outfeed, returned))
                logs = outfeed  # the program returns the last step's logs (or predictions)
                if collect is not None:  # the outputs as the hooks see them too
                    outfeed = collect(outfeed)
                if hooks is None:
                    if hooked:  # a fetch waits for the device: only for a hook
                        on_end(end, _batch_logs(as_logs(outfeed)))
                else:
                    step_callbacks.await_hooks(hooks, ended, outfeed, returned, begin,
                                               run.replica_count)
                    if mode != "predict":  # which keeps no state (`check_current` stops it)
                        programs.check_not_recompiled(model, compiled_at)  # a hook compiled?
                    # The device's state is kept once its hooks all ran (a hook that
                    # raises leaves the last execution's); what they assigned lands on it.
                    written = step_callbacks.hook_writes(model, parts, variables)
                    model._jax_state_synced = False
                    _keep_state(model, new_state, codec)
                    if step_callbacks.variables_moved(model, variables):
                        # A hook froze a layer: the execution is kept, in the variables it
                        # ran on; the next one is refused (`check_unchanged`), as when synced.
                        sync_pending_state(model, variables)
                    _land(model, written)
                state = new_state
                stop = bool(getattr(model, stop_flag, False))
                if agree_on_stops:
                    replication.check_instances_agree(run.program.replicas, mode,
                                                      f"model.{stop_flag}", int(stop))
                if stop:
                    break
            else:  # every execution taken: the pass ends (not after a stop or an error)
                feed.end_pass()
            if mode != "predict":  # which reads no metrics
                # A hook of the last execution compiled the model: its metrics are new,
                # unbuilt (Keras' epoch logs fail; evaluate's loss would read 0).
                programs.check_not_recompiled(model, compiled_at)
    except BaseException:
        if hooks is not None:
            hooks.cancel()  # a Ctrl-C (or an error) delivers no more steps
        if stream is not None:
            # Whatever stopped the run, the device must not wait for a reader.
            stream.mute()
            run.program.wait()
        raise
    finally:
        if hooks is not None:
            hooks.close()
        model_state = context.state_of(model)
        model_state.asynchronous_hooks = model_state.hooks_replaced_metrics = False
        model_state.hooks_wrote_metrics = bool(
            step_callbacks.hook_writes(model, ("metrics_variables",)))
        model_state.synced_state = model_state.synced_from = None
    if mode == "fit":
        replication.keep_first_replica_state(model, run.replica_count)
    if mode != "predict":
        replication.keep_last_replica_metrics(model, run.replica_count)
    return logs


def _capped_epochs(epochs: int) -> int:
    """`epochs`, capped by `keras.config.set_max_epochs` as Keras' `fit` caps it."""
    max_epochs = keras_config.max_epochs()
    if max_epochs and max_epochs < epochs:
        warnings.warn(f"Limiting epochs to {max_epochs}", stacklevel=4)
        return max_epochs
    return epochs


def _callback_list(model, callbacks, verbose, epochs, feed, add_history=False):
    """Keras' callback container for a run (a given `CallbackList` is used as it is)."""
    if isinstance(callbacks, callbacks_module.CallbackList):
        return callbacks
    saving.backups_on_first_instance(callbacks)
    return callbacks_module.CallbackList(
        callbacks,
        add_history=add_history,
        add_progbar=verbose != 0,
        verbose=verbose,
        epochs=epochs,
        steps=feed.plan.steps,
        model=model,
    )


def _ignore(*args) -> None:
    return None


def _epoch_logs(model, run: Run, logs) -> dict:
    # --use_synthetic_data: nothing comes back to the host, the metrics' state neither.
    synthetic = bool(ipu_system.require().option("use_synthetic_data"))
    device_logs = run.replica_count > 1 or run.accumulated_logs
    if not synthetic and (not device_logs or context.state_of(model).hooks_wrote_metrics):
        return _python_logs(model._get_metrics_result_or_logs(logs))
    # Keras' metric variables hold one replica's state, and a pipeline that
    # accumulates its outfeed reports its passes' means: the last logs are the epoch's
    # (unless a hook changed the metrics after them: a reset reads as in Keras).
    return _python_logs(logs)


def _batch_logs(logs):
    # Fetched before Keras' log conversion, as `_python_logs` says; leaf by leaf:
    # cheaper than `jax.device_get` at every execution.
    return jax.tree_util.tree_map(np.asarray, logs)


def _python_logs(logs) -> dict:
    # Fetched before Keras' conversion (epoch and batch logs alike), whose bare
    # `except` would swallow a Ctrl-C that arrives while the fetch waits for the
    # device's last executions: `fit` would train on.
    return dict(pythonify_logs(jax.device_get(logs)))


def _keep_state(model, state, codec) -> None:
    """Records the latest device state; variables get it on `jax_state_sync`."""
    context.state_of(model).pending_state = (state, codec)


def sync_pending_state(model, variables=None) -> None:
    """Hands the latest device state to Keras' state sync (replica 0's weights,
    the last replica's metrics, so `get_metrics_result` agrees with `NONE`); with
    `variables` (of each state part, those the run gathered), assigns it to them."""
    model_state = context.state_of(model)
    if model_state.pending_state is None:
        return
    state, codec = model_state.pending_state
    model._jax_state = model_state.synced_state = codec.to_keras(state)
    model_state.synced_from = state
    model_state.pending_state = None  # only now: the state is Keras' to sync
    if variables is not None:
        step_callbacks.assign_state(variables, model._jax_state)
        model._jax_state_synced = True


def _sync(model) -> None:
    """The device's state to the variables, even when a Ctrl-C comes as the sync begins
    (before the sync holds it back): the variables would stay purged."""
    try:
        model.jax_state_sync()
    except KeyboardInterrupt:
        model.jax_state_sync()
        raise


def _land(model, written: list) -> None:
    """Assigns what asynchronous hooks wrote over the kept state; the next execution
    gathers its state from the variables then."""
    if written:
        model.jax_state_sync()
        for variable, value in written:
            variable.assign(value)


def _forget_state(model) -> None:
    context.state_of(model).pending_state = None
    model._jax_state = None


def _check_function_not_overridden(model, mode: str) -> None:
    """Refuses an override of the Keras function `mode` runs through, which keras_ipu
    does not call."""
    name = _FUNCTIONS_USED_BY_KERAS_ONLY[mode]
    if programs.overrides(model, name):
        raise RuntimeError(
            f"The function `{name}` for the model {model.name} has been overridden. "
            f"This is not supported when using Keras within an IPUStrategy. Either "
            f"remove the override from your model definition or set "
            f"`enable_keras_extensions=False` when creating the IPUStrategy."
        )


def _placement(model, mode: str, options: IPUOptions, x) -> Placement:
    """The checks every mode shares, then the model's replicas (and stages).

    Raises:
        RuntimeError: No system configured, eager mode, an override of a
            function keras_ipu does not call, or a call from the model's own
            asynchronous batch hooks.
        ValueError: A device mapping that does not fit the stages or IPUs.
    """
    ipu_system.require()
    programs.check_not_eager(model)
    step_callbacks.check_not_in_async_hooks(model, mode)
    _check_function_not_overridden(model, mode)
    plan = pipelined.plan_of(model, x)
    if plan is None:
        placement = Placement(replication.replicas_for(model))
    else:
        mapping = pipelined.device_mapping(plan, options, len(context.device_ipus(model)))
        # In a multi-host job each instance pipelines over its own IPUs: the
        # replicas are the instances' pipelines.
        replicas = replication.replicas_for(model, ipus_per_replica=max(mapping) + 1)
        placement = Placement(replicas, plan, mapping)
    if options.asynchronous_callbacks and placement.replicas.spans_processes:
        # Each process hears only its own replicas' steps from the device.
        raise NotImplementedError(
            "Asynchronous callbacks are not supported across instances yet: call "
            "`set_asynchronous_callbacks(False)`; batch callbacks then run once per "
            "execution.")
    return placement


def _build_for_predict(model, batch) -> None:
    if all(layer.built for layer in model._flatten_layers()):
        return
    from keras.src import backend

    x, _, _ = _unpack(batch)
    with backend.StatelessScope():
        model(x)


def _unpack(batch):
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.unpack_x_y_sample_weight(batch)
