"""What `fit` checks before it reads any data or changes a weight, and the plan it logs.

Each check raises the error IPU Keras raises (or Keras would raise later),
before the first batch is taken: a refused `fit` leaves the model and the
user's data as they were.
"""

from __future__ import annotations

import inspect
import logging
import string
from typing import Any

import keras

from keras_ipu.device import integers
from keras_ipu.device.replicate import Replicas
from keras_ipu.keras import data, host_data, pipelined, programs
from keras_ipu.keras.options import IPUOptions, ReplicatedMetricReductionMethod
from keras_ipu.ops import host_embedding

logger = logging.getLogger("keras_ipu")


def check_before_reading(model, options: IPUOptions, pipeline_plan, replicas: int, *,
                         training: tuple, validation: tuple | None = None) -> None:
    """The checks of the plans that need no batch, for generators given their steps.

    Args:
        model: The model to fit.
        options: Its IPU options.
        pipeline_plan: Its pipeline plan, or `None` when not pipelined.
        replicas: The replicas of this instance.
        training, validation: `(x, steps per instance, epochs)` of each run's data.

    Raises:
        ValueError, RuntimeError: As the feeds and `check_accumulation`.
    """
    x, steps, epochs = training
    plan = data.plan_before_reading(x, steps, model.steps_per_execution, epochs, replicas)
    if plan is not None:
        check_accumulation(model, plan, options, pipeline_plan)
    if validation is not None:
        x, steps, epochs = validation
        data.plan_before_reading(x, steps, model.steps_per_execution, epochs, replicas,
                                 "validation")


