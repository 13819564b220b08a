"""Contracts of the JAX private APIs keras_ipu relies on (jax >= 0.10.2, < 0.12).

Each test pins one private API: if a JAX upgrade changes it, the test that
names it fails, and the code that uses it is the place to look (keras_ipu
then falls back to JAX's own behaviour, slower but the same numbers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keras_ipu.device import lowering


def _dropout(key, x):
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    return jnp.where(keep, x / 0.9, 0.0)


def test_threefry_lowering_can_be_overridden_per_lowering():
    # device/lowering.py: `Traced.lower(_private_parameters=LoweringParameters(
    # override_lowering_rules=...))` with the generic rule of `threefry2x32_p`.
    assert lowering._CPU_PARAMETERS is not None
    key, x = jax.random.key(0), jnp.ones((4, 64))
    own = jax.jit(_dropout).trace(key, x).lower()
    unrolled = lowering.lower_for("cpu", jax.jit(_dropout).trace(key, x))
    assert "while" in own.as_text()  # JAX's CPU rule: a loop of 5 rounds
    assert "while" not in unrolled.as_text()
    np.testing.assert_array_equal(np.asarray(unrolled.compile()(key, x)),
                                  np.asarray(own.compile()(key, x)))


def test_the_override_leaves_other_lowerings_alone():
    key, x = jax.random.key(1), jnp.ones((4, 64))
    lowering.lower_for("cpu", jax.jit(_dropout).trace(key, x))
    assert "while" in jax.jit(lambda k, v: _dropout(k, v) * 1.0).trace(key, x).lower().as_text()


def test_a_traced_jaxpr_runs_with_other_captured_values():
    # device/switch.py: `jax.extend.core.jaxpr_as_fun(ClosedJaxpr(jaxpr, consts))`
    # runs a jaxpr traced by `make_jaxpr` with the values it captured replaced
    # (under a vmap, the batched ones become the custom rule's arguments).
    import jax.extend.core as jex

    captured = jnp.arange(3.0)
    traced, shape = jax.make_jaxpr(lambda x: (x * captured, None), return_shape=True)(
        jnp.ones(3))
    assert len(traced.consts) == 1 and shape[1] is None
    run = jex.jaxpr_as_fun(jex.ClosedJaxpr(traced.jaxpr, [jnp.full(3, 2.0)]))
    np.testing.assert_array_equal(np.asarray(run(jnp.ones(3))[0]), np.full(3, 2.0))


def test_operations_traced_in_a_user_context_carry_its_traceback():
    # device/convolutions.py: `source_info_util.user_context(current().traceback)`
    # gives the operations inside its custom_vjp the caller's stack.
    from jax._src import source_info_util

    @jax.custom_vjp
    def double(x):
        return x * 2.0

    double.defvjp(lambda x: (double(x), None), lambda _, g: (g * 2.0,))

    def caller_of_double(x):
        with source_info_util.user_context(source_info_util.current().traceback):
            return double(x)

    inner = jax.make_jaxpr(caller_of_double)(1.0).jaxpr.eqns[0].params["call_jaxpr"].jaxpr
    frames = inner.eqns[0].source_info.traceback.frames
    assert any(frame.function_name.endswith("caller_of_double") for frame in frames)


def test_clearing_jaxs_caches_traces_a_function_anew():
    # device/convolutions.py `trace_for`: `jax.clear_caches()`, so that a trace after a
    # change of what the function calls (lax's convolution swapped back) is not the cached
    # one, for the jits inside it too.
    scale = [2.0]
    inner = jax.jit(lambda x: x * scale[0])
    jitted = jax.jit(lambda x: inner(x) + 1.0)
    assert "2.0" in str(jitted.trace(1.0).jaxpr)
    scale[0] = 3.0
    assert "2.0" in str(jitted.trace(1.0).jaxpr)  # the cached trace
    jax.clear_caches()
    assert "3.0" in str(jitted.trace(1.0).jaxpr)


def test_the_opaque_trace_state_tells_a_transformation_inside_a_trace():
    # keras_ipu.device.program_outfeeds refuses an enqueue made in another trace than its
    # program's (jax.grad inside the computation) by comparing these states.
    from jax._src import core

    seen = []

    def computation(x):
        seen.append(core.get_opaque_trace_state(convention="nnx"))
        seen.append(core.get_opaque_trace_state(convention="nnx"))

        def inner(y):
            seen.append(core.get_opaque_trace_state(convention="nnx"))
            return (y * 2).sum()

        return jax.grad(inner)(x)

    jax.jit(computation)(jax.numpy.ones(2))
    assert seen[0] == seen[1] and seen[2] != seen[0]


def test_a_tracers_trace_is_named_as_the_opaque_trace_state_names_the_running_one():
    # keras_ipu.device.program_outfeeds.trace_of: which trace made a value assigned inside
    # jax.grad (a tangent's: refused) or handed back to the enclosing one (a count: kept).
    from jax._src import core

    seen = {}

    def computation(x):
        seen["outer"] = core.get_opaque_trace_state(convention="nnx")

        def inner(y):
            seen["inner"] = core.get_opaque_trace_state(convention="nnx")
            seen["tangent"] = core.OpaqueTraceState((y * 2)._trace._weakref)
            seen["handed_back"] = core.OpaqueTraceState((x + 1)._trace._weakref)
            return (y * 2).sum()

        return jax.grad(inner)(x)

    jax.jit(computation)(jax.numpy.ones(2))
    assert seen["tangent"] == seen["inner"] != seen["outer"] == seen["handed_back"]


def test_conv_transpose_calls_its_modules_conv_general_dilated(monkeypatch):
    # keras_ipu.device.convolutions routes lax.conv_transpose (Keras' Conv*Transpose)
    # through its canonical convolutions by replacing this module's function.
    from jax._src.lax import convolution

    calls = []
    original = convolution.conv_general_dilated

    def recorded(*args, **kwargs):
        calls.append(kwargs.get("dimension_numbers", args[6] if len(args) > 6 else None))
        return original(*args, **kwargs)

    monkeypatch.setattr(convolution, "conv_general_dilated", recorded)
    jax.lax.conv_transpose(jax.numpy.ones((1, 4, 4, 2)), jax.numpy.ones((3, 3, 2, 2)),
                           (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert len(calls) == 1


def test_jaxs_transformations_name_the_function_they_wrap():
    # device/closures.py: a kept program's key follows `__wrapped__` from `jax.grad`,
    # `value_and_grad`, `vmap` and `jit` to the user's function, whose globals it compares.
    def loss(w):
        return jnp.sum(w * w)

    for transformed in (jax.grad(loss), jax.value_and_grad(loss), jax.vmap(loss),
                        jax.jit(loss)):
        assert transformed.__wrapped__ is loss


def test_a_failed_callback_stays_in_the_runtime_tokens_until_they_are_cleared():
    # ops/host_embedding.py: leaving `register()` waits with `jax.effects_barrier()`; the
    # error of a program whose host callback failed on several devices stays in
    # `dispatch.runtime_tokens` (every later barrier raised it) until `clear()`.
    from jax._src import dispatch
    from jax.experimental import io_callback
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    def host(x):
        if x.sum() > 100:
            raise ValueError("a failing callback")
        return x

    def fetch(x):
        return io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=False)

    mesh = Mesh(np.array(jax.devices()[:2]), ("replica",))
    program = jax.jit(jax.shard_map(fetch, mesh=mesh, in_specs=P("replica"),
                                    out_specs=P("replica")))
    with pytest.raises(jax.errors.JaxRuntimeError):
        jax.block_until_ready(program(jnp.array([1.0, 1000.0])))
    with pytest.raises(jax.errors.JaxRuntimeError):
        jax.effects_barrier()
    dispatch.runtime_tokens.clear()
    jax.effects_barrier()
