"""Configuring the IPU system from an IPUConfig, and forgetting it again.

The device layer (`keras_ipu.device`) does the work: these functions check the
config, read the environment's flags, and translate both into the device
layer's terms. The device layer is imported on first use, so importing
`keras_ipu.config` stays light and does not start JAX.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from keras_ipu.config import listing
from keras_ipu.config.flags import PoplarFlags, read_flags
from keras_ipu.config.schema import IPUConfig

# TensorFlow spellings of a host CPU device, compared in lower case.
_CPU_DEVICE_PREFIXES = ("cpu", "/cpu", "/device:cpu")

_HOW_TO_CONFIGURE = (
    "    config = keras_ipu.config.IPUConfig()\n"
    "    config.auto_select_ipus = 1\n"
    "    config.configure_ipu_system()\n"
)

# The configured IPUConfig (a private copy), or None.
_configured: IPUConfig | None = None


def configure_ipu_system(
    config: IPUConfig, device: str = "cpu", reset_configuration: bool = True
) -> None:
    """Configure an IPU system with an IPUConfig instance.

    Creates one TensorFlow-style device (`/device:IPU:0`, `/device:IPU:1`,
    ...) per entry of `config.auto_select_ipus` with that many virtual IPUs,
    or one per configuration ID of `config.select_ipus` with its IPUs (IDs as
    `gc-info -l` lists a 16-IPU system: 0-15 one IPU, 16-23 two, 24-27 four,
    28-29 eight, 30 sixteen; `keras_ipu.config.listing`).
    Virtual IPUs are mapped onto JAX devices in `config.selection_order`; each
    models the hardware `config.ipu_model.version` with
    `config.ipu_model.tiles_per_ipu` tiles (0: `--ipu_model_tiles` from the
    flags, else the version's standard count). The flags in
    `TF_POPLAR_FLAGS` and `KERAS_IPU_FLAGS` are read now: with
    `--executable_cache_path=DIR`, compiled programs are saved in `DIR` and a
    later process loads them instead of compiling (JAX's persistent
    compilation cache, see `keras_ipu.device.executable_cache`); without
    it, a cache that an earlier configuration turned on is turned off.

    Args:
        config: An `IPUConfig` instance. The reference also took an
            `IpuOptions` protobuf; keras_ipu has none.
        device: The TensorFlow virtual CPU device which is local to the IPU
            hardware, e.g. `"cpu"` or `"/device:CPU:0"`. No other effect.
        reset_configuration: Whether to reset any existing IPU configuration.
            When False and a system is already configured, raises.

    Returns:
        None

    Raises:
        TypeError: When `config` is not an `IPUConfig`.
        ValueError: When neither or both of `auto_select_ipus` and
            `select_ipus` are set, selected configurations share IPUs,
            options contradict each other (`_COMBINATION_RULES`),
            `device` is not a CPU device, a value
            changed in place (a list or dict read back and edited) is
            invalid, or the `--executable_cache_path` directory cannot be
            created.
        RuntimeError: When a system is configured and `reset_configuration`
            is False, or when the JAX devices cannot hold the IPUs (from the
            device layer, unchanged).

    Warns:
        UserWarning: When `--executable_cache_path` replaces a different JAX
            compilation cache directory set by the program or environment.

    Example:

    ```python
    config = IPUConfig()
    config.auto_select_ipus = [1, 2]   # /device:IPU:0 with 1 IPU, :1 with 2
    configure_ipu_system(config)
    ```
    """
    global _configured
    if not isinstance(config, IPUConfig):
        raise TypeError(
            f"configure_ipu_system expects an IPUConfig, got {config!r} of type "
            f"{type(config).__name__}. Create one with keras_ipu.config.IPUConfig()."
        )
    _check_device(device)
    config._validate()
    _check_combinations(config)
    device_sizes = _device_sizes(config)
    flags = read_flags()

    from keras_ipu.device import executable_cache, hardware, system
    from keras_ipu.distributed import runtime

    # An instance of a multi-instance job joins it before its devices start:
    # its IPUs are then its own devices, and replicas span all instances'.
    runtime.initialize()
    if config.device_connection.type.name not in ("NEVER", "PRE_COMPILE"):  # runs programs
        _check_job(config.experimental.multi_replica_distribution, runtime)

    if not reset_configuration and system.current() is not None:
        raise RuntimeError(
            "An IPU system is already configured. Call "
            "keras_ipu.config.reset_ipu_configuration() first, or pass "
            "reset_configuration=True."
        )
    # Before the old system is forgotten, so that impossible tile counts, or a
    # cache directory that cannot be created, leave the configuration as it
    # was. Not through reset_ipu_configuration, which would take the cache
    # away and put it back when the flag is unchanged.
    tiles = int(config.ipu_model.tiles_per_ipu or flags.ipu_model_tiles or 0)
    ipu_hardware = hardware.hardware_for(config.ipu_model.version, tiles,
                                         int(config.io_tiles.num_io_tiles))
    cache_directory = executable_cache.use(flags.executable_cache_path)
    _forget_system()
    system.configure(
        device_sizes,
        ipu_hardware,
        selection_order=config.selection_order.name,
        options={**_runtime_options(config, flags), "executable_cache_path": cache_directory},
    )
    _configured = copy.deepcopy(config)


def reset_ipu_configuration() -> None:
    """Reset the IPU configuration in preparation for it to be reconfigured.

    Forgets the configured system (through the device layer's
    `keras_ipu.device.system.reset()`) and the IPUConfig it was configured
    with; the next model run needs `configure_ipu_system` again. The
    executable cache of `--executable_cache_path` is turned off (JAX's own
    cache settings are put back); what it saved stays on disk.

    Returns:
        None

    Example:

    ```python
    reset_ipu_configuration()
    config.configure_ipu_system()
    ```
    """
    from keras_ipu.device import executable_cache

    _forget_system()
    executable_cache.use(None)


def _forget_system() -> None:
    global _configured
    from keras_ipu.device import system

    system.reset()
    _configured = None


def get_ipu_config(session: Any = None) -> IPUConfig:
    """Get the configuration of the IPU system.

    The reference returned a list of `IpuOptions` protobufs, one per
    PoplarExecutor; keras_ipu returns the `IPUConfig` the system was
    configured with.

    Args:
        session: Accepted for compatibility with TensorFlow 1 code; ignored.

    Returns:
        A copy of the configured `IPUConfig`; changing it changes nothing
        until it is configured again.

    Raises:
        RuntimeError: When no IPU system is configured (or it was reset,
            also through the device layer).

    Example:

    ```python
    config.auto_select_ipus = 2
    config.configure_ipu_system()
    get_ipu_config().auto_select_ipus   # 2
    ```
    """
    global _configured
    del session  # No sessions in keras_ipu.
    from keras_ipu.device import system

    # The device layer can also be reset directly; its state is the truth.
    if system.current() is None:
        _configured = None
    if _configured is None:
        raise RuntimeError(
            "No IPU system is configured. Configure one first, e.g.:\n\n" + _HOW_TO_CONFIGURE
        )
    return copy.deepcopy(_configured)


def _check_device(device: Any) -> None:
    if not (isinstance(device, str) and device.lower().startswith(_CPU_DEVICE_PREFIXES)):
        raise ValueError(
            f"device must name the host CPU device, such as 'cpu' or '/device:CPU:0', "
            f"got {device!r}."
        )


# Options that are each valid but not together, as the reference refuses them
# when it configures: (is the combination invalid?, what to say).
_COMBINATION_RULES: tuple[tuple[Callable[[IPUConfig], bool], Callable[[IPUConfig], str]], ...] = (
    (lambda c: c.device_connection.type.name in ("PRE_COMPILE", "NEVER")
     and not c.device_connection.version,
     lambda c: f"device_connection.version must be set when device_connection.type is "
               f"{c.device_connection.type.name}: the hardware to compile for, one of "
               f"'ipu1', 'ipu2' or 'ipu21'."),
    (lambda c: c.norms.experimental.distributed_batch_norm_replica_group_size > 1
     and c.io_tiles.num_io_tiles > 0,
     lambda c: f"norms.experimental.distributed_batch_norm_replica_group_size "
               f"({c.norms.experimental.distributed_batch_norm_replica_group_size}) is not "
               f"supported with I/O tiles (io_tiles.num_io_tiles={c.io_tiles.num_io_tiles}); "
               f"set one of them back to its default."),
    (lambda c: c.io_tiles.place_ops_on_io_tiles and c.io_tiles.num_io_tiles == 0,
     lambda c: "io_tiles.place_ops_on_io_tiles needs I/O tiles: set io_tiles.num_io_tiles "
               "to a positive number of tiles."),
    (lambda c: c.experimental.multi_replica_distribution.process_count > 0
     and not (0 <= c.experimental.multi_replica_distribution.process_index
              < c.experimental.multi_replica_distribution.process_count),
     lambda c: f"experimental.multi_replica_distribution.process_index "
               f"({c.experimental.multi_replica_distribution.process_index}) must be in "
               f"[0, process_count) = [0, "
               f"{c.experimental.multi_replica_distribution.process_count})."),
)


def _check_job(distribution: Any, runtime: Any) -> None:
    """Refuses a multi-replica distribution that is not this job's (a PopDist port started
    with plain `python` would train alone, with a smaller global batch)."""
    count, index = int(distribution.process_count), int(distribution.process_index)
    if not count:
        return
    instances, instance = runtime.num_instances(), runtime.instance_index()
    if (count, index) == (instances, instance):
        return
    remedy = (f"Start the job with `keras-ipu run --num-instances {count} ...`, or leave "
              f"process_count at 0 for one process" if count != instances else
              "Set process_index to each instance's own, "
              "`keras_ipu.distributed.instance_index()`")
    raise ValueError(
        f"experimental.multi_replica_distribution says process {index} of {count}, but this "
        f"is instance {instance} of a job of {instances} instance(s). {remedy} "
        f"(`keras_ipu.distributed.update_ipu_config(config)` sets both from the job).")


def _check_combinations(config: IPUConfig) -> None:
    for invalid, message in _COMBINATION_RULES:
        if invalid(config):
            raise ValueError(message(config))


def _is_set(selection: Any) -> bool:
    # An int is set even when it is 0 (select_ipus = 0 picks index 0); a list
    # or tuple is set when it is not empty.
    return not isinstance(selection, (list, tuple)) or len(selection) > 0


def _device_sizes(config: IPUConfig) -> tuple[int, ...]:
    auto, select = config.auto_select_ipus, config.select_ipus
    if _is_set(auto) and _is_set(select):
        raise ValueError(
            f"Only one of auto_select_ipus and select_ipus may be set, got "
            f"auto_select_ipus={auto!r} and select_ipus={select!r}. Reset one of them "
            f"to [] (not set)."
        )
    if _is_set(auto):
        return tuple(int(n) for n in _as_list(auto))
    if _is_set(select):
        return listing.device_sizes([int(i) for i in _as_list(select)])
    raise ValueError(
        "No IPUs requested: set `auto_select_ipus` (or `select_ipus`) before "
        "configuring the system, e.g. `config.auto_select_ipus = 1`."
    )


def _as_list(selection: Any) -> list:
    return list(selection) if isinstance(selection, (list, tuple)) else [selection]


def _runtime_options(config: IPUConfig, flags: PoplarFlags) -> dict[str, Any]:
    # What the device layer's runtime reads; everything else in the config
    # has no effect on the device model.
    return {
        "allow_recompute": config.allow_recompute,
        "device_connection_type": config.device_connection.type.name,
        "use_synthetic_data": flags.use_synthetic_data,
        "synthetic_data_initializer": flags.synthetic_data_initializer,
        "executable_cache_path": flags.executable_cache_path,
        "execution_loop": flags.execution_loop,
        "xla_compiler_options": flags.xla_compiler_options,
        "background_loop_compile": flags.background_loop_compile,
        "distributed_batch_norm_replica_group_size":
            config.norms.experimental.distributed_batch_norm_replica_group_size,
        "floating_point_exceptions": _trapped_exceptions(config.floating_point_behaviour),
    }


def _trapped_exceptions(behaviour: Any) -> tuple[str, ...]:
    # `set_all` sets every option, as the reference does when configuring.
    return tuple(name for name in ("inv", "div0", "oflo")
                 if behaviour.set_all or getattr(behaviour, name))