def compile_arguments(compile_method: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of a model's `compile`, its `steps_per_execution` checked
    (`steps_per_execution_of`) wherever it is given, by position too.

    Args:
        compile_method: The `compile` they go to (Keras', or the model's own:
            one without `steps_per_execution` gets them as they are).
        args: The positional arguments.
        kwargs: The keyword arguments.

    Returns:
        `(args, kwargs)` to call it with.

    Raises:
        ValueError: For a bad `steps_per_execution`.

    Example:

    >>> compile_arguments(model.compile, ("sgd", "mse"), {"steps_per_execution": np.int64(4)})
    (('sgd', 'mse'), {'steps_per_execution': 4})
    """
    try:
        bound = inspect.signature(compile_method).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # the method itself will say what is wrong
        return args, kwargs
    if "steps_per_execution" in bound.arguments:
        bound.arguments["steps_per_execution"] = steps_per_execution_of(
            bound.arguments["steps_per_execution"])
    return bound.args, bound.kwargs


def steps_per_execution_of(value: Any) -> int:
    """`compile`'s `steps_per_execution` as a Python int, checked when the model is compiled.

    Args:
        value: A positive integer of any kind, or `None` (1: IPU TensorFlow's
            Keras compiled with `steps_per_execution or 1`).

    Returns:
        The steps.

    Raises:
        ValueError: For anything else (0, a negative number, a float, a
            string), naming it.

    Example:

    >>> steps_per_execution_of(np.int64(4)), steps_per_execution_of(None)
    (4, 1)
    """
    return 1 if value is None else data.positive_int("steps_per_execution", value)


def check_epochs(epochs: Any, initial_epoch: Any) -> None:
    """Refuses, before any callback runs, epochs Keras' epoch loop would refuse at its start.

    Args:
        epochs: `fit`'s `epochs`.
        initial_epoch: `fit`'s `initial_epoch`.

    Raises:
        ValueError: For either that is not a non-negative integer (NumPy
            integers count; bools and floats do not).

    Example:

    >>> check_epochs(1.5, 0)
    Traceback (most recent call last):
    ValueError: `epochs` must be a non-negative integer (a count of epochs), got 1.5.
    """
    for name, value in (("epochs", epochs), ("initial_epoch", initial_epoch)):
        number = integers.integer_of(value)
        if number is None or number < 0:
            raise ValueError(f"`{name}` must be a non-negative integer (a count of epochs), "
                             f"got {value!r}.")


def check_targets(model: keras.Model, x: Any, y: Any, mode: str, data_name: str = "x") -> None:
    """Refuses array data without targets for a model whose compiled loss compares targets.

    Keras' own steps then fail inside the loss on `None` ("None is not a valid
    value for jnp.array"). A model that computes its loss itself (its own
    `train_step`, `test_step` or `compute_loss`, or losses added by layers
    alone) takes data without targets, and is let through.

    Args:
        model: The compiled model.
        x: The inputs (checked only when they are arrays).
        y: The targets, or `None`.
        mode: `"fit"` (its `train_step` runs) or `"evaluate"` (`test_step`).
        data_name: What the message calls the data (`"validation_data"`).

    Raises:
        ValueError: For arrays without targets and a compiled loss.

    Example:

    >>> check_targets(model, x, None, "fit")   # model.compile(loss="mse")
    Traceback (most recent call last):
    ValueError: `x` comes without targets (`y` is None), ...
    """
    step = "train_step" if mode == "fit" else "test_step"
    if (y is not None or getattr(model, "_compile_loss", None) is None
            or host_data.as_arrays(x) is None
            or any(programs.overrides(model, name) for name in (step, "compute_loss"))):
        return
    raise ValueError(f"`{data_name}` comes without targets (`y` is None), but the model was "
                     f"compiled with a loss, which compares predictions with targets: give "
                     f"the targets, or compile without a loss.")


def check_validation_freq(validation_freq: Any) -> None:
    """Refuses, before any epoch, a `validation_freq` Keras would refuse after the first one."""
    valid = ((isinstance(validation_freq, int) and validation_freq >= 1)
             or isinstance(validation_freq, list))
    if not valid:
        raise ValueError(
            f"`validation_freq` must be a positive integer (validate every that many epochs) "
            f"or a list of the (1-based) epochs to validate after, as Keras takes it; got "
            f"{validation_freq!r}.")


# Keras callbacks that take a log value as one number (an `if` over it), and the
# methods that read it: a subclass overriding one may reduce the replicas' values itself.
_SCALAR_MONITORS = {
    keras.callbacks.EarlyStopping: ("on_epoch_end", "get_monitor_value", "_is_improvement"),
    keras.callbacks.ReduceLROnPlateau: ("on_epoch_end", "_reset"),
    keras.callbacks.TerminateOnNaN: ("on_batch_end", "on_train_batch_end"),
    # With `save_best_only`: Keras' would save every epoch's model as the best one.
    keras.callbacks.ModelCheckpoint: ("_should_save_model",),
}


def check_callbacks(callbacks: Any, options: IPUOptions, replicas: Replicas) -> None:
    """Refuses, before any step, a callback that cannot take LIST-reduced logs.

    Args:
        callbacks: `fit`'s callbacks (a list or a `CallbackList`, or `None`).
        options: The model's IPU options.
        replicas: The run's replicas.

    Raises:
        ValueError: `set_replication_options("LIST")` with several replicas (each
            log value an array, one per replica) and `EarlyStopping`,
            `ReduceLROnPlateau` or `TerminateOnNaN` (or a subclass that reads
            the logs with their methods), which would fail at their first
            comparison with NumPy's "truth value of an array" error; or
            `ModelCheckpoint(save_best_only=True)`, which would save every
            epoch's model as the best, or one whose file name formats a log value
            with a format spec (`{val_loss:.3f}`), which NumPy refuses for an array.

    Example:

    >>> check_callbacks([keras.callbacks.History()], options, replicas)   # nothing raised
    """
    if (options.replicated_metric_reduction_method is not ReplicatedMetricReductionMethod.LIST
            or replicas.count == 1):
        return
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        base = next((kind for kind in _SCALAR_MONITORS if isinstance(callback, kind)), None)
        if base is keras.callbacks.ModelCheckpoint:
            _check_checkpoint_path(callback, replicas.count)
            if not callback.save_best_only:
                continue  # it compares nothing
        if base is not None and all(
                getattr(type(callback), method, None) is getattr(base, method, None)
                for method in _SCALAR_MONITORS[base]):
            hint = (", `save_best_only=False`" if base is keras.callbacks.ModelCheckpoint
                    else "")
            raise ValueError(
                f"{type(callback).__name__} compares a log value as one number, but "
                f"`set_replication_options('LIST')` makes every log value an array of the "
                f"{replicas.count} replicas' values. Use the MEAN, SUM or NONE reduction "
                f"with this callback{hint}, or leave the callback out.")


_SCALAR_LOG_KEYS = ("epoch", "batch", "learning_rate")


def _check_checkpoint_path(checkpoint, replicas: int) -> None:
    """Refuses a `ModelCheckpoint` file name that formats a LIST-reduced log value as a
    number (`{val_loss:.3f}`): NumPy refuses a format spec for an array."""
    if type(checkpoint)._get_file_path is not keras.callbacks.ModelCheckpoint._get_file_path:
        return  # a subclass names its files itself
    # A field taken as it is (not `{loss[0]:...}`, `{loss!s:...}`) with a format spec, of
    # a value the model logs: not the epoch or batch numbers, nor a learning rate that a
    # scheduler adds.
    formatted = [f"{{{name}:{spec}}}" for _, name, spec, conversion in
                 string.Formatter().parse(str(getattr(checkpoint, "filepath", "")))
                 if name and spec and not conversion and not {"[", "."} & set(name)
                 and name not in _SCALAR_LOG_KEYS]
    if formatted:
        raise ValueError(
            f"ModelCheckpoint's file name formats a log value as one number "
            f"({', '.join(formatted)}), but `set_replication_options('LIST')` makes every "
            f"log value an array of the {replicas} replicas' values. Use the MEAN, SUM or "
            f"NONE reduction with this callback, or a file name without a format spec.")


def check_train_step(model, options: IPUOptions, replicas: Replicas, plan=None) -> None:
    programs.check_pipelined_overrides(model, "fit", plan)
    host_embedding.check_loss_unscaled(model)
    if programs.overrides(model, "train_step") and (
        options.gradient_accumulation_steps > 1 or replicas.count > 1
    ):
        raise RuntimeError(
            f"The function `train_step` for the model {model.name} has been overridden. "
            f"Gradient accumulation and replication reduce the gradients between the "
            f"forward/backward pass and the optimizer, inside keras_ipu's own train step. "
            f"Remove the override, or train without gradient accumulation on 1 replica."
        )


def check_accumulation(model, plan, options: IPUOptions, pipeline_plan=None) -> int:
    """The micro-batches per weight update (the pipeline's for a pipelined model), checked."""
    if pipeline_plan is not None:
        accumulation = pipelined.accumulation_steps(model, options)
    else:
        accumulation = options.gradient_accumulation_steps
    kind = "pipelined model" if pipeline_plan is not None else "model"
    # The value compile() was given too, as the reference checks it (where the data is
    # shorter, the run's is truncated to the data's batches).
    for steps in dict.fromkeys((model.steps_per_execution, plan.steps_per_execution)):
        _check_divisible(kind, steps, accumulation)
    return accumulation


def _check_divisible(kind: str, steps: int, accumulation: int) -> None:
    if steps % accumulation:
        raise RuntimeError(
            f"The {kind} has been configured to use gradient accumulation for training, "
            f"however the current `steps_per_execution` value (set to "
            f"{steps}) is not divisible by "
            f"`gradient_accumulation_steps_per_replica` ({accumulation}). You need to "
            f"adjust either `steps_per_execution` or "
            f"`gradient_accumulation_steps_per_replica` to make sure that "
            f"`steps_per_execution` is divisible by "
            f"`gradient_accumulation_steps_per_replica`."
        )


def log_plan(model, feed, accumulation: int) -> None:
    plan = feed.plan
    if plan.steps_per_execution == 1 and plan.steps > 1:
        logger.info(
            "The model `%s` has been configured with only 1 steps per execution. "
            "Consider increasing the value for the `steps_per_execution` argument "
            "passed to the `compile()` method to improve performance.",
            model.name,
        )
    if accumulation > 1 or plan.replicas > 1:
        logger.info(
            "Training is%s distributed%s%s, your effective batch size is %d.",
            "" if plan.replicas > 1 else " not",
            f" and accumulating {accumulation} batches per optimizer step"
            if accumulation > 1 else "",
            f" across {plan.replicas} replicas" if plan.replicas > 1 else "",
            feed.batch_size * accumulation * plan.replicas,
        )
    updates = plan.steps_per_execution // accumulation
    logger.info(
        "Doing %d weight update%s per execution per replica, which is %d per epoch per replica.",
        updates, "s" if updates != 1 else "", plan.steps // accumulation,
    )
