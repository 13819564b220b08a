"""The execution report of a model's compiled IPU programs."""

from __future__ import annotations

import keras

from keras_ipu.device.report import ExecutionReport
from keras_ipu.keras import run


def execution_report(model, mode: str = "fit") -> ExecutionReport:
    """The device model's report of a model's last compiled execution.

    Args:
        model: A model created in an `IPUStrategy` scope.
        mode: `"fit"`, `"evaluate"` or `"predict"`.

    Returns:
        An `ExecutionReport`: `.ipus` has one entry per IPU (`index`,
        `memory_bytes`, `memory_capacity_bytes`, `estimated_cycles`);
        `.to_dict()` gives plain data and `str()` a table.

    Raises:
        TypeError: When `model` is not a Keras model.
        ValueError: For an unknown mode, or a mode the model has not
            compiled yet.

    Example:

    >>> model.fit(x, y, batch_size=32)
    >>> print(keras_ipu.utils.execution_report(model, mode="fit"))
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"execution_report takes a Keras model, got {type(model).__name__}.")
    if mode not in run.MODES:
        raise ValueError(f"Unknown mode {mode!r}; valid modes are {list(run.MODES)}.")
    program = run.program_for(model, mode)
    if program is None or program.report is None:
        raise ValueError(
            f"The model {getattr(model, 'name', model)!r} has no compiled {mode!r} "
            f"program yet: call `model.{mode}(...)` inside the IPU system first."
        )
    return program.report


def weight_placement(model, mode: str = "fit") -> dict[str, list]:
    """Which devices hold each trainable weight in a model's compiled program.

    Replicated models hold every weight on every replica's IPU; pipelined
    models hold a stage's weights only on its IPU (on every replica).

    Args:
        model: A model created in an `IPUStrategy` scope.
        mode: The program to ask (`"fit"`, `"evaluate"`, `"predict"`).

    Returns:
        `{weight.path: [jax devices]}`; a second weight of a path already
        there (layers named alike, made after `keras.backend.clear_session()`)
        as `"path (2)"`, and so on, in the order of the program's trainable
        weights.

    Raises:
        ValueError: As `execution_report`.

    Example:

    >>> keras_ipu.utils.weight_placement(model)["sequential/dense/kernel"]
    [CpuDevice(id=0)]
    """
    execution_report(model, mode)  # the same checks
    placement: dict[str, list] = {}
    for variable, devices in run.run_for(model, mode).codec.weight_devices(model):
        key, count = variable.path, 1
        while key in placement:
            count += 1
            key = f"{variable.path} ({count})"
        placement[key] = devices
    return placement
