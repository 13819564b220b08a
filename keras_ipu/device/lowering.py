"""How keras_ipu lowers its programs: on CPUs, random bits with the hash unrolled.

JAX draws random bits (`jax.random`, hence Keras' `Dropout`, `GaussianNoise`,
random augmentation layers) with the Threefry-2x32 hash. On CPUs it lowers the
hash's 20 rounds as a loop of 5 (`fori_loop`), which keeps XLA's compile small
but runs each round as separate kernels, the intermediate words written to
memory and read back; elsewhere it lowers them unrolled, one fused
elementwise kernel. keras_ipu lowers its own programs for CPUs the unrolled
way: the same bits (the same hash of the same counters), drawn faster
(BENCHMARKS.md). Other JAX work in the process keeps JAX's rule: the rule is
overridden for one lowering at a time, through the lowering parameters of
`Traced.lower` (a private hook of JAX's, held by a contract test in
tests/test_jax_contracts.py); where this JAX lacks it, programs are lowered
as JAX lowers them.
"""

from __future__ import annotations

from typing import Any


def _unrolled_threefry_override() -> Any | None:
    """JAX's lowering parameters that lower Threefry with its generic (unrolled) rule.

    `None` where this JAX does not have what it takes.
    """
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32
    except ImportError:
        return None
    primitive = getattr(threefry2x32, "threefry2x32_p", None)
    generic = getattr(mlir, "_lowerings", {}).get(primitive)
    parameters = getattr(mlir, "LoweringParameters", None)
    if generic is None or parameters is None:
        return None
    try:
        return parameters(override_lowering_rules=((primitive, generic.rule),))
    except TypeError:  # the parameters changed shape
        return None


_CPU_PARAMETERS = _unrolled_threefry_override()


def lower_for(platform: str, traced: Any) -> Any:
    """`traced.lower()`, with JAX's random-bits hash unrolled on CPUs.

    Args:
        platform: The JAX platform the program will run on.
        traced: A `jax.stages.Traced` program.

    Returns:
        The `jax.stages.Lowered` program.

    Example:

    >>> lowered = lower_for("cpu", jax.jit(train_step).trace(state, batch))
    >>> "while" in lowered.as_text()  # a dropout's random bits: no loop
    False
    """
    if platform != "cpu" or _CPU_PARAMETERS is None:
        return traced.lower()
    return traced.lower(_private_parameters=_CPU_PARAMETERS)


__all__ = ["lower_for"]
