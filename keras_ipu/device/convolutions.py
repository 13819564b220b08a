"""Convolutions that stay on XLA:CPU's fast path inside loops, with their gradients.

Background
----------
XLA:CPU only runs a convolution on its fast path (Eigen, or a YNNPACK ``__ynn_fusion``
in recent jaxlibs) when the HLO ``convolution`` is in *canonical* form (see
``PotentiallyImplementedAsEigenConvolution`` in ``xla/service/cpu/ir_emission_utils.cc``):

* input  ``(batch, spatial_0, ..., spatial_{n-1}, feature)``,
* kernel ``(spatial_0, ..., spatial_{n-1}, in_feature, out_feature)``,
* output laid out like the input, no window reversal, F32/F16 operands.

The pass that rewrites other convolutions into this form (``ConvCanonicalization``)
only looks at the entry computation. The convolutions JAX's autodiff emits for the
gradients (e.g. ``f01b_i01o->01bf`` for the weight gradient, ``b01f_01oi->b01f`` for
the input gradient) are not canonical, so inside a ``lax.scan`` / ``while_loop`` /
``cond`` body they fall through to XLA's naive loop emitter and run 5-50x slower
(JAX issue #12868).

This module provides :func:`conv_general_dilated` with the signature of
:func:`jax.lax.conv_general_dilated`. Every convolution it lowers to -- forward,
input gradient and weight gradient, also for reverse-over-reverse derivatives -- is
issued in canonical form, with explicit ``transpose`` / ``rev`` / ``reshape`` / ``pad``
operations around it.

How it works
------------
:func:`conv_general_dilated` moves the operands to canonical layout and calls a
``jax.custom_vjp`` function that takes canonical operands. Its backward pass
expresses both cotangents with the same function:

* input gradient: ``dy`` convolved with the spatially flipped, per-group in/out
  swapped kernel (``lhs_dilation`` = forward strides, ``window_strides`` = forward
  ``lhs_dilation``);
* weight gradient: ``x`` with its channel dimension as batch and its batch
  dimension as feature (``(I, *S, G*N)``, ``feature_group_count=G`` for grouped and
  depthwise convolutions) convolved with ``dy`` as kernel ``(*So, N, O)``
  (``window_strides`` = forward ``rhs_dilation``, ``rhs_dilation`` = forward strides).
  For depthwise kernels with at most :data:`DEPTHWISE_TAPS_MAX_WINDOW` taps the
  weight gradient is instead one multiply-reduce per kernel tap, which is faster on
  XLA:CPU than a batch-1 convolution with one group per channel.

``batch_group_count > 1`` is rewritten into an equivalent feature-grouped
convolution by moving the batch groups into the feature dimension. Negative
padding (which the backward pass produces for e.g. stride 2 / ``VALID`` on even
sizes) is applied as an explicit ``lax.pad`` that crops the input.

What XLA does to the rewrite
----------------------------
* The explicit transposes / reverses are *not* folded back into the convolution on
  XLA:CPU: they stay separate ``transpose``/``copy``/``reverse`` fusions and the
  convolution keeps ``dim_labels=b01f_01io->b01f`` inside loop bodies.
* XLA's algebraic simplifier does undo the canonical form in one situation: its
  ``ConvOperandSwapper`` swaps the operands of an ungrouped convolution whose window
  is larger than its input (a 3x3 ``SAME`` convolution on 1x1/2x2 maps, large
  explicit padding, the weight gradient of a transposed convolution), producing
  ``01fb_o01i->f01b`` with window reversal. Such convolutions are detected
  statically (`conv_geometry.xla_would_swap_operands`); their padding / input dilation is
  materialized with ``lax.pad`` behind ``lax.optimization_barrier``. Without the
  barrier XLA folds the pad back into the window and swaps anyway.

Limitations / fallbacks
-----------------------
The following are passed unchanged to :func:`jax.lax.conv_general_dilated`:

* dtypes other than float16, bfloat16 and float32, or ``lhs.dtype != rhs.dtype``;
* ``preferred_element_type`` that differs from the operand dtype;
* a non-``None`` ``out_sharding``;
* zero-size operands, more than 3 spatial dimensions, both group counts > 1, and
  string ``padding`` combined with ``lhs_dilation`` (which lax rejects).

Because the gradient is defined with ``jax.custom_vjp``, forward-mode autodiff
(``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) is not available through this
function; reverse-over-reverse (``grad`` of ``grad``) works and stays canonical.
"""


