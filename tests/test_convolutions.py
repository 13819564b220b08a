"""Tests for :mod:`canonical_conv`: values, gradients and the emitted HLO."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from keras_ipu.device import conv_geometry
from keras_ipu.device import convolutions as cc

RTOL = 1e-5
ATOL = 1e-5

NHWC = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}
NCHW = {1: ("NCW", "OIW", "NCW"), 2: ("NCHW", "OIHW", "NCHW")}
CANONICAL_LABELS = {1: "b0f_0io->b0f", 2: "b01f_01io->b01f", 3: "b012f_012io->b012f"}

# Odd spatial sizes large enough for a 5-tap kernel with dilation 2 under VALID.
SPATIAL = {1: (13,), 2: (11, 9)}
BATCH = 2
CHANNELS = 4

# (feature_group_count, output channels); the count "C" means depthwise.
GROUPINGS = {
    "dense": (1, 6),
    "grouped": (2, 6),
    "depthwise_m1": (CHANNELS, CHANNELS),
    "depthwise_m2": (CHANNELS, 2 * CHANNELS),
}
PADDINGS = {"SAME": "SAME", "VALID": "VALID", "explicit": ((2, 0), (1, 3))}


def _operand(shape: tuple[int, ...], seed: int, dtype: Any = jnp.float32) -> jax.Array:
    """Deterministic test operand with values in [-1, 1)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.uniform(-1.0, 1.0, shape), dtype)


def _make_operands(
    ndim: int, layout: str, groups: int, out_channels: int, ksize: int
) -> tuple[jax.Array, jax.Array, tuple[str, str, str]]:
    """Input, kernel and dimension numbers for one grid point."""
    spatial = SPATIAL[ndim]
    kernel_spatial = (ksize,) * ndim
    in_per_group = CHANNELS // groups
    if layout == "NHWC":
        dn = NHWC[ndim]
        x_shape = (BATCH, *spatial, CHANNELS)
        w_shape = (*kernel_spatial, in_per_group, out_channels)
    else:
        dn = NCHW[ndim]
        x_shape = (BATCH, CHANNELS, *spatial)
        w_shape = (out_channels, in_per_group, *kernel_spatial)
    return _operand(x_shape, 0), _operand(w_shape, 1), dn


def _loss_fn(conv: Callable[..., jax.Array], **kwargs: Any) -> Callable[..., jax.Array]:
    """Scalar loss with a non-uniform output cotangent."""

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        y = conv(x, w, **kwargs)
        weights = jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
        return jnp.sum(y * weights)

    return loss


def _value_and_grads(x: jax.Array, w: jax.Array, **kwargs: Any) -> tuple[Any, Any]:
    """(lax, canonical) results of value_and_grad w.r.t. both operands, one compile."""

    @jax.jit
    def both(x: jax.Array, w: jax.Array) -> tuple[Any, Any]:
        ref = jax.value_and_grad(_loss_fn(lax.conv_general_dilated, **kwargs), (0, 1))(x, w)
        new = jax.value_and_grad(_loss_fn(cc.conv_general_dilated, **kwargs), (0, 1))(x, w)
        prim_ref = lax.conv_general_dilated(x, w, **kwargs)
        prim_new = cc.conv_general_dilated(x, w, **kwargs)
        return (prim_ref, ref), (prim_new, new)

    return both(x, w)


