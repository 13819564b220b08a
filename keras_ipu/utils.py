"""General utilities: the execution report, weight placement, schedule pictures, seeds."""

from __future__ import annotations

import numbers
from typing import Any

from keras_ipu.config.enums import KeyId, SyntheticDataCategory, VerificationOptions
from keras_ipu.config.legacy import (
    auto_select_ipus,
    create_ipu_config,
    select_ipus,
    set_experimental_multi_replica_distribution_options,
    set_ipu_connection_type,
    set_ipu_model_options,
    set_recomputation_options,
    set_serialization_options,
)
from keras_ipu.config.legacy_tuning import (
    set_compilation_options,
    set_convolution_options,
    set_floating_point_behaviour_options,
    set_gcl_options,
    set_io_tile_options,
    set_matmul_options,
    set_norm_options,
    set_optimization_options,
    set_pooling_options,
    set_report_options,
    set_transfer_options,
    set_verification_options,
)
from keras_ipu.config.system import configure_ipu_system
from keras_ipu.device import system as ipu_system
from keras_ipu.keras.options import checked_flag
from keras_ipu.keras.report import execution_report, weight_placement


def reset_ipu_seed(seed: int, device: str = "/device:IPU:0", cpu_device: str = "cpu",
                   experimental_identical_replicas: bool = False) -> None:
    """Resets the seed of the random numbers drawn from now on.

    On keras_ipu the device's random numbers come from Keras' seed
    generators (dropout masks, `keras.random` calls, initializers) and the
    host's from Python and NumPy: this is `keras.utils.set_random_seed(seed)`
    after checking `device`. Layers built afterwards, weights initialised and
    data shuffled afterwards follow the seed; a layer's own seed generator
    made earlier keeps its state. Replicas draw their own random numbers
    (replica 0 those one IPU, or one pipeline, would draw), unless
    `experimental_identical_replicas` is True.

    Args:
        seed: The new seed, an integer in [0, 2**64) (Python or NumPy);
            seeds of 2**32 and more are folded to Keras' 32 bits.
        device: The IPU device the seed is for (`/device:IPU:N` of the
            configured system).
        cpu_device: The host device; accepted for compatibility.
        experimental_identical_replicas: Whether every replica draws the
            same random numbers (False: each its own, as the reference).

    Raises:
        ValueError: For a seed that is not an integer in [0, 2**64), or a
            device the configured system does not have.
        TypeError: For an `experimental_identical_replicas` that is not a
            bool (the string `"False"`, say).
        RuntimeError: When no IPU system is configured.

    Example:

    >>> keras_ipu.utils.reset_ipu_seed(42)
    """
    import keras

    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not (
            0 <= seed < 2**64):
        raise ValueError(
            f"The seed must be an integer in [0, 2**64), got {seed!r} of type "
            f"{type(seed).__name__}.")
    identical = checked_flag("experimental_identical_replicas", experimental_identical_replicas)
    ipu_system.require().ipus_of_device(device)  # raises for a device it does not have
    seed = int(seed)
    # Keras (and NumPy's global generator) take 32-bit seeds, the IPU's are 64-bit.
    keras.utils.set_random_seed(seed if seed < 2**32 else (seed ^ (seed >> 32)) & 0xFFFFFFFF)
    ipu_system.update_options(identical_replicas=identical)


def running_on_ipu_model() -> bool:
    """Whether programs run on the IPU model rather than on IPU hardware.

    Returns:
        `True`: keras_ipu's IPUs are always the device model's.

    Example:

    >>> keras_ipu.utils.running_on_ipu_model()
    True
    """
    return True


def use_synthetic_data_for(synthetic_data_category: SyntheticDataCategory) -> bool:
    """Whether synthetic data replaces the given kind of data.

    Args:
        synthetic_data_category: A `SyntheticDataCategory`.

    Returns:
        Whether `--use_synthetic_data` is on for the configured system
        (`TF_POPLAR_FLAGS` or `KERAS_IPU_FLAGS`): it replaces every category.

    Raises:
        TypeError: For anything but a `SyntheticDataCategory`.
        RuntimeError: When no IPU system is configured.

    Example:

    >>> keras_ipu.utils.use_synthetic_data_for(SyntheticDataCategory.Infeed)
    False
    """
    if not isinstance(synthetic_data_category, SyntheticDataCategory):
        raise TypeError(f"Expected a SyntheticDataCategory, got {synthetic_data_category!r}; "
                        f"valid: {', '.join(c.name for c in SyntheticDataCategory)}.")
    return bool(ipu_system.require().option("use_synthetic_data"))


