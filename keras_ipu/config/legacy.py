"""The configuration functions IPU TensorFlow had before `IPUConfig` (SDK 2.0).

Code written for SDK 2.0 built an `IpuOptions` protobuf with
`create_ipu_config()` and changed it with `auto_select_ipus`, `select_ipus`
and `set_*_options` functions from `ipu.utils`. Here those functions build and
change an `IPUConfig`: each argument sets the attribute the reference's
"API changes for SDK 2.1" maps it to, so the result configures the same
system as the `IPUConfig` code it stands for, and prints, compares and
serialises like one. Arguments with no `IPUConfig` attribute (the Poplar
profiling switches, verified transfers) are validated and have no effect.

Each function validates all its arguments before it changes anything, and
names the argument an error is about. Like the reference, it changes the
config it is given and returns it; each warns that it is deprecated.
This module holds the helper, `create_ipu_config` and the system-level
functions; `legacy_tuning` holds the compiler-tuning ones.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from keras_ipu.config.enums import (
    DeviceConnectionType,
    ExecutionProfileType,
    SchedulingAlgorithm,
    SelectionOrder,
)
from keras_ipu.config.schema import IPUConfig

# What an argument is: the IPUConfig option it sets, and the value to set.
Assignment = tuple[str, Any]


def warn_deprecated(function: str) -> None:
    """Warns that an SDK 2.0 configuration function is deprecated, at the user's call.

    Python's warning filters decide how often it shows (by default once per
    calling line, and only in `__main__`, as for any DeprecationWarning).
    """
    # Point the warning at the first frame outside keras_ipu.config, however
    # deep the legacy function's helpers go.
    frame, stacklevel = sys._getframe(), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(__package__):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(
        f"keras_ipu.utils.{function} is deprecated, as in IPU TensorFlow since SDK 2.1: "
        f"set the attributes of a keras_ipu.config.IPUConfig instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def assign(opts: Any, function: str, assignments: Mapping[str, Assignment]) -> IPUConfig:
    """Sets IPUConfig options from a legacy function's arguments, all or none.

    Args:
        opts: The config to change; must be an `IPUConfig`.
        function: The legacy function's name, for messages.
        assignments: Argument name -> (IPUConfig option path, value).

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When `opts` is not an `IPUConfig`, or a value has the
            wrong type; the message names the argument.
        ValueError: When a value is out of range; the message names the
            argument.
    """
    require_config(opts, function)
    trial = copy.deepcopy(opts)
    for argument, (path, value) in assignments.items():
        try:
            _set_option(trial, path, value)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{function}({argument}={value!r}): {error}") from None
    for path, value in assignments.values():
        _set_option(opts, path, copy.deepcopy(value))
    warn_deprecated(function)
    return opts


def require_config(opts: Any, function: str) -> None:
    """Raises TypeError unless `opts` is an IPUConfig (what `create_ipu_config` returns)."""
    if not isinstance(opts, IPUConfig):
        raise TypeError(
            f"{function} takes the config create_ipu_config() returns (a "
            f"keras_ipu.config.IPUConfig), got {type(opts).__name__}: {opts!r}."
        )


def check_kind(function: str, argument: str, value: Any, kinds: tuple[type, ...]) -> None:
    """Raises TypeError naming the argument when `value` is none of `kinds` (bools are not ints)."""
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(kind.__name__ if kind is not type(None) else "None" for kind in kinds)
        raise TypeError(f"{function}({argument}=...) must be {names}, got {value!r}.")


def merged_options(
    opts: Any, function: str, argument: str, path: str, options: Mapping[str, Any] | None
) -> Assignment:
    """The Poplar options at `path` with `options` added, as the reference appends them."""
    require_config(opts, function)
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise TypeError(
            f"{function}({argument}=...) must be a dictionary of Poplar option names to "
            f"values, got {options!r}."
        )
    return path, {**_get_option(opts, path), **options}


def _get_option(config: IPUConfig, path: str) -> Any:
    for name in path.split("."):
        config = getattr(config, name)
    return config


def _set_option(config: IPUConfig, path: str, value: Any) -> None:
    *categories, name = path.split(".")
    setattr(_get_option(config, ".".join(categories)) if categories else config, name, value)


# create_ipu_config's arguments that the Poplar profiler read. SDK 2.1 moved
# profiling to POPLAR_ENGINE_OPTIONS and IPUConfig has no attribute for them;
# keras_ipu's execution report is always there (keras_ipu.utils.execution_report).
_PROFILING_KINDS: dict[str, tuple[type, ...]] = {
    "profiling": (bool,),
    "enable_ipu_events": (bool,),
    "use_poplar_text_report": (bool,),
    "use_poplar_cbor_report": (bool,),
    "profile_execution": (bool, ExecutionProfileType, type(None)),
    "enable_poplar_serialized_graph": (bool,),
    "report_every_nth_execution": (int,),
    "max_report_size": (int,),
    "report_directory": (str,),
    "retain_control_dependencies": (bool,),
}


def _check_profiling(arguments: Mapping[str, Any]) -> None:
    for argument, kinds in _PROFILING_KINDS.items():
        check_kind("create_ipu_config", argument, arguments[argument], kinds)
    if arguments["profiling"] and arguments["enable_ipu_events"]:
        raise ValueError(
            "create_ipu_config: profiling=True and enable_ipu_events=True are mutually "
            "exclusive; profiling already includes the IPU events."
        )
    profile = arguments["profile_execution"]
    if profile not in (None, False, ExecutionProfileType.NO_PROFILE) and not arguments["profiling"]:
        raise ValueError(
            f"create_ipu_config: profile_execution={arguments['profile_execution']!r} needs "
            f"profiling=True."
        )
    for argument in ("report_every_nth_execution", "max_report_size"):
        if arguments[argument] < 0:
            raise ValueError(f"create_ipu_config({argument}={arguments[argument]!r}) must be >= 0.")


def create_ipu_config(
    profiling: bool = False,
    enable_ipu_events: bool = False,
    use_poplar_text_report: bool = False,
    use_poplar_cbor_report: bool = False,
    profile_execution: bool | ExecutionProfileType | None = None,
    enable_poplar_serialized_graph: bool = False,
    report_every_nth_execution: int = 0,
    max_report_size: int = 0x10000000,
    report_directory: str = "",
    scheduler_selection: SchedulingAlgorithm | str = SchedulingAlgorithm.CHOOSE_BEST,
    always_rearrange_copies_on_the_host: bool = False,
    merge_infeed_io_copies: bool = False,
    disable_graph_outlining: bool = False,
    retain_control_dependencies: bool = False,
    max_cross_replica_sum_buffer_size: int = 0,
    max_inter_ipu_copies_buffer_size: int = 0,
    max_scheduler_lookahead_depth: int = 5,
    max_scheduler_search_space_size: int = 64,
    prefetch_data_streams: bool = True,
    selection_order: SelectionOrder | None = SelectionOrder.AUTO,
    enable_experimental_remote_buffer_embedding: bool = False,
) -> IPUConfig:
    """Creates an IPU configuration, the SDK 2.0 way (deprecated).

    Returns an `IPUConfig` where the reference returned an `IpuOptions`
    protobuf; select its IPUs with `auto_select_ipus` or `select_ipus`, then
    pass it to `configure_ipu_system`. The scheduling, outlining, buffer
    size, prefetch, selection order and remote-buffer arguments set the
    `IPUConfig` attributes of the same meaning (`disable_graph_outlining`
    clears `optimizations.enable_graph_outlining`). The profiling arguments
    (`profiling` to `report_directory`) and `retain_control_dependencies`
    have no `IPUConfig` attribute: they are validated and have no effect;
    the execution report is `keras_ipu.utils.execution_report`.

    Args:
        profiling: Poplar compilation reports and trace events.
        enable_ipu_events: IPU trace events without Poplar reports.
        use_poplar_text_report: The Poplar text report.
        use_poplar_cbor_report: The Poplar CBOR report.
        profile_execution: Execution profiles: a bool or an
            `ExecutionProfileType`; needs `profiling`.
        enable_poplar_serialized_graph: The serialized Poplar graph.
        report_every_nth_execution: Report every Nth execution (0: once).
        max_report_size: The largest report to include, in bytes.
        report_directory: Where reports would be written.
        scheduler_selection: A `SchedulingAlgorithm` (`""`, as older SDKs
            wrote it: `CHOOSE_BEST`).
        always_rearrange_copies_on_the_host: Rearrange streamed data on the host.
        merge_infeed_io_copies: Merge the infeed's host-to-device copies.
        disable_graph_outlining: Turn off the outlining of repeated code.
        retain_control_dependencies: Keep TensorFlow control dependencies.
        max_cross_replica_sum_buffer_size: Bytes held before a cross-replica sum.
        max_inter_ipu_copies_buffer_size: Bytes held before an inter-IPU copy.
        max_scheduler_lookahead_depth: The scheduler's lookahead depth.
        max_scheduler_search_space_size: The scheduler's search space size.
        prefetch_data_streams: Prefetch the infeed while the IPU computes.
        selection_order: A `SelectionOrder` (None: `AUTO`).
        enable_experimental_remote_buffer_embedding: Remote buffers for
            host embeddings.

    Returns:
        A new `IPUConfig` with no IPUs selected yet.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For an argument out of range, `profiling` with
            `enable_ipu_events`, or `profile_execution` without `profiling`.

    Example:

    ```python
    opts = ipu.utils.create_ipu_config()
    opts = ipu.utils.auto_select_ipus(opts, num_ipus=2)
    ipu.utils.configure_ipu_system(opts)
    ```
    """
    arguments = dict(locals())
    _check_profiling(arguments)
    return assign(
        IPUConfig(),
        "create_ipu_config",
        {
            "scheduler_selection": (
                "scheduling.algorithm",
                # Older SDKs spelled the default as "" (choose the best).
                SchedulingAlgorithm.CHOOSE_BEST
                if scheduler_selection == ""
                else scheduler_selection,
            ),
            "always_rearrange_copies_on_the_host": (
                "experimental.always_rearrange_copies_on_the_host",
                always_rearrange_copies_on_the_host,
            ),
            "merge_infeed_io_copies": (
                "optimizations.merge_infeed_io_copies",
                merge_infeed_io_copies,
            ),
            "disable_graph_outlining": (
                "optimizations.enable_graph_outlining",
                _negated("create_ipu_config", "disable_graph_outlining", disable_graph_outlining),
            ),
            "max_cross_replica_sum_buffer_size": (
                "optimizations.maximum_cross_replica_sum_buffer_size",
                max_cross_replica_sum_buffer_size,
            ),
            "max_inter_ipu_copies_buffer_size": (
                "optimizations.maximum_inter_ipu_copies_buffer_size",
                max_inter_ipu_copies_buffer_size,
            ),
            "max_scheduler_lookahead_depth": (
                "scheduling.maximum_scheduler_lookahead_depth",
                max_scheduler_lookahead_depth,
            ),
            "max_scheduler_search_space_size": (
                "scheduling.maximum_scheduler_search_space_size",
                max_scheduler_search_space_size,
            ),
            "prefetch_data_streams": ("optimizations.prefetch_data_streams", prefetch_data_streams),
            "selection_order": (
                "selection_order",
                SelectionOrder.AUTO if selection_order is None else selection_order,
            ),
            "enable_experimental_remote_buffer_embedding": (
                "experimental.enable_remote_buffer_embedding",
                enable_experimental_remote_buffer_embedding,
            ),
        },
    )


def _negated(function: str, argument: str, value: Any) -> bool:
    check_kind(function, argument, value, (bool,))
    return not value


def _check_unselected(opts: IPUConfig, function: str) -> None:
    require_config(opts, function)
    chosen = {
        name: getattr(opts, name)
        for name in ("auto_select_ipus", "select_ipus")
        if getattr(opts, name) not in ([], ())
    }
    if chosen:
        raise ValueError(
            f"{function}: this config already selects its IPUs ("
            + ", ".join(f"{name}={value!r}" for name, value in chosen.items())
            + "); start again from create_ipu_config()."
        )


def auto_select_ipus(opts: IPUConfig, num_ipus: int | list[int] | tuple[int, ...]) -> IPUConfig:
    """Selects IPUs by count, one device per entry (deprecated).

    Sets `IPUConfig.auto_select_ipus`: `num_ipus=[2, 2]` makes two devices,
    `/device:IPU:0` and `/device:IPU:1`, of two IPUs each.

    Args:
        opts: The config from `create_ipu_config`.
        num_ipus: IPUs per device: an int for one device, or a list.

    Returns:
        `opts`, with its IPUs selected.

    Raises:
        TypeError: When `opts` is not such a config, or `num_ipus` is not an
            int or a list of ints.
        ValueError: When a count is below 1, or `opts` already selects IPUs.

    Example:

    ```python
    opts = ipu.utils.auto_select_ipus(ipu.utils.create_ipu_config(), [1, 2])
    ```
    """
    _check_unselected(opts, "auto_select_ipus")
    return assign(opts, "auto_select_ipus", {"num_ipus": ("auto_select_ipus", num_ipus)})


def select_ipus(opts: IPUConfig, indices: int | list[int] | tuple[int, ...]) -> IPUConfig:
    """Selects IPUs by gc-info configuration ID, one device per ID (deprecated).

    Sets `IPUConfig.select_ipus`: IDs 0-15 are single IPUs of a 16-IPU
    system, 16-23 pairs, 24-27 fours, 28-29 eights and 30 all sixteen, as in
    the reference's `gc-info -l` listing.

    Args:
        opts: The config from `create_ipu_config`.
        indices: The configuration IDs, one per device.

    Returns:
        `opts`, with its IPUs selected.

    Raises:
        TypeError: When `opts` is not such a config, or `indices` is not an
            int or a list of ints.
        ValueError: When an ID is outside 0-30 or repeated, or `opts`
            already selects IPUs. IDs whose IPUs overlap are refused by
            `configure_ipu_system`.

    Example:

    ```python
    opts = ipu.utils.select_ipus(ipu.utils.create_ipu_config(), [24, 25])
    ```
    """
    _check_unselected(opts, "select_ipus")
    return assign(opts, "select_ipus", {"indices": ("select_ipus", indices)})


def set_ipu_connection_type(
    opts: IPUConfig,
    connection_type: DeviceConnectionType | None = DeviceConnectionType.ALWAYS,
    ipu_version: str | int = "",
    enable_remote_buffers: bool = False,
) -> IPUConfig:
    """Sets when to attach to the device (deprecated).

    Sets `device_connection.type`, `.version` and `.enable_remote_buffers`.
    With `PRE_COMPILE` programs are compiled (and cached) but not run.

    Args:
        opts: The config from `create_ipu_config`.
        connection_type: A `DeviceConnectionType` (None: `ALWAYS`).
        ipu_version: `"ipu1"`, `"ipu2"`, `"ipu21"` or `""`; older SDKs'
            numbers 1, 2 and 21 name the same versions.
        enable_remote_buffers: Whether the executing system has remote buffers.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For an unknown IPU version.

    Example:

    ```python
    opts = ipu.utils.set_ipu_connection_type(
        opts, ipu.config.DeviceConnectionType.PRE_COMPILE, ipu_version="ipu2")
    ```
    """
    return assign(
        opts,
        "set_ipu_connection_type",
        {
            "connection_type": (
                "device_connection.type",
                DeviceConnectionType.ALWAYS if connection_type is None else connection_type,
            ),
            "ipu_version": (
                "device_connection.version",
                f"ipu{ipu_version}"
                if isinstance(ipu_version, int) and not isinstance(ipu_version, bool)
                else ipu_version,
            ),
            "enable_remote_buffers": (
                "device_connection.enable_remote_buffers",
                enable_remote_buffers,
            ),
        },
    )


def set_ipu_model_options(
    opts: IPUConfig,
    compile_ipu_code: bool = True,
    tiles_per_ipu: int | None = None,
    ipu_model_version: str = "ipu2",
) -> IPUConfig:
    """Sets the IPU model's options (deprecated).

    Sets `ipu_model.compile_ipu_code`, `.tiles_per_ipu` (left as it is when
    None) and `.version`; the tile count and version size the modelled IPU.

    Args:
        opts: The config from `create_ipu_config`.
        compile_ipu_code: Whether to compile real IPU code for modelling.
        tiles_per_ipu: Tiles per modelled IPU, or None.
        ipu_model_version: `"ipu1"`, `"ipu2"` or `"ipu21"`.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For a tile count or version the model does not have.

    Example:

    ```python
    opts = ipu.utils.set_ipu_model_options(opts, tiles_per_ipu=8)
    ```
    """
    assignments = {
        "compile_ipu_code": ("ipu_model.compile_ipu_code", compile_ipu_code),
        "ipu_model_version": ("ipu_model.version", ipu_model_version),
    }
    if tiles_per_ipu is not None:
        assignments["tiles_per_ipu"] = ("ipu_model.tiles_per_ipu", tiles_per_ipu)
    return assign(opts, "set_ipu_model_options", assignments)


def set_experimental_multi_replica_distribution_options(
    opts: IPUConfig, process_count: int, process_index: int
) -> IPUConfig:
    """Sets this process's share of a multi-process replicated program (deprecated).

    Sets `experimental.multi_replica_distribution.process_count` and
    `.process_index`.

    Args:
        opts: The config from `create_ipu_config`.
        process_count: The number of processes.
        process_index: This process's index, below `process_count`.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For a negative count, or an index not below the count.

    Example:

    ```python
    opts = ipu.utils.set_experimental_multi_replica_distribution_options(opts, 2, 0)
    ```
    """
    function = "set_experimental_multi_replica_distribution_options"
    require_config(opts, function)
    for argument, value in (("process_count", process_count), ("process_index", process_index)):
        check_kind(function, argument, value, (int,))
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"{function}: process_index={process_index} must be in [0, process_count="
            f"{process_count})."
        )
    return assign(
        opts,
        function,
        {
            "process_count": (
                "experimental.multi_replica_distribution.process_count",
                process_count,
            ),
            "process_index": (
                "experimental.multi_replica_distribution.process_index",
                process_index,
            ),
        },
    )


def set_recomputation_options(opts: IPUConfig, allow_recompute: bool = True) -> IPUConfig:
    """Turns recomputation in the backward pass on or off (deprecated).

    Sets `IPUConfig.allow_recompute`: pipeline stages recompute their
    activations instead of stashing them.

    Args:
        opts: The config from `create_ipu_config`.
        allow_recompute: Whether to recompute.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When `allow_recompute` is not a bool.

    Example:

    ```python
    opts = ipu.utils.set_recomputation_options(opts)
    ```
    """
    return assign(
        opts,
        "set_recomputation_options",
        {
            "allow_recompute": ("allow_recompute", allow_recompute),
        },
    )


def set_serialization_options(opts: IPUConfig, output_folder: str = "") -> IPUConfig:
    """Sets where compiled executables would be written (deprecated).

    Sets `IPUConfig.serialization_output_folder`, which has no effect on
    the device model; `--executable_cache_path` keeps compiled programs.

    Args:
        opts: The config from `create_ipu_config`.
        output_folder: The folder, or `""` for none.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When `output_folder` is not a string.

    Example:

    ```python
    opts = ipu.utils.set_serialization_options(opts, "/tmp/my_network")
    ```
    """
    return assign(
        opts,
        "set_serialization_options",
        {
            "output_folder": ("serialization_output_folder", output_folder),
        },
    )
