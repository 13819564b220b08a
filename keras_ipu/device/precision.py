"""What a program computes in 16-bit floats, read from its jaxpr, for the IPU's accounting.

An IPU multiplies matrices in float16 (and bfloat16) at four times its
float32 rate (`IPUHardware.flops_per_cycle`) and keeps 16-bit values in 16
bits. XLA:CPU, on which the device model runs on a laptop or in CI, computes
16-bit floats in float32: it converts them around each operation, so its
memory analysis holds a mixed precision program's temporaries in 32 bits. The
program itself says what an IPU would do:

- `is_half_precision`: whether most of its matrix work (by flops) takes
  16-bit operands (the report's cycles no longer use it: `device/cost.py`
  counts each matrix op at its own rate).
- `temporary_scale`: on a platform that holds 16-bit floats in 32 bits, the
  factor that brings its temporaries to 16 bits: the program's peak live
  bytes with its values in their own dtypes over the same with the 16-bit
  ones in 32 bits (1 for a float32 program, or on other platforms);
  `held_in_16_bits` applies it to a measured `MemoryUse`.

Example:

>>> jaxpr = jax.make_jaxpr(step)(state, batch)
>>> is_half_precision(jaxpr), temporary_scale(jaxpr, "cpu")
(True, 0.55)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from keras_ipu.device.accounting import MemoryUse

HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# The matrix work that runs at the 16-bit rate when its operands are 16-bit.
MATRIX_PRIMITIVES = ("dot_general", "conv_general_dilated")
# Platforms whose XLA computes 16-bit floats in float32.
UPCASTING_PLATFORMS = ("cpu",)


def matrix_flops(jaxpr: Any) -> tuple[float, float]:
    """Flops of a program's matrix products and convolutions, by operand precision.

    A loop's body counts once per iteration (`scan`), any other sub-program
    once.

    Args:
        jaxpr: A jaxpr or closed jaxpr (sub-jaxprs are read too).

    Returns:
        `(flops with 16-bit operands, flops with others)`.

    Example:

    >>> matrix_flops(jax.make_jaxpr(jnp.matmul)(a16, b16))
    (4096.0, 0.0)
    """
    half = other = 0.0
    for eqn, repeats in _equations(getattr(jaxpr, "jaxpr", jaxpr), 1.0):
        if eqn.primitive.name not in MATRIX_PRIMITIVES:
            continue
        flops = repeats * _flops(eqn)
        if np.dtype(eqn.invars[0].aval.dtype) in HALF_DTYPES:
            half += flops
        else:
            other += flops
    return half, other


def is_half_precision(jaxpr: Any) -> bool:
    """Whether most of a program's matrix work (by flops) takes 16-bit operands.

    Args:
        jaxpr: A jaxpr or closed jaxpr.

    Returns:
        `True` when its 16-bit matrix flops outnumber the others (a program
        without matrix work is not half precision).

    Example:

    >>> is_half_precision(jax.make_jaxpr(step)(state, batch))   # mixed_bfloat16
    True
    """
    half, other = matrix_flops(jaxpr)
    return half > other


def temporary_scale(jaxpr: Any, platform: str) -> float:
    """The factor from a platform's temporaries to an IPU's, for 16-bit values.

    Args:
        jaxpr: The compiled program's jaxpr (or closed jaxpr).
        platform: The JAX platform that compiled it (`"cpu"`, `"gpu"`, ...).

    Returns:
        On a platform that holds 16-bit floats in 32 bits, the program's
        peak live bytes over the same with 16-bit floats counted at 4 bytes
        each; 1.0 elsewhere, and for programs without 16-bit values.

    Example:

    >>> temporary_scale(jax.make_jaxpr(step)(state, batch), "cpu")
    0.55
    """
    if platform not in UPCASTING_PLATFORMS:
        return 1.0
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if not any(_is_half(v.aval) for eqn, _ in _equations(jaxpr, 1.0) for v in eqn.outvars):
        return 1.0  # nothing 16-bit: the two peaks are the same
    held = peak_live_bytes(jaxpr)
    upcast = peak_live_bytes(jaxpr, _upcast_itemsize, matrix_input_copies=True)
    return held / upcast if upcast else 1.0


def held_in_16_bits(use: MemoryUse, jaxpr: Any, platform: str) -> MemoryUse:
    """A program's memory use with its temporaries as an IPU holds them (`temporary_scale`).

    Args:
        use: The memory use measured on `platform`.
        jaxpr: The measured program's jaxpr (or closed jaxpr).
        platform: The JAX platform that compiled it.

    Returns:
        `use`, its temporaries scaled (the same `use` for float32 programs).

    Example:

    >>> held_in_16_bits(accounting.memory_use(compiled, state_bytes=s, io_bytes=b),
    ...                 traced.jaxpr, "cpu").temporary_bytes
    """
    scale = temporary_scale(jaxpr, platform)
    if scale == 1.0:
        return use
    return dataclasses.replace(use, temporary_bytes=int(round(use.temporary_bytes * scale)))


def peak_live_bytes(jaxpr: Any, itemsize: Callable[[np.dtype], int] | None = None,
                    matrix_input_copies: bool = False) -> int:
    """The most bytes a program's intermediate values hold at once, in program order.

    A value is live from the operation that makes it to its last use; the
    program's inputs and outputs are not intermediates. An operation with
    sub-programs (loops, conditionals, calls) holds their peak too while it
    runs. Operations are not fused: this is a bound to compare programs by,
    not XLA's figure.

    Args:
        jaxpr: A jaxpr or closed jaxpr.
        itemsize: Bytes per element of a dtype (`dtype.itemsize` by default).
        matrix_input_copies: Whether a (sub-)program's 16-bit inputs that
            a matrix product or convolution takes count too, as float32
            copies live from its start to their last use: XLA:CPU converts
            such operands (the weights of a float16 model, say) to float32
            up front, where it fuses the conversions of elementwise work
            (measured: 3 x Dense(256) in float16 at batch 16, 819,200
            temporary bytes, the three weights' float32 copies and two
            float32 activations).

    Returns:
        The peak, in bytes.

    Example:

    >>> peak_live_bytes(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(4)))
    16
    """
    size = itemsize or (lambda dtype: dtype.itemsize)
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    outputs = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jex.Var):
                last_use[v] = i
    held: dict[Any, int] = _matrix_input_copies(jaxpr) if matrix_input_copies else {}
    live = peak = sum(held.values())
    for i, eqn in enumerate(jaxpr.eqns):
        inner = max((peak_live_bytes(sub, size, matrix_input_copies)
                     for sub in jex.jaxprs_in_params(eqn.params)), default=0)
        made = [v for v in eqn.outvars if not isinstance(v, jex.DropVar) and v not in outputs]
        for v in made:
            held[v] = _bytes(v.aval, size)
        out = sum(held[v] for v in made)
        peak = max(peak, live + inner + out)
        live += out
        for v in {*[v for v in eqn.invars if isinstance(v, jex.Var)], *made}:
            if v in held and last_use.get(v, i) <= i:
                live -= held.pop(v)
    return peak


def _matrix_input_copies(jaxpr: Any) -> dict[Any, int]:
    """The float32 bytes of the 16-bit inputs of `jaxpr` that its matrix ops take."""
    inputs = {v for v in (*jaxpr.constvars, *jaxpr.invars) if _is_half(v.aval)}
    taken = {v for eqn in jaxpr.eqns if eqn.primitive.name in MATRIX_PRIMITIVES
             for v in eqn.invars if isinstance(v, jex.Var) and v in inputs}
    return {v: _bytes(v.aval, _upcast_itemsize) for v in taken}


def _is_half(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and dtype in HALF_DTYPES


def _upcast_itemsize(dtype: np.dtype) -> int:
    return 4 if dtype in HALF_DTYPES else dtype.itemsize


def _bytes(aval: Any, itemsize: Callable[[np.dtype], int]) -> int:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0  # tokens and other non-array values
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return 0  # extended dtypes (PRNG keys)
    return int(np.prod(shape)) * itemsize(dtype)


def _equations(jaxpr: Any, repeats: float):
    """`(equation, times it runs)` of a jaxpr and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn, repeats
        inner = repeats * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else repeats
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from _equations(sub, inner)


def _flops(eqn: Any) -> float:
    """Multiply-adds × 2 of a `dot_general` or `conv_general_dilated`."""
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * float(np.prod(out.shape)) * float(np.prod([lhs[d] for d in contracting]))
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * float(np.prod(out.shape)) * float(np.prod(rhs)) / max(out_features, 1)


__all__ = ["HALF_DTYPES", "MATRIX_PRIMITIVES", "UPCASTING_PLATFORMS", "held_in_16_bits",
           "is_half_precision", "matrix_flops", "peak_live_bytes", "temporary_scale"]