from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The caller's stack for the operations traced inside the custom_vjp
# (contract-tested in tests/test_jax_contracts.py).
from jax._src import source_info_util

# `lax.conv_transpose` calls this module's `conv_general_dilated` (contract-tested in
# tests/test_jax_contracts.py).
from jax._src.lax import convolution as lax_convolution

from keras_ipu.device import conv_geometry as geometry
from keras_ipu.device import jaxprs
from keras_ipu.device.conv_geometry import IntTuple, Pads

# Captured at import time so that `canonical_convolutions()` (which replaces
# `jax.lax.conv_general_dilated` while a program is traced) cannot recurse.
_lax_conv_general_dilated = lax.conv_general_dilated

# Depthwise kernels with at most this many taps get their weight gradient
# from per-tap multiply-reduces instead of a grouped convolution (1.2-2x
# faster on XLA:CPU for 3x3 kernels). 0: always the convolution.
DEPTHWISE_TAPS_MAX_WINDOW = 64


@contextlib.contextmanager
def canonical_convolutions() -> Iterator[None]:
    """Routes `jax.lax.conv_general_dilated` to `conv_general_dilated` inside the context.

    Code that looks the function up when it runs (Keras' JAX backend does, for
    every `Conv*`, `DepthwiseConv*` and, through `lax.conv_transpose`,
    `Conv*Transpose` layer) then traces convolutions whose
    gradients keep XLA:CPU's fast path inside loop bodies. Meant to be held
    only while a program is traced, in the thread that traces it.

    Returns:
        A context manager.

    Example:

    >>> with canonical_convolutions():
    ...     traced = jax.jit(train_steps).trace(state, batches)
    """
    original = lax.conv_general_dilated
    lax.conv_general_dilated = conv_general_dilated
    # `lax.conv_transpose` (Keras' `Conv*Transpose`) calls its own module's function.
    within_lax = lax_convolution.conv_general_dilated
    lax_convolution.conv_general_dilated = conv_general_dilated
    try:
        yield
    finally:
        lax.conv_general_dilated = original
        lax_convolution.conv_general_dilated = within_lax


def trace_for(platform: str, jitted: Any, *args: Any) -> Any:
    """`jitted.trace(*args)`, with `canonical_convolutions` on CPUs.

    Should the rewrite not trace (forward-mode autodiff through a
    convolution, say), the program is traced with lax's convolutions as
    they are; on other platforms always.

    Args:
        platform: The JAX platform the program will run on.
        jitted: A `jax.jit`-wrapped function.
        *args: Its arguments (arrays or shape structs).

    Returns:
        The `jax.stages.Traced` program.

    Example:

    >>> traced = trace_for("cpu", jax.jit(train_step), state, batch)
    """
    if platform != "cpu":
        return jitted.trace(*args)
    try:
        with canonical_convolutions():
            traced = jitted.trace(*args)
    except Exception:  # noqa: BLE001 - e.g. reverse- over forward-mode autodiff
        return jitted.trace(*args)
    # JAX's forward-mode form of a custom_vjp: the rewrite's, linearized.
    if not any(eqn.primitive.name == "custom_lin" for eqn in jaxprs.equations(traced.jaxpr)):
        return traced
    # Forward-mode autodiff of the rewrite's custom_vjp traces, but cannot lower: traced
    # again with lax's convolutions, past JAX's caches of the traces (of any jit inside
    # it too; compiled programs stay in the compilation cache).
    jax.clear_caches()
    return jitted.trace(*args)


