"""The IPU trainer: `fit`, `evaluate` and `predict` as executions on an IPU.

Data flow: the data feed checks and batches the data (`data.py`); the
infeed thread moves each execution's stacked batches to the IPU's device;
the execution program runs `steps_per_execution` Keras steps in one
compiled on-device loop and returns the per-step logs (the outfeed);
callbacks run once per execution with the last step's logs.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from keras.src import callbacks as callbacks_module
from keras.src import optimizers as optimizers_module
from keras.src import tree
from keras.src.utils.python_utils import pythonify_logs

from keras_ipu.device import system as ipu_system
from keras_ipu.device.infeed import Infeed
from keras_ipu.device.program import ExecutionProgram
from keras_ipu.keras import data

logger = logging.getLogger("keras_ipu")

MODES = ("fit", "evaluate", "predict")

# The state each mode's step function takes, in Keras' order.
_STATE_PARTS = {
    "fit": (
        "trainable_variables",
        "non_trainable_variables",
        "optimizer_variables",
        "metrics_variables",
    ),
    "evaluate": ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    "predict": ("trainable_variables", "non_trainable_variables"),
}

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
    ipu = _check_runnable(model, "fit")
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = data.validation_split(
            x, y, sample_weight, validation_split
        )
    initial_epoch = model._initial_epoch or initial_epoch
    feed = data.make_feed(
        x,
        y,
        sample_weight,
        batch_size=batch_size,
        steps=steps_per_epoch,
        shuffle=shuffle,
        class_weight=class_weight,
        steps_per_execution=model.steps_per_execution,
        epochs=max(epochs - initial_epoch, 1),
    )
    val_feed = None
    if validation_data is not None:
        val_x, val_y, val_sw = _unpack(validation_data)
        val_feed = data.make_feed(
            val_x,
            val_y,
            val_sw,
            batch_size=validation_batch_size or batch_size,
            steps=validation_steps,
            steps_per_execution=model.steps_per_execution,
        )
    _log_steps(model, feed.plan)
    model._symbolic_build(data_batch=feed.first_batch())
    program = _prepare(model, "fit", ipu, feed)
    if val_feed is not None:
        _prepare(model, "evaluate", ipu, val_feed)

    if not isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks_module.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=epochs,
            steps=feed.plan.steps,
            model=model,
        )
    model.stop_training = False
    training_logs: dict = {}
    training_finished = False
    callbacks.on_train_begin()
    try:
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            logs = _run_epoch(
                model, program, feed, "fit", callbacks.on_train_batch_begin,
                callbacks.on_train_batch_end, "stop_training",
            )
            model.jax_state_sync()
            epoch_logs = dict(model._get_metrics_result_or_logs(logs))
            if val_feed is not None and model._should_eval(epoch, validation_freq):
                val_logs = _evaluate_feed(model, val_feed, callbacks)
                epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            if model.stop_training:
                break
        training_finished = True
    finally:
        model.jax_state_sync()
        feed.close()
        if isinstance(model.optimizer, optimizers_module.Optimizer) and epochs > 0:
            model.optimizer.finalize_variable_values(model.trainable_weights)
        if training_finished:
            callbacks.on_train_end(logs=training_logs)
        model._jax_state = None
    return model.history


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
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    model._assert_compile_called("evaluate")
    ipu = _check_runnable(model, "evaluate")
    feed = data.make_feed(
        x,
        y,
        sample_weight,
        batch_size=batch_size,
        steps=steps,
        steps_per_execution=model.steps_per_execution,
    )
    model._symbolic_build(data_batch=feed.first_batch())
    _prepare(model, "evaluate", ipu, feed)
    if not isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks_module.CallbackList(
            callbacks,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=1,
            steps=feed.plan.steps,
            model=model,
        )
    try:
        logs = _evaluate_feed(model, feed, callbacks)
    finally:
        feed.close()
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def _evaluate_feed(model, feed, callbacks) -> dict:
    program = _programs(model)["evaluate"]
    model.stop_evaluating = False
    callbacks.on_test_begin()
    model.reset_metrics()
    try:
        logs = _run_epoch(
            model, program, feed, "evaluate", callbacks.on_test_batch_begin,
            callbacks.on_test_batch_end, "stop_evaluating",
        )
    finally:
        model.jax_state_sync()
    logs = pythonify_logs(model._get_metrics_result_or_logs(logs))
    callbacks.on_test_end(logs)
    model._jax_state = None
    return logs


def predict(model, x, *, batch_size, verbose, steps, callbacks):
    """Keras `predict` on the IPU system (see `ExtensionBase.predict`)."""
    ipu = _check_runnable(model, "predict")
    feed = data.make_feed(
        x, batch_size=batch_size, steps=steps, steps_per_execution=model.steps_per_execution
    )
    _build_for_predict(model, feed.first_batch())
    program = _prepare(model, "predict", ipu, feed)
    if not isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks_module.CallbackList(
            callbacks,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=1,
            steps=feed.plan.steps,
            model=model,
        )
    model.stop_predicting = False
    callbacks.on_predict_begin()
    outputs: list = []

    def on_batch_end(end_step, outfeed):
        # [steps, batch, ...] -> [steps * batch, ...]: input order.
        merged = tree.map_structure(lambda a: a.reshape(-1, *a.shape[2:]), outfeed)
        outputs.append(merged)
        callbacks.on_predict_batch_end(end_step, {"outputs": merged})

    try:
        _run_epoch(
            model, program, feed, "predict", callbacks.on_predict_batch_begin,
            on_batch_end, "stop_predicting", last_step_logs=False,
        )
    finally:
        model.jax_state_sync()
        feed.close()
    callbacks.on_predict_end()
    model._jax_state = None
    if not outputs:
        raise ValueError("Expect x to be a non-empty array or dataset.")
    return tree.map_structure_up_to(
        outputs[0], lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *outputs
    )


def _run_epoch(model, program, feed, mode, on_begin, on_end, stop_flag, last_step_logs=True):
    """Runs one epoch of executions; returns the last logs."""
    parts = _STATE_PARTS[mode]
    synthetic = bool(ipu_system.require().option("use_synthetic_data"))
    place = _synthetic_placer(program.device) if synthetic else _placer(program.device)
    logs: Any = {}
    model._jax_state_synced = True
    with Infeed(feed.executions(), place=place) as infeed:
        for begin, end, batches in infeed:
            on_begin(begin)
            if model._jax_state_synced:
                # First execution, or a callback synced the variables.
                state = _get_state(model, parts, program.device, purge=True)
                model._jax_state_synced = False
            state, outfeed = program(state, batches)
            if synthetic:  # --use_synthetic_data: nothing comes back to the host
                outfeed = tree.map_structure(jax.numpy.zeros_like, outfeed)
            model._jax_state = dict(zip(parts, state))
            logs = tree.map_structure(lambda a: a[-1], outfeed) if last_step_logs else outfeed
            on_end(end, logs)
            if getattr(model, stop_flag, False):
                break
    return logs


def _placer(device):
    """Copies an execution's batches to the IPU's device (on the infeed thread)."""
    return lambda execution: (*execution[:2], jax.device_put(execution[2], device))


def _synthetic_placer(device):
    """`--use_synthetic_data`: no host data moves; the device gets zeros."""
    zeros: dict = {}

    def place(execution):
        batches = execution[2]
        key = jax.tree_util.tree_structure(batches), tuple(
            (a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(batches)
        )
        if key not in zeros:
            zeros[key] = jax.device_put(
                tree.map_structure(lambda a: np.zeros(a.shape, a.dtype), batches), device
            )
        return (*execution[:2], zeros[key])

    return place


def _prepare(model, mode: str, ipu, feed) -> ExecutionProgram:
    """Compiles and measures the mode's program before any state changes.

    Raises:
        IPUOutOfMemoryError: When the program does not fit the IPU.
    """
    programs = _programs(model)
    program = programs.get(mode)
    hardware = ipu_system.require().hardware
    if program is None or program.ipu != ipu or program.hardware != hardware:
        program = ExecutionProgram(
            _step_function(model, mode),
            mode=mode,
            ipu=ipu,
            hardware=hardware,
            half_precision=_is_half_precision(model),
        )
        programs[mode] = program
    state = _get_state(model, _STATE_PARTS[mode], ipu.device, purge=False)
    spe = feed.plan.steps_per_execution
    batches = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((spe, *np.shape(a)), a.dtype), feed.first_batch()
    )
    program.report = program.prepare(state, batches)
    return program


def _step_function(model, mode: str):
    if mode == "fit":
        return lambda state, batch: model.train_step(state, batch)
    if mode == "evaluate":
        return lambda state, batch: model.test_step(state, batch)

    def predict_step(state, batch):
        outputs, non_trainable = model.predict_step(state, batch)
        return outputs, (state[0], non_trainable)

    return predict_step


def _get_state(model, parts, device, *, purge: bool):
    state = model._get_jax_state(**{part: True for part in parts}, purge_model_variables=purge)
    return jax.device_put(state, device)


def _check_runnable(model, mode: str):
    """The IPU the model runs on, after the checks every mode shares.

    Raises:
        RuntimeError: No system configured, eager mode, or an override of a
            function keras_ipu does not call.
    """
    system = ipu_system.require()
    if getattr(model, "_run_eagerly", False) or getattr(model, "run_eagerly", False):
        raise RuntimeError(
            "Keras models cannot run eagerly when using `IPUStrategy`. Set "
            "`run_eagerly=False` when calling `compile`."
        )
    name = _FUNCTIONS_USED_BY_KERAS_ONLY[mode]
    base = type(model)._ipu_base_class
    if _overrides(base, name):
        raise RuntimeError(
            f"The function `{name}` for the model {model.name} has been overridden. "
            f"This is not supported when using Keras within an IPUStrategy. Either "
            f"remove the override from your model definition or set "
            f"`enable_keras_extensions=False` when creating the IPUStrategy."
        )
    strategy = vars(model).get("_ipu_strategy")
    device = strategy.ipu_device if strategy is not None else 0
    return system.ipus_of_device(device)[0]


def _overrides(cls: type, name: str) -> bool:
    from keras.src.backend.jax.trainer import JAXTrainer

    return getattr(cls, name) is not getattr(JAXTrainer, name)


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


def _is_half_precision(model) -> bool:
    return getattr(model.dtype_policy, "compute_dtype", "float32") in ("float16", "bfloat16")


def _log_steps(model, plan) -> None:
    if plan.steps_per_execution == 1 and plan.steps > 1:
        logger.info(
            "The model `%s` has been configured with only 1 steps per execution. "
            "Consider increasing the value for the `steps_per_execution` argument "
            "passed to the `compile()` method to improve performance.",
            model.name,
        )


def _programs(model) -> dict:
    # A plain instance dict: Keras would track a dict set as an attribute.
    return vars(model).setdefault("_ipu_programs", {})


def forget_programs(model) -> None:
    """Drops the model's compiled programs (after `compile`)."""
    vars(model).pop("_ipu_programs", None)


def program_for(model, mode: str) -> ExecutionProgram | None:
    """The model's program for a mode, if it was compiled."""
    return _programs(model).get(mode)
