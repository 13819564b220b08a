"""Sequence slicing operators of `tensorflow.python.ipu.slicing_ops`, on JAX arrays.

Each slice copies `num_elems[i]` rows (elements of the first dimension)
from `src_offsets[i]` of the source to `dst_offsets[i]` of the destination.
The counts and offsets may be lists or arrays, including values computed in
the program; they are checked against the shapes when they are known on
the host. Where slices overlap in the destination the later one wins.
Gradients flow to `src` and to the rows of `dst` that no slice overwrites.

Example:

```python
from keras_ipu.ops import slicing_ops

dst = slicing_ops.sequence_slice(jnp.zeros((6, 6)), src, [2, 2], [2, 1], [0, 4], False)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _indices(name: str, values: Any) -> jax.Array:
    values = jnp.asarray(values)
    if values.size == 0:
        raise ValueError(f"{name} is empty: give at least one slice.")
    if values.ndim != 1 or not jnp.issubdtype(values.dtype, jnp.integer):
        raise ValueError(f"{name} must be a list or rank-1 array of integers, got "
                         f"{values.dtype} of shape {values.shape}.")
    return values.astype(jnp.int32)


def _check_fits(name: str, offsets: Any, num_elems: Any, rows: int) -> None:
    # Only values known on the host can be checked; in a traced program an
    # out-of-range slice reads clamped rows, as an XLA gather does.
    if isinstance(offsets, jax.core.Tracer) or isinstance(num_elems, jax.core.Tracer):
        return
    offsets, num_elems = np.asarray(offsets), np.asarray(num_elems)
    bad = np.flatnonzero((offsets < 0) | (num_elems < 0) | (offsets + num_elems > rows))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"Slice {i} ({name}={int(offsets[i])}, num_elems={int(num_elems[i])}) "
                         f"does not fit in the {rows} rows there: offsets and counts must be "
                         f">= 0 with offset + count <= {rows}.")


def _slice(dst: Any, src: Any, num_elems: Any, src_offsets: Any, dst_offsets: Any,
           zero_unused: bool) -> jax.Array:
    dst, src = jnp.asarray(dst), jnp.asarray(src)
    if dst.ndim < 2 or src.ndim < 2 or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"dst and src must be of rank 2 or more with the same inner "
                         f"dimensions, got shapes {dst.shape} and {src.shape}.")
    given = {"num_elems": num_elems, "src_offsets": src_offsets, "dst_offsets": dst_offsets}
    num_elems, src_offsets, dst_offsets = (_indices(k, v) for k, v in given.items())
    if not num_elems.shape == src_offsets.shape == dst_offsets.shape:
        raise ValueError(f"num_elems, src_offsets and dst_offsets need one entry per slice, "
                         f"got {num_elems.shape[0]}, {src_offsets.shape[0]} and "
                         f"{dst_offsets.shape[0]}.")
    # The values as given: lists and NumPy arrays stay checkable inside jax.jit.
    _check_fits("src_offsets", given["src_offsets"], given["num_elems"], src.shape[0])
    _check_fits("dst_offsets", given["dst_offsets"], given["num_elems"], dst.shape[0])
    rows = jnp.arange(dst.shape[0], dtype=jnp.int32)[:, None]
    inside = (rows >= dst_offsets) & (rows < dst_offsets + num_elems)  # [dst rows, slices]
    last = inside.shape[1] - 1 - jnp.argmax(inside[:, ::-1], axis=1)  # the later slice wins
    source = jnp.clip(src_offsets[last] + rows[:, 0] - dst_offsets[last], 0, src.shape[0] - 1)
    covered = inside.any(axis=1).reshape((-1,) + (1,) * (dst.ndim - 1))
    kept = jnp.zeros_like(dst) if zero_unused else dst
    return jnp.where(covered, jnp.take(src, source, axis=0).astype(dst.dtype), kept)


def _check_consecutive(num_elems: Any, rows: int, where: str, holder: str) -> None:
    """Refuses slices laid one after another (offsets the caller does not give) that
    need more than `rows` rows; checkable only when the counts are known on the host."""
    if isinstance(num_elems, jax.core.Tracer):
        return
    counts = np.asarray(num_elems)
    if counts.ndim == 1 and np.issubdtype(counts.dtype, np.integer) and (counts >= 0).all() \
            and counts.sum() > rows:
        raise ValueError(f"The slices, one after another {where}, need {int(counts.sum())} "
                         f"rows (the sum of num_elems), and {holder} {rows}.")


def _starts(num_elems: Any) -> Any:
    """Where each slice starts in a contiguous run of all slices (on the host when known)."""
    counts = _indices("num_elems", num_elems)
    if isinstance(num_elems, jax.core.Tracer):
        return jnp.cumsum(counts) - counts
    counts = np.asarray(num_elems)
    return np.cumsum(counts) - counts


def sequence_slice(dst: Any, src: Any, num_elems: Any, src_offsets: Any, dst_offsets: Any,
                   zero_unused: bool) -> jax.Array:
    """Copies slices of rows from `src` into `dst`.

    Args:
        dst: The destination, rank 2 or more.
        src: The source, with `dst`'s inner dimensions.
        num_elems: Rows per slice (a list or rank-1 array).
        src_offsets: Each slice's first row in `src`.
        dst_offsets: Each slice's first row in `dst`.
        zero_unused: Zero the rows of `dst` no slice writes.

    Returns:
        The updated destination, `dst`'s shape and dtype.

    Raises:
        ValueError: For mismatched shapes or slice counts, or (when known on
            the host) a slice outside `src` or `dst`.

    Example:

    >>> sequence_slice(jnp.zeros((6, 1)), jnp.arange(6.0)[:, None], [2, 2], [2, 1], [0, 4],
    ...                False)[:, 0]
    Array([2., 3., 0., 0., 1., 2.], dtype=float32)
    """
    return _slice(dst, src, num_elems, src_offsets, dst_offsets, zero_unused)


def sequence_slice_pack(dst: Any, src: Any, num_elems: Any, dst_offsets: Any,
                        zero_unused: bool) -> jax.Array:
    """Packs consecutive slices of `src` into `dst` at `dst_offsets`.

    Slice `i` is the `num_elems[i]` rows of `src` after the slices before
    it (the inverse of `sequence_slice_unpack`).

    Args:
        dst: The destination, rank 2 or more.
        src: The contiguous slices, with `dst`'s inner dimensions.
        num_elems: Rows per slice.
        dst_offsets: Each slice's first row in `dst`.
        zero_unused: Zero the rows of `dst` no slice writes.

    Returns:
        The packed destination.

    Raises:
        ValueError: As `sequence_slice`.

    Example:

    >>> sequence_slice_pack(jnp.zeros((6, 1)), jnp.array([[2.], [3.], [1.], [2.]]), [2, 2],
    ...                     [2, 1], False)[:, 0]
    Array([0., 1., 2., 3., 0., 0.], dtype=float32)
    """
    src = jnp.asarray(src)
    _check_consecutive(num_elems, src.shape[0] if src.ndim else 0, "in src", "src has")
    return _slice(dst, src, num_elems, _starts(num_elems), dst_offsets, zero_unused)


def sequence_slice_unpack(src: Any, num_elems: Any, src_offsets: Any, total_elements: Any,
                          *total_after_zero_unused: int) -> jax.Array:
    """Copies slices of `src` one after another into a new array.

    The seed's example calls it as `(src, num_elems, src_offsets, False,
    total_elements)`, with a `zero_unused` flag before the total; that form
    is accepted too (the output's unused rows are always zero).

    Args:
        src: The source, rank 2 or more.
        num_elems: Rows per slice.
        src_offsets: Each slice's first row in `src`.
        total_elements: Rows of the result, a Python int (usually the sum
            of `num_elems`).
        *total_after_zero_unused: The total, when `total_elements` was the
            example's `zero_unused` flag.

    Returns:
        `[total_elements, *src.shape[1:]]`: the slices in order, then zeros.

    Raises:
        ValueError: As `sequence_slice`, or for a total that is not a
            non-negative int.

    Example:

    >>> sequence_slice_unpack(jnp.arange(6.0)[:, None], [2, 2], [2, 1], 4)[:, 0]
    Array([2., 3., 1., 2.], dtype=float32)
    """
    if isinstance(total_elements, bool) and len(total_after_zero_unused) == 1:
        total_elements = total_after_zero_unused[0]
    elif total_after_zero_unused:
        raise ValueError("sequence_slice_unpack takes (src, num_elems, src_offsets, "
                         "total_elements), or the seed example's (..., zero_unused, "
                         "total_elements).")
    if isinstance(total_elements, bool) or not isinstance(total_elements, (int, np.integer)) \
            or total_elements < 0:
        raise ValueError(f"total_elements must be a non-negative int (the result's rows), got "
                         f"{total_elements!r}.")
    src = jnp.asarray(src)
    _check_consecutive(num_elems, int(total_elements), "in the result",
                       "total_elements gives it")
    dst = jnp.zeros((int(total_elements),) + src.shape[1:], src.dtype)
    return _slice(dst, src, num_elems, src_offsets, _starts(num_elems), True)


__all__ = ["sequence_slice", "sequence_slice_pack", "sequence_slice_unpack"]
