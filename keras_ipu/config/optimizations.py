"""The IPUConfig schema's `optimizations` category: Poplar's graph optimizations.

They tune how Poplar lowers a program and have no counterpart in JAX: each
is accepted and validated so ported code runs, without effect on the device
model (`ignored`). `schema.py` puts the category in its tree.

Example:

```python
config.optimizations.combine_matmuls = True   # accepted, no effect
```
"""

from __future__ import annotations

from typing import Any

from keras_ipu.config.attributes import Category, Check, Option, at_least
from keras_ipu.config.enums import MergeRemoteBuffersBehaviour

NO_EFFECT = "no effect on the device model (accepted and validated)."


def ignored(name: str, type_: Any, default: Any, doc: str,
            checks: tuple[Check, ...] = ()) -> Option:
    """An option accepted and validated, without effect on the device model.

    Args:
        name: The option's name.
        type_: Its type.
        default: Its default.
        doc: The reference's description.
        checks: The checks of its values.

    Returns:
        The `Option`.

    Example:

    >>> ignored("combine_matmuls", bool, False, "If True, fuse matmul operations ...")
    """
    return Option(name, type_, default, doc, effect=NO_EFFECT, checks=checks)


def _buffer_size(name: str, doc: str, default: int = 0) -> Option:
    return ignored(name, int, default, doc, (at_least(0),))


OPTIMIZATIONS = Category(
    "optimizations",
    "Sub-category containing configuration options that control a variety of optimizations "
    "made when lowering the TensorFlow graph to Poplar.",
    (
        ignored(
            "prefetch_data_streams",
            bool,
            True,
            "If True (default), prefetching of data for data streams on the host will be "
            "overlapped with execution on the IPU.",
        ),
        ignored(
            "combine_embedding_lookups",
            bool,
            False,
            "If True, fuse embedding lookups which are on the same tensor. This might "
            "improve performance but increase memory usage.",
        ),
        ignored(
            "combine_matmuls",
            bool,
            False,
            "If True, fuse matmul operations if they share the same weights or the same input.",
        ),
        ignored(
            "enable_graph_outlining",
            bool,
            True,
            "If True (default), operations in the graph which are the same but with different "
            "input tensors may be outlined: the same code is re-used to execute them, saving "
            "program memory at the cost of exchanging their inputs.",
        ),
        ignored(
            "merge_infeed_io_copies",
            bool,
            False,
            "If True, merge the streamed host to device input copies into one larger copy. "
            "This may reduce the time to copy data from the host, at the expense of "
            "increasing the live tensor memory on the device.",
        ),
        _buffer_size(
            "maximum_cross_replica_sum_buffer_size",
            "The maximum number of bytes that can be waiting before a cross replica sum op is "
            "scheduled. 0 (default) means that they are scheduled immediately.",
        ),
        _buffer_size(
            "maximum_reduce_scatter_buffer_size",
            "The maximum number of bytes that can be waiting before a reduce scatter op is "
            "scheduled.",
        ),
        _buffer_size(
            "maximum_inter_ipu_copies_buffer_size",
            "The maximum number of bytes that can be waiting before an inter IPU copy between "
            "IPUs is scheduled.",
        ),
        _buffer_size(
            "maximum_send_recv_cluster_size",
            "The maximum number of bytes that can be waiting before a cluster of send/recv "
            "instructions to/from the host is scheduled.",
        ),
        _buffer_size(
            "minimum_remote_tensor_size",
            "The minimum size (in bytes) a tensor must be in order to be considered for being "
            "stored in remote memory.",
            default=128,
        ),
        ignored(
            "merge_remote_buffers",
            MergeRemoteBuffersBehaviour,
            MergeRemoteBuffersBehaviour.IF_BENEFICIAL,
            "Whether to merge compatible remote buffers. Merging of remote buffers can allow "
            "for more code re-use if the only difference between computations are the remote "
            "buffers being accessed. Must be a MergeRemoteBuffersBehaviour.",
        ),
        ignored(
            "enable_gather_simplifier",
            bool,
            True,
            "If True (default), more aggressive optimizations will be done on embedding lookups.",
        ),
        _buffer_size(
            "triangular_solve_expander_block_size",
            "Defines the block size for the triangular solver expander. A value of 0 "
            "(default) selects an implementation defined default.",
        ),
        _buffer_size(
            "cholesky_block_size",
            "Defines the block size for the Cholesky factoriser. A value of 0 (default) "
            "selects an implementation defined default.",
        ),
        ignored(
            "enable_fast_math",
            bool,
            False,
            "Enables optimizations which allow arbitrary reassociations and transformations "
            "of mathematical operations with no accuracy guarantees (SDK 3 moved it to "
            "optimizations.math.fast).",
        ),
        # SDK 3's additions, which ported code sets.
        _buffer_size(
            "maximum_reduce_many_buffer_size",
            "The maximum number of bytes that can be waiting before a reduce-many op (reductions "
            "of several tensors at once) is scheduled.",
        ),
        _buffer_size(
            "maximum_all_gather_buffer_size",
            "The maximum number of bytes that can be waiting before an all-gather op is "
            "scheduled.",
        ),
        ignored(
            "enable_dynamic_slice_replacement",
            bool,
            True,
            "If True (default), dynamic slices and updates are replaced by multi-slices and "
            "multi-updates, which Poplar can plan for parallelism and memory.",
        ),
        Category(
            "math",
            "Sub-category containing configuration options for the simplification of "
            "algebraic expressions (SDK 3).",
            (
                ignored(
                    "fast",
                    bool,
                    False,
                    "Enables optimizations which allow arbitrary reassociations and "
                    "transformations of mathematical operations with no accuracy guarantees.",
                ),
                ignored(
                    "dot_strength",
                    bool,
                    True,
                    "If True (default), a dot product whose operands have only batch and "
                    "contracting dimensions is computed as an elementwise multiplication.",
                ),
            ),
        ),
    ),
)
