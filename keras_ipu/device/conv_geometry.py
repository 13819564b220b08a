"""The geometry of convolutions in XLA:CPU's canonical form: layouts, padding, operand swaps.

Pure arithmetic on shapes and dimension numbers, used by `device.convolutions`
to issue every convolution of a step (forward, input and weight gradient) in
the form XLA:CPU's fast convolution path takes (see that module).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

Pads = tuple[tuple[int, int], ...]
IntTuple = tuple[int, ...]

CANONICAL_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
MAX_SPATIAL_DIMS = 3


def canonical_dimension_numbers(num_spatial_dims: int) -> lax.ConvDimensionNumbers:
    """Return the dimension numbers of XLA:CPU's canonical convolution form.

    Args:
        num_spatial_dims: Number of spatial dimensions ``n``.

    Returns:
        ``ConvDimensionNumbers`` for input ``(N, *S, C)``, kernel ``(*K, I, O)`` and
        output ``(N, *S, O)``, i.e. ``b01f_01io->b01f`` for ``n == 2``.
    """
    n = num_spatial_dims
    spatial = tuple(range(1, n + 1))
    io_spec = (0, n + 1, *spatial)
    return lax.ConvDimensionNumbers(
        lhs_spec=io_spec, rhs_spec=(n + 1, n, *range(n)), out_spec=io_spec
    )


def as_int_tuple(values: Sequence[int] | None, n: int) -> IntTuple:
    """Normalize an optional per-spatial-dimension sequence to a tuple of ints."""
    if values is None:
        return (1,) * n
    return tuple(operator.index(v) for v in values)


def hashable_precision(precision: Any) -> Any:
    """Make ``precision`` usable as a static (hashable) ``custom_vjp`` argument."""
    if isinstance(precision, list):
        return tuple(precision)
    return precision


def is_supported(
    lhs: Any,
    rhs: Any,
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> bool:
    """Tell whether :func:`conv_general_dilated` takes the canonical route.

    Args:
        lhs: Convolution input (anything with ``shape``, ``ndim`` and ``dtype``).
        rhs: Convolution kernel.
        padding: Padding argument as given to ``conv_general_dilated``.
        lhs_dilation: ``lhs_dilation`` argument.
        feature_group_count: ``feature_group_count`` argument.
        batch_group_count: ``batch_group_count`` argument.
        preferred_element_type: ``preferred_element_type`` argument.
        out_sharding: ``out_sharding`` argument.

    Returns:
        ``True`` if the call is rewritten into canonical convolutions, ``False`` if it
        is forwarded to :func:`jax.lax.conv_general_dilated` unchanged.
    """
    lhs_dtype = np.dtype(lhs.dtype)
    if lhs_dtype not in CANONICAL_DTYPES or np.dtype(rhs.dtype) != lhs_dtype:
        return False
    if preferred_element_type is not None and np.dtype(preferred_element_type) != lhs_dtype:
        return False
    if out_sharding is not None:
        return False
    if lhs.ndim != rhs.ndim or not 1 <= lhs.ndim - 2 <= MAX_SPATIAL_DIMS:
        return False
    if 0 in lhs.shape or 0 in rhs.shape:
        return False
    if feature_group_count > 1 and batch_group_count > 1:
        return False
    # lax rejects string padding for transposed convolutions; let it raise.
    return not (
        isinstance(padding, str)
        and lhs_dilation is not None
        and any(operator.index(d) != 1 for d in lhs_dilation)
    )


def resolve_padding(
    padding: str | Sequence[tuple[int, int]],
    in_spatial: IntTuple,
    kernel_spatial: IntTuple,
    strides: IntTuple,
    rhs_dilation: IntTuple,
) -> Pads:
    """Turn a padding argument into explicit ``(low, high)`` pairs, as lax does.

    Args:
        padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` (any case) or pairs.
        in_spatial: Spatial input sizes.
        kernel_spatial: Spatial kernel sizes (undilated).
        strides: Window strides.
        rhs_dilation: Kernel dilation.

    Returns:
        One ``(low, high)`` pair per spatial dimension.
    """
    if isinstance(padding, str):
        effective = [(k - 1) * d + 1 for k, d in zip(kernel_spatial, rhs_dilation, strict=False)]
        pads = lax.padtype_to_pads(in_spatial, effective, strides, padding)
    else:
        pads = padding
    return tuple((operator.index(lo), operator.index(hi)) for lo, hi in pads)


def dilate(size: int, dilation: int) -> int:
    """Size of a dimension of ``size`` elements after inserting ``dilation - 1`` holes."""
    return 0 if size == 0 else 1 + dilation * (size - 1)


def lhs_grad_padding(
    in_spatial: IntTuple,
    kernel_spatial: IntTuple,
    strides: IntTuple,
    out_spatial: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
) -> Pads:
    """Padding of the input-gradient convolution (may contain negative values).

    Args:
        in_spatial: Spatial sizes of the forward input.
        kernel_spatial: Spatial sizes of the forward kernel.
        strides: Forward window strides.
        out_spatial: Spatial sizes of the forward output.
        pads: Forward padding.
        lhs_dilation: Forward input dilation.
        rhs_dilation: Forward kernel dilation.

    Returns:
        ``(low, high)`` pairs such that the gradient convolution yields ``in_spatial``.
    """
    result = []
    for i, (lo, _) in enumerate(pads):
        lhs_d = dilate(in_spatial[i], lhs_dilation[i])
        rhs_d = dilate(kernel_spatial[i], rhs_dilation[i])
        out_d = dilate(out_spatial[i], strides[i])
        before = rhs_d - lo - 1
        after = lhs_d + rhs_d - 1 - out_d - before
        result.append((before, after))
    return tuple(result)


def rhs_grad_padding(
    in_spatial: IntTuple,
    kernel_spatial: IntTuple,
    strides: IntTuple,
    out_spatial: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
) -> Pads:
    """Padding of the weight-gradient convolution (may contain negative values).

    Args:
        in_spatial: Spatial sizes of the forward input.
        kernel_spatial: Spatial sizes of the forward kernel.
        strides: Forward window strides.
        out_spatial: Spatial sizes of the forward output.
        pads: Forward padding.
        lhs_dilation: Forward input dilation.
        rhs_dilation: Forward kernel dilation.

    Returns:
        ``(low, high)`` pairs such that the gradient convolution yields
        ``kernel_spatial``.
    """
    result = []
    for i, (lo, _) in enumerate(pads):
        lhs_d = dilate(in_spatial[i], lhs_dilation[i])
        rhs_d = dilate(kernel_spatial[i], rhs_dilation[i])
        out_d = dilate(out_spatial[i], strides[i])
        result.append((lo, out_d - lhs_d + rhs_d - lo - 1))
    return tuple(result)


def xla_would_swap_operands(
    in_spatial: IntTuple,
    kernel_spatial: IntTuple,
    strides: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
    groups: int,
) -> bool:
    """Predict whether XLA's ``ConvOperandSwapper`` would rewrite this convolution.

    The algebraic simplifier swaps the operands of an ungrouped convolution whose
    window (kernel) is larger than its input, which turns canonical dimension numbers
    into e.g. ``01fb_o01i->f01b`` with window reversal. This mirrors its condition
    (``xla/hlo/transforms/simplifiers/conv_operand_swapper.cc``).

    Args:
        in_spatial: Spatial input sizes (after any cropping).
        kernel_spatial: Spatial kernel sizes.
        strides: Window strides.
        pads: Non-negative ``(low, high)`` padding.
        lhs_dilation: Input dilation.
        rhs_dilation: Kernel dilation.
        groups: ``feature_group_count``.

    Returns:
        ``True`` if the convolution would be swapped (and lose its canonical form).
    """
    if groups > 1:
        return False
    kernel_product = swapped_product = 1
    for size, k, s, (lo, hi), ld, rd in zip(
        in_spatial, kernel_spatial, strides, pads, lhs_dilation, rhs_dilation, strict=True
    ):
        plain = lo == 0 and hi == 0 and rd == 1
        if (plain and ld == k and s == k - 1) or (plain and size == k and ld == 1 and s == 1):
            continue  # "group" or "pure contraction" dimension: never swapped.
        kernel_product *= k
        full_pad = size == 1 and s == 1 and rd == 1 and lo == k - 1 and hi == k - 1
        swapped_product *= k if full_pad else size
    return kernel_product > swapped_product