def _assert_trees_close(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Element-wise closeness of two pytrees of arrays."""
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(v, np.float32), rtol, atol)


# Every 7th of the full product (576 cases): each value of each factor, in
# changing combinations, at a sixth of the compile time.
GRID = list(
    itertools.product(
        (1, 2), (1, 2), (1, 2), tuple(PADDINGS), tuple(GROUPINGS), ("NHWC", "NCHW"), (1, 3, 5)
    )
)[::7]


@pytest.mark.parametrize(
    "ndim,stride,dilation,padding,grouping,layout,ksize",
    GRID,
    ids=["-".join(map(str, p)) for p in GRID],
)
def test_matches_lax(
    ndim: int, stride: int, dilation: int, padding: str, grouping: str, layout: str, ksize: int
) -> None:
    """Values and both gradients equal lax over the configuration grid."""
    groups, out_channels = GROUPINGS[grouping]
    x, w, dn = _make_operands(ndim, layout, groups, out_channels, ksize)
    pad = PADDINGS[padding]
    kwargs = {
        "window_strides": (stride,) * ndim,
        "padding": pad if isinstance(pad, str) else pad[:ndim],
        "rhs_dilation": (dilation,) * ndim,
        "dimension_numbers": dn,
        "feature_group_count": groups,
    }
    ref, new = _value_and_grads(x, w, **kwargs)
    _assert_trees_close(ref, new)


DEPTHWISE_GRID = list(
    itertools.product((1, 2), (1, 2), (1, 2), tuple(PADDINGS), ("depthwise_m1", "depthwise_m2"))
)


@pytest.mark.parametrize(
    "ndim,stride,dilation,padding,grouping",
    DEPTHWISE_GRID,
    ids=["-".join(map(str, p)) for p in DEPTHWISE_GRID],
)
def test_depthwise_weight_grad_as_grouped_conv(
    monkeypatch: pytest.MonkeyPatch,
    ndim: int,
    stride: int,
    dilation: int,
    padding: str,
    grouping: str,
) -> None:
    """The grouped-convolution depthwise weight gradient (taps path disabled)."""
    monkeypatch.setattr(cc, "DEPTHWISE_TAPS_MAX_WINDOW", 0)
    groups, out_channels = GROUPINGS[grouping]
    x, w, dn = _make_operands(ndim, "NHWC", groups, out_channels, 3)
    pad = PADDINGS[padding]
    ref, new = _value_and_grads(
        x,
        w,
        window_strides=(stride,) * ndim,
        padding=pad if isinstance(pad, str) else pad[:ndim],
        rhs_dilation=(dilation,) * ndim,
        dimension_numbers=dn,
        feature_group_count=groups,
    )
    _assert_trees_close(ref, new)


@pytest.mark.parametrize(
    "spatial,stride,padding",
    [((8, 10), (2, 2), "VALID"), ((10, 8), (3, 2), "SAME"), ((6, 7), (2, 3), ((0, 1), (1, 0)))],
)
def test_even_sizes_negative_grad_padding(
    spatial: tuple[int, int], stride: tuple[int, int], padding: Any
) -> None:
    """Sizes where the weight gradient needs negative (cropping) padding."""
    x = _operand((BATCH, *spatial, CHANNELS), 2)
    w = _operand((3, 3, CHANNELS, 5), 3)
    ref, new = _value_and_grads(
        x, w, window_strides=stride, padding=padding, dimension_numbers=NHWC[2]
    )
    _assert_trees_close(ref, new)


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("groups", [1, 2])
def test_lhs_dilation(ndim: int, groups: int) -> None:
    """Transposed convolutions (``lhs_dilation > 1``), incl. large padding."""
    x = _operand((BATCH, *SPATIAL[ndim], CHANNELS), 4)
    w = _operand((*(3,) * ndim, CHANNELS // groups, 4), 5)
    pads = ((2, 1), (4, 0))[:ndim]
    ref, new = _value_and_grads(
        x,
        w,
        window_strides=(2,) * ndim,
        padding=pads,
        lhs_dilation=(2,) * ndim,
        rhs_dilation=(2, 1)[:ndim],
        dimension_numbers=NHWC[ndim],
        feature_group_count=groups,
    )
    _assert_trees_close(ref, new)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_batch_group_count(layout: str) -> None:
    """``batch_group_count > 1`` is rewritten into feature groups."""
    bgc = 2
    if layout == "NHWC":
        x = _operand((2 * bgc, 7, 9, 3), 6)
        w = _operand((3, 3, 3, 2 * bgc), 7)
    else:
        x = _operand((2 * bgc, 3, 7, 9), 6)
        w = _operand((2 * bgc, 3, 3, 3), 7)
    ref, new = _value_and_grads(
        x,
        w,
        window_strides=(1, 2),
        padding="SAME",
        dimension_numbers=NHWC[2] if layout == "NHWC" else NCHW[2],
        batch_group_count=bgc,
    )
    _assert_trees_close(ref, new)


def test_unusual_dimension_numbers_and_3d() -> None:
    """Arbitrary axis orders and a 3-D convolution."""
    x = _operand((5, 2, 9, 3), 8)  # H, N, W, C
    w = _operand((2, 3, 3, 4), 9)  # W, I, H, O
    dn = ("HNWC", "WIHO", "CWNH")
    ref, new = _value_and_grads(x, w, window_strides=(1, 2), padding="SAME", dimension_numbers=dn)
    _assert_trees_close(ref, new)
    x3 = _operand((2, 5, 6, 7, 3), 10)
    w3 = _operand((3, 3, 3, 3, 4), 11)
    dn3 = ("NDHWC", "DHWIO", "NDHWC")
    ref, new = _value_and_grads(
        x3, w3, window_strides=(1, 2, 1), padding="SAME", dimension_numbers=dn3
    )
    _assert_trees_close(ref, new)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision(dtype: Any) -> None:
    """Half-precision dtypes also take the canonical route."""
    x = _operand((BATCH, 9, 7, CHANNELS), 12, dtype)
    w = _operand((3, 3, CHANNELS, 6), 13, dtype)
    ref, new = _value_and_grads(
        x, w, window_strides=(2, 1), padding="SAME", dimension_numbers=NHWC[2]
    )
    _assert_trees_close(ref, new, rtol=2e-2, atol=2e-1)


def test_fallback_paths() -> None:
    """Unsupported arguments are forwarded to lax unchanged."""
    x = _operand((BATCH, 9, 7, CHANNELS), 14, jnp.float16)
    w = _operand((3, 3, CHANNELS, 6), 15, jnp.float16)
    kwargs = {"padding": "SAME", "dimension_numbers": NHWC[2], "preferred_element_type": "float32"}
    assert not conv_geometry.is_supported(x, w, "SAME", preferred_element_type=jnp.float32)
    ref = lax.conv_general_dilated(x, w, (1, 1), **kwargs)
    new = cc.conv_general_dilated(x, w, (1, 1), **kwargs)
    assert new.dtype == jnp.float32
    _assert_trees_close(ref, new)
    xi = jnp.ones((1, 5, 5, 2), jnp.int32)
    wi = jnp.ones((3, 3, 2, 2), jnp.int32)
    assert not conv_geometry.is_supported(xi, wi, "SAME")
    _assert_trees_close(
        lax.conv_general_dilated(xi, wi, (1, 1), "SAME", dimension_numbers=NHWC[2]),
        cc.conv_general_dilated(xi, wi, (1, 1), "SAME", dimension_numbers=NHWC[2]),
    )


def test_forward_mode_autodiff_is_traced_with_lax_convolutions() -> None:
    """jvp through a convolution traces with the rewrite's custom_vjp but cannot lower:
    `trace_for` traces it again with lax's (before, predict of such a model failed)."""
    x = _operand((BATCH, 9, 7, CHANNELS), 16, jnp.float32)
    w = _operand((3, 3, CHANNELS, 6), 17, jnp.float32)

    def conv(x):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC[2])

    for inner in (conv, jax.jit(conv)):  # a jit inside the program has its own trace cache
        jitted = jax.jit(lambda x, inner=inner: jax.jvp(inner, (x,), (jnp.ones_like(x),)))
        traced = cc.trace_for("cpu", jitted, x)
        assert "custom_lin" not in str(traced.jaxpr)
        _assert_trees_close(jax.jvp(conv, (x,), (jnp.ones_like(x),)),
                            traced.lower().compile()(x))
    plain = jax.jit(lambda x: conv(x))  # without forward mode, the rewrite stays
    assert "custom_vjp_call" in str(cc.trace_for("cpu", plain, x).jaxpr)