def _raw_canonical_conv(
    x: jax.Array,
    w: jax.Array,
    strides: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
    groups: int,
    precision: Any,
) -> jax.Array:
    """Issue one canonical ``lax.conv_general_dilated``.

    Negative padding is applied beforehand with ``lax.pad`` (a crop of the input), so
    the convolution itself only sees non-negative padding. If XLA would swap the
    operands of the convolution (kernel larger than input, see
    :func:`geometry.xla_would_swap_operands`), padding and input dilation are materialized
    with ``lax.pad`` behind an ``optimization_barrier`` (which stops XLA from folding
    the pad back into the convolution window), so the input is at least as large as
    the kernel and the convolution stays canonical.

    Args:
        x: Input ``(N, *S, C)``.
        w: Kernel ``(*K, C // groups, O)``.
        strides: Window strides.
        pads: ``(low, high)`` padding per spatial dimension, possibly negative.
        lhs_dilation: Input dilation.
        rhs_dilation: Kernel dilation.
        groups: ``feature_group_count``.
        precision: Passed through to lax.

    Returns:
        Output ``(N, *So, O)``.
    """
    n = x.ndim - 2
    zero = jnp.zeros((), x.dtype)
    edge = (0, 0, 0)
    if any(lo < 0 or hi < 0 for lo, hi in pads) and all(d == 1 for d in lhs_dilation):
        # Crop only; keep the non-negative part of the padding in the convolution.
        crop = [(min(lo, 0), min(hi, 0), 0) for lo, hi in pads]
        x = lax.pad(x, zero, [edge, *crop, edge])
        pads = tuple((max(lo, 0), max(hi, 0)) for lo, hi in pads)
    negative = any(lo < 0 or hi < 0 for lo, hi in pads)
    swap = not negative and geometry.xla_would_swap_operands(
        x.shape[1:-1], w.shape[:n], strides, pads, lhs_dilation, rhs_dilation, groups
    )
    if negative or swap:
        # Materialize dilation and padding together (lax.pad dilates before cropping).
        cfg = [(lo, hi, d - 1) for (lo, hi), d in zip(pads, lhs_dilation, strict=True)]
        # The barrier keeps XLA from folding the pad back into the convolution window.
        x = lax.optimization_barrier(lax.pad(x, zero, [edge, *cfg, edge]))
        pads = ((0, 0),) * n
        lhs_dilation = (1,) * n
    return _lax_conv_general_dilated(
        x,
        w,
        window_strides=strides,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=geometry.canonical_dimension_numbers(n),
        feature_group_count=groups,
        precision=precision,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _canonical_conv(
    x: jax.Array,
    w: jax.Array,
    strides: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
    groups: int,
    precision: Any,
) -> jax.Array:
    """Canonical-layout convolution whose gradients are canonical convolutions too.

    Args:
        x: Input ``(N, *S, C)``.
        w: Kernel ``(*K, C // groups, O)``.
        strides: Window strides.
        pads: ``(low, high)`` padding per spatial dimension, possibly negative.
        lhs_dilation: Input dilation.
        rhs_dilation: Kernel dilation.
        groups: ``feature_group_count``.
        precision: Passed through to lax.

    Returns:
        Output ``(N, *So, O)``.
    """
    return _raw_canonical_conv(x, w, strides, pads, lhs_dilation, rhs_dilation, groups, precision)


def _canonical_conv_fwd(
    x: jax.Array,
    w: jax.Array,
    strides: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
    groups: int,
    precision: Any,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Forward pass of :func:`_canonical_conv`; saves both operands as residuals.

    The primal is computed by calling :func:`_canonical_conv` itself (not the raw lax
    call) so that an enclosing differentiation (grad-of-grad) also sees the custom
    rule instead of lax's non-canonical transpose rules.
    """
    y = _canonical_conv(x, w, strides, pads, lhs_dilation, rhs_dilation, groups, precision)
    return y, (x, w)


def _flip_and_swap_kernel(w: jax.Array, groups: int) -> jax.Array:
    """Kernel of the input-gradient convolution.

    Args:
        w: Forward kernel ``(*K, I, G * Og)``.
        groups: Forward ``feature_group_count`` ``G``.

    Returns:
        Spatially reversed kernel ``(*K, Og, G * I)`` whose group ``g`` maps the
        ``Og`` output channels of group ``g`` back to its ``I`` input channels.
    """
    n = w.ndim - 2
    *k, i, o = w.shape
    w = jnp.flip(w, axis=tuple(range(n)))
    if groups == 1:
        return jnp.transpose(w, (*range(n), n + 1, n))
    if i == 1:
        # Depthwise: (1, G*Og) -> (G, Og) -> (Og, G), avoiding a 5-D transpose.
        w = w.reshape(*k, groups, o // groups)
        return jnp.transpose(w, (*range(n), n + 1, n))
    w = w.reshape(*k, i, groups, o // groups)
    w = jnp.transpose(w, (*range(n), n + 2, n + 1, n))
    return w.reshape(*k, o // groups, groups * i)


def _weight_grad_conv(
    x: jax.Array,
    g: jax.Array,
    kernel_spatial: IntTuple,
    strides: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
    groups: int,
    precision: Any,
) -> jax.Array:
    """Weight gradient as one canonical convolution.

    ``x`` is laid out as ``(I, *S, G*N)`` (its channels play batch, its batch plays
    feature, one feature group per convolution group) and convolved with ``dy`` as the
    kernel ``(*So, N, O)``; the ``(I, *K, O)`` result is transposed to ``(*K, I, O)``.

    Args:
        x: Forward input ``(N, *S, C)``.
        g: Output cotangent ``(N, *So, O)``.
        kernel_spatial: Spatial kernel sizes ``K``.
        strides: Forward window strides.
        pads: Forward padding.
        lhs_dilation: Forward input dilation.
        rhs_dilation: Forward kernel dilation.
        groups: Forward ``feature_group_count`` ``G``.
        precision: Forward precision.

    Returns:
        Kernel cotangent ``(*K, C // G, O)``.
    """
    n = x.ndim - 2
    batch, *in_spatial, channels = x.shape
    per_group = channels // groups
    if groups == 1 or per_group == 1:
        # (N, *S, C) -> (C, *S, N) or (*S, C, N) -> (I, *S, G*N): no singleton 5-D transpose.
        perm = (n + 1, *range(1, n + 1), 0) if groups == 1 else (*range(1, n + 1), n + 1, 0)
        x_t = jnp.transpose(x, perm).reshape(per_group, *in_spatial, groups * batch)
    else:
        x_t = x.reshape(batch, *in_spatial, groups, per_group)
        x_t = jnp.transpose(x_t, (n + 2, *range(1, n + 1), n + 1, 0))
        x_t = x_t.reshape(per_group, *in_spatial, groups * batch)
    g_t = jnp.transpose(g, (*range(1, n + 1), 0, n + 1))
    padding = geometry.rhs_grad_padding(
        tuple(in_spatial), kernel_spatial, strides, g.shape[1:-1], pads, lhs_dilation, rhs_dilation
    )
    dw = _canonical_conv(x_t, g_t, rhs_dilation, padding, lhs_dilation, strides, groups, precision)
    return jnp.transpose(dw, (*range(1, n + 1), 0, n + 1))


def _depthwise_weight_grad_taps(
    x: jax.Array,
    g: jax.Array,
    kernel_spatial: IntTuple,
    strides: IntTuple,
    pads: Pads,
    rhs_dilation: IntTuple,
) -> jax.Array:
    """Depthwise weight gradient as one multiply-reduce per kernel tap (no convolution).

    ``dw[k, 0, c*m + j] = sum_{n, s} x_pad[n, s*stride + k*dilation, c] * dy[n, s, c*m + j]``.
    On XLA:CPU this is faster than the grouped convolution of :func:`_weight_grad_conv`
    (a batch-1 convolution with one group per channel and an output-sized window).

    Args:
        x: Forward input ``(N, *S, C)``.
        g: Output cotangent ``(N, *So, C * m)``.
        kernel_spatial: Spatial kernel sizes ``K``.
        strides: Forward window strides.
        pads: Forward padding (may be negative).
        rhs_dilation: Forward kernel dilation.

    Returns:
        Kernel cotangent ``(*K, 1, C * m)``.
    """
    n = x.ndim - 2
    batch, *_, channels = x.shape
    out_spatial = g.shape[1:-1]
    multiplier = g.shape[-1] // channels
    acc_dtype = jnp.promote_types(x.dtype, jnp.float32)
    edge = (0, 0, 0)
    x_pad = lax.pad(
        x.astype(acc_dtype),
        jnp.zeros((), acc_dtype),
        [edge, *((lo, hi, 0) for lo, hi in pads), edge],
    )
    g = g.astype(acc_dtype).reshape(batch, *out_spatial, channels, multiplier)
    taps = []
    for tap in np.ndindex(*kernel_spatial):
        start = (0, *(k * d for k, d in zip(tap, rhs_dilation, strict=False)), 0)
        limit = (
            batch,
            *(
                b + (o - 1) * s + 1
                for b, o, s in zip(start[1:-1], out_spatial, strides, strict=False)
            ),
            channels,
        )
        window = lax.slice(x_pad, start, limit, (1, *strides, 1))
        taps.append(jnp.sum(window[..., None] * g, axis=tuple(range(n + 1))))
    return jnp.stack(taps).reshape(*kernel_spatial, 1, channels * multiplier)


def _canonical_conv_bwd(
    strides: IntTuple,
    pads: Pads,
    lhs_dilation: IntTuple,
    rhs_dilation: IntTuple,
    groups: int,
    precision: Any,
    residuals: tuple[jax.Array, jax.Array],
    g: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Backward pass of :func:`_canonical_conv`, built from canonical convolutions.

    Args:
        strides: Forward window strides.
        pads: Forward padding.
        lhs_dilation: Forward input dilation.
        rhs_dilation: Forward kernel dilation.
        groups: Forward ``feature_group_count``.
        precision: Forward precision.
        residuals: ``(x, w)`` from the forward pass.
        g: Output cotangent ``(N, *So, O)``.

    Returns:
        Cotangents ``(dx, dw)`` with the shapes of ``x`` and ``w``.
    """
    x, w = residuals
    n = x.ndim - 2
    in_spatial = x.shape[1:-1]
    kernel_spatial = w.shape[:n]
    g = g.astype(x.dtype)

    # Input gradient: dy (N, *So, O) * flipped kernel (*K, Og, G*I) -> (N, *S, C).
    padding = geometry.lhs_grad_padding(
        in_spatial, kernel_spatial, strides, g.shape[1:-1], pads, lhs_dilation, rhs_dilation
    )
    dx = _canonical_conv(
        g,
        _flip_and_swap_kernel(w, groups),
        lhs_dilation,
        padding,
        strides,
        rhs_dilation,
        groups,
        precision,
    )

    depthwise = groups > 1 and w.shape[n] == 1
    if (
        depthwise
        and all(d == 1 for d in lhs_dilation)
        and int(np.prod(kernel_spatial)) <= DEPTHWISE_TAPS_MAX_WINDOW
    ):
        dw = _depthwise_weight_grad_taps(x, g, kernel_spatial, strides, pads, rhs_dilation)
    else:
        dw = _weight_grad_conv(
            x, g, kernel_spatial, strides, pads, lhs_dilation, rhs_dilation, groups, precision
        )
    return dx.astype(x.dtype), dw.astype(w.dtype)


_canonical_conv.defvjp(_canonical_conv_fwd, _canonical_conv_bwd)


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """Drop-in replacement for :func:`jax.lax.conv_general_dilated`.

    Same values and (reverse-mode) gradients as lax, but every convolution emitted
    for the forward pass and for the gradients is in XLA:CPU's canonical form (see
    the module docstring), so it stays on the fast path inside loop bodies.
    Unsupported configurations (see `conv_geometry.is_supported`) are forwarded to
    :func:`jax.lax.conv_general_dilated` unchanged.

    Args:
        lhs: Input of rank ``n + 2``.
        rhs: Kernel of rank ``n + 2``.
        window_strides: ``n`` window strides.
        padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` or ``n`` ``(low, high)`` pairs.
        lhs_dilation: Optional ``n`` input dilation factors (transposed convolution).
        rhs_dilation: Optional ``n`` kernel dilation factors (atrous convolution).
        dimension_numbers: ``None``, a ``lax.ConvDimensionNumbers`` or a 3-tuple of
            strings such as ``('NHWC', 'HWIO', 'NHWC')``.
        feature_group_count: Number of feature groups (``C`` for depthwise).
        batch_group_count: Number of batch groups.
        precision: Passed to every convolution.
        preferred_element_type: ``None`` or the operand dtype on the canonical route.
        out_sharding: Must be ``None`` for the canonical route.

    Returns:
        The convolution result, laid out as ``dimension_numbers`` asks.
    """
    lhs = jnp.asarray(lhs)
    rhs = jnp.asarray(rhs)
    if not geometry.is_supported(
        lhs,
        rhs,
        padding,
        lhs_dilation,
        feature_group_count,
        batch_group_count,
        preferred_element_type,
        out_sharding,
    ):
        return _lax_conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation,
            dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count,
            batch_group_count=batch_group_count,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )

    n = lhs.ndim - 2
    lhs_spec, rhs_spec, out_spec = lax.conv_dimension_numbers(
        lhs.shape, rhs.shape, dimension_numbers
    )
    strides = geometry.as_int_tuple(window_strides, n)
    lhs_dil = geometry.as_int_tuple(lhs_dilation, n)
    rhs_dil = geometry.as_int_tuple(rhs_dilation, n)
    in_spatial = tuple(lhs.shape[d] for d in lhs_spec[2:])
    kernel_spatial = tuple(rhs.shape[d] for d in rhs_spec[2:])
    pads = geometry.resolve_padding(padding, in_spatial, kernel_spatial, strides, rhs_dil)

    x = _transpose_if_needed(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    w = _transpose_if_needed(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    groups = feature_group_count
    if batch_group_count > 1:
        # Batch group b (a contiguous block of the batch) only meets output-feature
        # group b: move it into the feature dimension and use feature groups.
        batch, channels = x.shape[0], x.shape[-1]
        x = x.reshape(batch_group_count, batch // batch_group_count, *in_spatial, channels)
        x = jnp.transpose(x, (1, *range(2, n + 2), 0, n + 2))
        x = x.reshape(batch // batch_group_count, *in_spatial, batch_group_count * channels)
        groups = batch_group_count

    # JAX records the operations inside a custom_vjp with a stack that stops at
    # its own frames: give them the caller's, so that a floating point trap (or
    # any error JAX reports by source line) names the layer that convolved.
    with source_info_util.user_context(source_info_util.current().traceback):
        y = _canonical_conv(
            x, w, strides, pads, lhs_dil, rhs_dil, groups, geometry.hashable_precision(precision)
        )
    # Canonical output axis of logical dim k (batch, feature, spatial...).
    canonical_axis = (0, n + 1, *range(1, n + 1))
    perm = [0] * (n + 2)
    for k, axis in enumerate(out_spec):
        perm[axis] = canonical_axis[k]
    return _transpose_if_needed(y, tuple(perm))


def _transpose_if_needed(x: jax.Array, perm: IntTuple) -> jax.Array:
    """``jnp.transpose`` that skips the identity permutation."""
    if perm == tuple(range(x.ndim)):
        return x
    return jnp.transpose(x, perm)


__all__ = ["DEPTHWISE_TAPS_MAX_WINDOW", "canonical_convolutions", "conv_general_dilated",
           "trace_for"]
