"""The SDK 2.0 functions that tune the compiler, on an `IPUConfig` (deprecated).

See `keras_ipu.config.legacy` for how these functions map onto `IPUConfig`.
The Poplar option dictionaries (`compilation_options`, `matmul_options`, ...)
are added to those the config already holds, as the reference appended them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keras_ipu.config.enums import MergeRemoteBuffersBehaviour, VerificationOptions
from keras_ipu.config.legacy import (
    assign,
    check_kind,
    merged_options,
    require_config,
    warn_deprecated,
)
from keras_ipu.config.schema import IPUConfig


def _add_poplar_options(
    opts: Any, function: str, argument: str, path: str, options: Mapping[str, Any] | None
) -> IPUConfig:
    return assign(
        opts, function, {argument: merged_options(opts, function, argument, path, options)}
    )


def set_compilation_options(
    opts: IPUConfig, compilation_options: Mapping[str, Any] | None = None
) -> IPUConfig:
    """Adds Poplar options for the engine's compilation (deprecated).

    Adds `compilation_options` to the config's `compilation_poplar_options`. Poplar options tune the
    Poplar compiler: on the device model they are validated and have no
    other effect.

    Args:
        opts: The config from `create_ipu_config`.
        compilation_options: A dictionary of Poplar option names to values, or None to
            add nothing.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When `opts` is not such a config or `compilation_options` is not a
            dictionary.
        ValueError: For an `availableMemoryProportion` outside [0, 1], where
            the config checks it.

    Example:

    ```python
    opts = ipu.utils.set_compilation_options(opts, {"debug.instrument": "true"})
    ```
    """
    return _add_poplar_options(
        opts,
        "set_compilation_options",
        "compilation_options",
        "compilation_poplar_options",
        compilation_options,
    )


def set_convolution_options(
    opts: IPUConfig, convolution_options: Mapping[str, Any] | None = None
) -> IPUConfig:
    """Adds Poplar options for convolutions (deprecated).

    Adds `convolution_options` to the config's `convolutions.poplar_options`.
    Poplar options tune the Poplar compiler: on the device model they are
    validated and have no other effect.

    Args:
        opts: The config from `create_ipu_config`.
        convolution_options: A dictionary of Poplar option names to values, or None to
            add nothing.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When `opts` is not such a config or `convolution_options` is not a
            dictionary.
        ValueError: For an `availableMemoryProportion` outside [0, 1], where
            the config checks it.

    Example:

    ```python
    opts = ipu.utils.set_convolution_options(opts, {"availableMemoryProportion": "0.1"})
    ```
    """
    return _add_poplar_options(
        opts,
        "set_convolution_options",
        "convolution_options",
        "convolutions.poplar_options",
        convolution_options,
    )


def set_pooling_options(
    opts: IPUConfig, pooling_options: Mapping[str, Any] | None = None
) -> IPUConfig:
    """Adds Poplar options for pooling (deprecated).

    Adds `pooling_options` to the config's `pooling.poplar_options`. Poplar options tune the
    Poplar compiler: on the device model they are validated and have no
    other effect.

    Args:
        opts: The config from `create_ipu_config`.
        pooling_options: A dictionary of Poplar option names to values, or None to
            add nothing.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When `opts` is not such a config or `pooling_options` is not a
            dictionary.
        ValueError: For an `availableMemoryProportion` outside [0, 1], where
            the config checks it.

    Example:

    ```python
    opts = ipu.utils.set_pooling_options(opts, {"poolUseIntrospectiveMapping": "false"})
    ```
    """
    return _add_poplar_options(
        opts, "set_pooling_options", "pooling_options", "pooling.poplar_options", pooling_options
    )


def set_gcl_options(opts: IPUConfig, gcl_options: Mapping[str, Any] | None = None) -> IPUConfig:
    """Adds Poplar options for the collectives of the Graphcore Communication Library (deprecated).

    Adds `gcl_options` to the config's `gcl_poplar_options`. Poplar options tune the
    Poplar compiler: on the device model they are validated and have no
    other effect.

    Args:
        opts: The config from `create_ipu_config`.
        gcl_options: A dictionary of Poplar option names to values, or None to
            add nothing.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When `opts` is not such a config or `gcl_options` is not a
            dictionary.
        ValueError: For an `availableMemoryProportion` outside [0, 1], where
            the config checks it.

    Example:

    ```python
    opts = ipu.utils.set_gcl_options(opts, {"syncful.maxBroadcastSize": "1024"})
    ```
    """
    return _add_poplar_options(
        opts, "set_gcl_options", "gcl_options", "gcl_poplar_options", gcl_options
    )


def set_matmul_options(
    opts: IPUConfig, matmul_options: Mapping[str, Any] | None = None, clear_pass_type: bool = False
) -> IPUConfig:
    """Adds Poplar options for matrix multiplications (deprecated).

    Adds `matmul_options` to `matmuls.poplar_options` and sets
    `matmuls.clear_pass_type`; neither changes the device model beyond
    validation.

    Args:
        opts: The config from `create_ipu_config`.
        matmul_options: A dictionary of Poplar option names to values, or
            None to add nothing.
        clear_pass_type: Whether to leave the pass type out of the options.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For an `availableMemoryProportion` outside [0, 1].

    Example:

    ```python
    opts = ipu.utils.set_matmul_options(opts, {"availableMemoryProportion": "0.5"})
    ```
    """
    path = "matmuls.poplar_options"
    return assign(
        opts,
        "set_matmul_options",
        {
            "matmul_options": merged_options(
                opts, "set_matmul_options", "matmul_options", path, matmul_options
            ),
            "clear_pass_type": ("matmuls.clear_pass_type", clear_pass_type),
        },
    )


def set_norm_options(
    opts: IPUConfig,
    use_stable_statistics: bool = False,
    experimental_distributed_batch_norm_replica_group_size: int = 1,
) -> IPUConfig:
    """Sets the normalisation options (deprecated).

    Sets `norms.use_stable_statistics` and
    `norms.experimental.distributed_batch_norm_replica_group_size`.

    Args:
        opts: The config from `create_ipu_config`.
        use_stable_statistics: Subtract the mean before computing the variance.
        experimental_distributed_batch_norm_replica_group_size: Replicas
            whose batch statistics are combined.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For a group size below 1.

    Example:

    ```python
    opts = ipu.utils.set_norm_options(opts, use_stable_statistics=True)
    ```
    """
    group = experimental_distributed_batch_norm_replica_group_size
    return assign(
        opts,
        "set_norm_options",
        {
            "use_stable_statistics": ("norms.use_stable_statistics", use_stable_statistics),
            "experimental_distributed_batch_norm_replica_group_size": (
                "norms.experimental.distributed_batch_norm_replica_group_size",
                group,
            ),
        },
    )


# set_optimization_options' argument -> its IPUConfig option under `optimizations`.
_OPTIMIZATION_OPTIONS = {
    "combine_embedding_lookups": "combine_embedding_lookups",
    "combine_matmuls": "combine_matmuls",
    "max_cross_replica_sum_buffer_size": "maximum_cross_replica_sum_buffer_size",
    "max_reduce_scatter_buffer_size": "maximum_reduce_scatter_buffer_size",
    "max_inter_ipu_copies_buffer_size": "maximum_inter_ipu_copies_buffer_size",
    "max_send_recv_cluster_size": "maximum_send_recv_cluster_size",
    "minimum_remote_tensor_size": "minimum_remote_tensor_size",
    "merge_remote_buffers": "merge_remote_buffers",
    "gather_simplifier": "enable_gather_simplifier",
    "triangular_solve_expander_block_size": "triangular_solve_expander_block_size",
    "cholesky_block_size": "cholesky_block_size",
    "enable_fast_math": "enable_fast_math",
}


_MERGE_REMOTE_BUFFERS = {
    True: MergeRemoteBuffersBehaviour.MERGE,
    False: MergeRemoteBuffersBehaviour.NO_MERGING,
    None: MergeRemoteBuffersBehaviour.IF_BENEFICIAL,
}


def set_optimization_options(
    opts: IPUConfig,
    combine_embedding_lookups: bool = False,
    combine_matmuls: bool = False,
    max_cross_replica_sum_buffer_size: int = 0,
    max_reduce_scatter_buffer_size: int = 0,
    max_inter_ipu_copies_buffer_size: int = 0,
    max_send_recv_cluster_size: int = 0,
    minimum_remote_tensor_size: int = 128,
    merge_remote_buffers: MergeRemoteBuffersBehaviour | bool | None = (
        MergeRemoteBuffersBehaviour.NO_MERGING
    ),
    gather_simplifier: bool = True,
    triangular_solve_expander_block_size: int = 0,
    cholesky_block_size: int = 0,
    enable_fast_math: bool = False,
) -> IPUConfig:
    """Sets the compiler's optimisation options (deprecated).

    Sets the `optimizations` attribute of each argument (`max_*` arguments
    set `maximum_*`, `gather_simplifier` sets `enable_gather_simplifier`).
    Every argument is set, to its default when not given, as the reference
    did.

    Args:
        opts: The config from `create_ipu_config`.
        combine_embedding_lookups: Fuse lookups of the same embedding.
        combine_matmuls: Fuse matmuls sharing an operand.
        max_cross_replica_sum_buffer_size: Bytes held before a cross-replica sum.
        max_reduce_scatter_buffer_size: Bytes held before a reduce-scatter.
        max_inter_ipu_copies_buffer_size: Bytes held before an inter-IPU copy.
        max_send_recv_cluster_size: Bytes held before a host send/receive.
        minimum_remote_tensor_size: The smallest tensor kept in remote memory.
        merge_remote_buffers: A `MergeRemoteBuffersBehaviour`; older SDKs'
            True, False and None mean `MERGE`, `NO_MERGING` and
            `IF_BENEFICIAL`.
        gather_simplifier: More aggressive embedding-lookup optimisations.
        triangular_solve_expander_block_size: Block size of triangular solves.
        cholesky_block_size: Block size of Cholesky factorisations.
        enable_fast_math: Reassociating floating-point optimisations.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For a negative size.

    Example:

    ```python
    opts = ipu.utils.set_optimization_options(opts, combine_embedding_lookups=True)
    ```
    """
    arguments = dict(locals())
    # Older SDKs took a bool or None here.
    if merge_remote_buffers is None or isinstance(merge_remote_buffers, bool):
        arguments["merge_remote_buffers"] = _MERGE_REMOTE_BUFFERS[merge_remote_buffers]
    return assign(
        opts,
        "set_optimization_options",
        {
            argument: (f"optimizations.{option}", arguments[argument])
            for argument, option in _OPTIMIZATION_OPTIONS.items()
        },
    )


def set_floating_point_behaviour_options(
    opts: IPUConfig,
    inv: bool = True,
    div0: bool = True,
    oflo: bool = True,
    esr: bool = True,
    nanoo: bool = True,
) -> IPUConfig:
    """Sets the IPU's floating-point exception and rounding bits (deprecated).

    Sets the `floating_point_behaviour` attribute of each argument; all are
    on by default, as in the reference.

    Args:
        opts: The config from `create_ipu_config`.
        inv: An invalid operation raises.
        div0: A division by zero raises.
        oflo: An overflow raises.
        esr: Stochastic rounding.
        nanoo: NaN on overflow.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: When an argument is not a bool.

    Example:

    ```python
    opts = ipu.utils.set_floating_point_behaviour_options(opts, esr=False)
    ```
    """
    arguments = locals()
    return assign(
        opts,
        "set_floating_point_behaviour_options",
        {
            name: (f"floating_point_behaviour.{name}", arguments[name])
            for name in ("inv", "div0", "oflo", "esr", "nanoo")
        },
    )


def set_io_tile_options(
    opts: IPUConfig,
    num_io_tiles: int,
    place_ops_on_io_tiles: bool | None = None,
    io_tile_available_memory_proportion: float = 0.9,
) -> IPUConfig:
    """Sets the tiles reserved for I/O on each IPU (deprecated).

    Sets `io_tiles.num_io_tiles`, `.place_ops_on_io_tiles` (left as it is
    when None) and `.available_memory_proportion`.

    Args:
        opts: The config from `create_ipu_config`.
        num_io_tiles: Tiles reserved for I/O.
        place_ops_on_io_tiles: Whether I/O operations go on those tiles.
        io_tile_available_memory_proportion: The share of their memory for data.

    Returns:
        `opts`, changed.

    Raises:
        TypeError: For an argument of the wrong type.
        ValueError: For a negative tile count or a proportion outside [0, 1].

    Example:

    ```python
    opts = ipu.utils.set_io_tile_options(opts, num_io_tiles=64, place_ops_on_io_tiles=True)
    ```
    """
    assignments = {
        "num_io_tiles": ("io_tiles.num_io_tiles", num_io_tiles),
        "io_tile_available_memory_proportion": (
            "io_tiles.available_memory_proportion",
            io_tile_available_memory_proportion,
        ),
    }
    if place_ops_on_io_tiles is not None:
        assignments["place_ops_on_io_tiles"] = (
            "io_tiles.place_ops_on_io_tiles",
            place_ops_on_io_tiles,
        )
    return assign(opts, "set_io_tile_options", assignments)


def _validated_only(opts: Any, function: str, checks: dict[str, tuple[Any, tuple]]) -> IPUConfig:
    # Options SDK 2.1 dropped from the config: checked, then nothing to set.
    require_config(opts, function)
    for argument, (value, kinds) in checks.items():
        check_kind(function, argument, value, kinds)
    warn_deprecated(function)
    return opts


def set_report_options(
    opts: IPUConfig,
    graph_options: Mapping[str, Any] | None = None,
    execution_options: Mapping[str, Any] | None = None,
) -> IPUConfig:
    """Accepts Poplar's graph and execution report options (deprecated).

    `IPUConfig` has no report options (SDK 2.1 moved them to
    `POPLAR_ENGINE_OPTIONS`), so these are validated and have no effect;
    the device model's report is `keras_ipu.utils.execution_report`.

    Args:
        opts: The config from `create_ipu_config`.
        graph_options: A dictionary of graph report options, or None.
        execution_options: A dictionary of execution report options, or None.

    Returns:
        `opts`, unchanged.

    Raises:
        TypeError: When `opts` is not such a config, or the options are
            not dictionaries.

    Example:

    ```python
    opts = ipu.utils.set_report_options(opts, graph_options={"graphOptions": "false"})
    ```
    """
    kinds = (Mapping, type(None))
    return _validated_only(
        opts,
        "set_report_options",
        {
            "graph_options": (graph_options, kinds),
            "execution_options": (execution_options, kinds),
        },
    )


def set_transfer_options(opts: IPUConfig, use_verified_transfers: bool = False) -> IPUConfig:
    """Accepts the verified-transfers switch (deprecated).

    Verified transfers are not part of `IPUConfig` (nor of the device
    model): the switch is validated and has no effect.

    Args:
        opts: The config from `create_ipu_config`.
        use_verified_transfers: Whether to use Poplar's verified transfers.

    Returns:
        `opts`, unchanged.

    Raises:
        TypeError: When `opts` is not such a config, or the switch not a bool.

    Example:

    ```python
    opts = ipu.utils.set_transfer_options(opts, use_verified_transfers=True)
    ```
    """
    return _validated_only(
        opts,
        "set_transfer_options",
        {
            "use_verified_transfers": (use_verified_transfers, (bool,)),
        },
    )


def set_verification_options(
    opts: IPUConfig, verification_options: VerificationOptions
) -> IPUConfig:
    """Accepts the keys of verified transfers (deprecated).

    Validated and without effect, like `set_transfer_options`.

    Args:
        opts: The config from `create_ipu_config`.
        verification_options: A `keras_ipu.config.VerificationOptions`.

    Returns:
        `opts`, unchanged.

    Raises:
        TypeError: When `opts` is not such a config, or the options are not
            a `VerificationOptions`.

    Example:

    ```python
    o = ipu.config.VerificationOptions()
    o.inputs.key = 1
    opts = ipu.utils.set_verification_options(opts, o)
    ```
    """
    return _validated_only(
        opts,
        "set_verification_options",
        {
            "verification_options": (verification_options, (VerificationOptions,)),
        },
    )