def test_second_order() -> None:
    """grad-of-grad through the custom VJP matches lax."""
    x = _operand((BATCH, 9, 7, CHANNELS), 16)
    w = _operand((3, 3, 1, 2 * CHANNELS), 17)
    kwargs = {
        "window_strides": (2, 1),
        "padding": "SAME",
        "dimension_numbers": NHWC[2],
        "feature_group_count": CHANNELS,
    }

    def outer(conv: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        inner = jax.grad(_loss_fn(conv, **kwargs), (0, 1))

        def f(x: jax.Array, w: jax.Array) -> jax.Array:
            gx, gw = inner(x, w)
            return jnp.sum(jnp.sin(gx)) + jnp.sum(gw**2)

        return jax.jit(jax.grad(f, (0, 1)))

    _assert_trees_close(outer(lax.conv_general_dilated)(x, w), outer(cc.conv_general_dilated)(x, w))


# --------------------------------------------------------------------------- HLO checks


def _conv_dim_labels(hlo_text: str) -> list[str]:
    """``dim_labels`` of every ``convolution(`` in optimized HLO text."""
    labels = []
    for line in hlo_text.splitlines():
        if "convolution(" in line:
            match = re.search(r"dim_labels=([^,\s]+)", line)
            assert match is not None, line
            labels.append(match.group(1))
    return labels


def _scanned_train_hlo(conv: Callable[..., jax.Array], ndim: int, groups: int, mult: int) -> str:
    """Optimized HLO of a ``lax.scan`` over loss-gradient steps of a two-conv model."""
    spatial = (12, 11)[:ndim]
    x = _operand((4, *spatial, 8), 20)
    w1 = _operand((*(3,) * ndim, 8 // groups, 8 * mult), 21)
    w2 = _operand((*(2,) * ndim, 8 * mult, 6), 22)
    dn = NHWC[ndim]

    def loss(params: tuple[jax.Array, jax.Array], x: jax.Array) -> jax.Array:
        h = conv(
            x, params[0], (2,) * ndim, "SAME", dimension_numbers=dn, feature_group_count=groups
        )
        h = jnp.tanh(h)
        y = conv(h, params[1], (1,) * ndim, "VALID", dimension_numbers=dn)
        return jnp.mean(y**2)

    def step(params: tuple[jax.Array, jax.Array], _: None) -> tuple[Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, x)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params, value

    def run(params: tuple[jax.Array, jax.Array]) -> Any:
        return lax.scan(step, params, None, length=3)

    return jax.jit(run).lower((w1, w2)).compile().as_text()


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("groups,mult", [(1, 1), (2, 1), (8, 1), (8, 2)])
def test_scan_hlo_is_canonical(ndim: int, groups: int, mult: int) -> None:
    """Every convolution in the compiled scan (forward and backward) is canonical."""
    labels = _conv_dim_labels(_scanned_train_hlo(cc.conv_general_dilated, ndim, groups, mult))
    # 2 forward + 1 input grad + 2 weight grads (the depthwise one is computed per tap).
    assert len(labels) >= (4 if groups == 8 else 5), labels
    assert set(labels) == {CANONICAL_LABELS[ndim]}, labels


@pytest.mark.parametrize("loop", ["while", "cond"])
def test_while_and_cond_hlo_is_canonical(loop: str) -> None:
    """Convolutions in ``fori_loop`` bodies and ``cond`` branches are canonical too."""
    x = _operand((2, 9, 7, 4), 25)
    w = _operand((3, 3, 2, 8), 26)
    kwargs = {
        "window_strides": (2, 1),
        "padding": "SAME",
        "dimension_numbers": NHWC[2],
        "feature_group_count": 2,
    }
    grad = jax.grad(lambda w: jnp.sum(jnp.tanh(cc.conv_general_dilated(x, w, **kwargs))))

    def run(w: jax.Array) -> jax.Array:
        if loop == "while":
            return lax.fori_loop(0, 3, lambda _, w: w - 0.1 * grad(w), w)
        return lax.cond(jnp.sum(w) > 0, grad, lambda w: -grad(w), w)

    labels = _conv_dim_labels(jax.jit(run).lower(w).compile().as_text())
    assert len(labels) >= 2, labels
    assert set(labels) == {CANONICAL_LABELS[2]}, labels


# Convolutions whose window is larger than their input: XLA's ConvOperandSwapper would
# swap their operands (non-canonical labels + window reversal) unless prevented.
SWAP_CASES = {
    "3x3_same_on_2x2": ((2, 2, 2, 4), {"padding": "SAME"}),
    "3x3_same_on_1x1": ((2, 1, 1, 4), {"padding": "SAME"}),
    "3x3_explicit_on_1x3": ((2, 1, 3, 4), {"padding": ((2, 1), (1, 1))}),
    "large_explicit_padding": ((2, 6, 5, 4), {"padding": ((3, 3), (4, 2))}),
    "lhs_dilation": ((2, 6, 5, 4), {"padding": ((2, 2), (2, 1)), "lhs_dilation": (2, 2)}),
    "lhs_dilation_strided": (
        (2, 6, 5, 4),
        {"padding": ((1, 2), (2, 2)), "lhs_dilation": (3, 2), "window_strides": (2, 1)},
    ),
}


@pytest.mark.parametrize("case", list(SWAP_CASES))
def test_operand_swap_is_prevented(case: str) -> None:
    """Values match and the convolutions stay canonical when the kernel exceeds the input."""
    shape, extra = SWAP_CASES[case]
    x = _operand(shape, 27)
    w = _operand((3, 3, 4, 5), 28)
    kwargs = {"window_strides": (1, 1), "dimension_numbers": NHWC[2], **extra}
    ref, new = _value_and_grads(x, w, **kwargs)
    _assert_trees_close(ref, new)

    grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(cc.conv_general_dilated(x, w, **kwargs))), (0, 1))

    def run(w: jax.Array) -> Any:
        return lax.scan(lambda c, _: (c - 0.1 * grad(c, x)[0], grad(c, x)[1]), w, None, length=2)

    labels = _conv_dim_labels(jax.jit(run).lower(w).compile().as_text())
    assert len(labels) >= 3, labels
    assert set(labels) == {CANONICAL_LABELS[2]}, labels


def test_scan_hlo_lax_is_not_canonical() -> None:
    """Sanity check of the HLO parser: plain lax emits non-canonical convs in the loop."""
    labels = _conv_dim_labels(_scanned_train_hlo(lax.conv_general_dilated, 2, 1, 1))
    assert set(labels) - {CANONICAL_LABELS[2]}, labels


def test_second_order_hlo_is_canonical() -> None:
    """grad-of-grad inside a scan only emits canonical convolutions too."""
    x = _operand((2, 9, 7, 4), 23)
    w = _operand((3, 3, 4, 5), 24)
    kwargs = {"window_strides": (2, 2), "padding": "SAME", "dimension_numbers": NHWC[2]}
    inner = jax.grad(lambda x, w: jnp.sum(jnp.tanh(cc.conv_general_dilated(x, w, **kwargs))), 1)

    def body(w: jax.Array, _: None) -> tuple[jax.Array, None]:
        return w - 0.01 * jax.grad(lambda w: jnp.sum(inner(x, w) ** 2))(w), None

    hlo = jax.jit(lambda w: lax.scan(body, w, None, length=2)).lower(w).compile().as_text()
    labels = _conv_dim_labels(hlo)
    assert labels and set(labels) == {CANONICAL_LABELS[2]}, labels