def get_num_of_ipus_in_device(ipu_device: str | int, device: str = "cpu") -> int:
    """The number of IPUs of one device of the configured system.

    Args:
        ipu_device: The device, as `/device:IPU:N` or its index N.
        device: The host CPU device; accepted for compatibility.

    Returns:
        How many IPUs that device has (an `auto_select_ipus` entry, or the
        IPUs of a `select_ipus` configuration ID).

    Raises:
        ValueError: For a device the configured system does not have.
        RuntimeError: When no IPU system is configured.

    Example:

    >>> config = keras_ipu.config.IPUConfig()
    >>> config.auto_select_ipus = [1, 2]
    >>> config.configure_ipu_system()
    >>> keras_ipu.utils.get_num_of_ipus_in_device("/device:IPU:1")
    2
    """
    return len(ipu_system.require().ipus_of_device(ipu_device))


def move_variable_initialization_to_cpu(graph: Any = None) -> None:
    """Initialises variables on the host: what keras_ipu always does.

    TensorFlow 1 graphs needed this so that variable initialisers did not
    run on the IPU. Keras 3 creates and initialises every variable on the
    host and keras_ipu copies the values to the IPUs when a program first
    runs, so there is nothing to move; the function checks its argument
    and returns.

    Args:
        graph: A TensorFlow 1 graph; keras_ipu has none, so only None is
            accepted.

    Raises:
        TypeError: When `graph` is not None.

    Example:

    >>> keras_ipu.utils.move_variable_initialization_to_cpu()
    """
    if graph is not None:
        raise TypeError(
            f"move_variable_initialization_to_cpu takes no graph on keras_ipu (Keras 3 has "
            f"none; variables already start on the host), got {graph!r}."
        )


def plot_schedule(num_stages: int, gradient_accumulation_steps: int, schedule: Any = "Grouped",
                  device_mapping: Any = None, training: bool = True, path: str | None = None):
    """Draws a pipeline schedule before anything runs (each forward 1 unit, each backward 2).

    Args:
        num_stages: Pipeline stages.
        gradient_accumulation_steps: Micro-batches per pass (per weight update).
        schedule: A `keras_ipu.pipelining_ops.PipelineSchedule`, or its name.
        device_mapping: The IPU of each stage (default: stage i on IPU i).
        training: Draw backward passes too.
        path: Also save the picture there (PNG, ...).

    Returns:
        The matplotlib `Figure`.

    Raises:
        ValueError: For a schedule that cannot run with these numbers.
        ImportError: Without matplotlib (`pip install keras_ipu[plot]`).

    Example:

    >>> figure = keras_ipu.utils.plot_schedule(3, 8, "Interleaved", path="interleaved.png")
    """
    from keras_ipu.device import plot, schedules

    table = schedules.build_schedule(schedule, num_stages, gradient_accumulation_steps,
                                     device_mapping, training=training)
    minimum = schedules.minimum_micro_batches(table.schedule, num_stages)
    if gradient_accumulation_steps < minimum:  # as a fit or an inference would refuse it
        raise ValueError(
            f"{gradient_accumulation_steps} micro-batches are too few for the "
            f"{table.schedule.name} schedule of {num_stages} pipeline stages: the minimum is "
            f"{minimum}.")
    figure = plot.timeline(table)
    if path is not None:
        figure.savefig(path)
    return figure


__all__ = [
    "KeyId",
    "SyntheticDataCategory",
    "VerificationOptions",
    "auto_select_ipus",
    "configure_ipu_system",
    "create_ipu_config",
    "execution_report",
    "get_num_of_ipus_in_device",
    "move_variable_initialization_to_cpu",
    "plot_schedule",
    "reset_ipu_seed",
    "running_on_ipu_model",
    "select_ipus",
    "set_compilation_options",
    "set_convolution_options",
    "set_experimental_multi_replica_distribution_options",
    "set_floating_point_behaviour_options",
    "set_gcl_options",
    "set_io_tile_options",
    "set_ipu_connection_type",
    "set_ipu_model_options",
    "set_matmul_options",
    "set_norm_options",
    "set_optimization_options",
    "set_pooling_options",
    "set_recomputation_options",
    "set_report_options",
    "set_serialization_options",
    "set_transfer_options",
    "set_verification_options",
    "use_synthetic_data_for",
    "weight_placement",
]
