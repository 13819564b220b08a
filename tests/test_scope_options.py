"""`ipu.scopes`' option scopes and `ipu.nn_ops.multi_conv` (seed 002 §18.3, §18.14.7).

They steer the Poplar compiler, which the device model does not have: the
programs inside compute what they compute without them, the arguments are
checked, and eager work inside `outside_compilation_scope` runs on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import configure


def test_the_seeds_outside_compilation_example_computes_the_same():
    def my_net(a):
        b = a * a
        with ipu.scopes.outside_compilation_scope():
            c = b + 2  # in a compiled program it stays in the program
        return b + c

    a = np.arange(4, dtype=np.float32)
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [d] = ipu.ipu_compiler.compile(my_net, inputs=[a])
    np.testing.assert_array_equal(d, 2 * a * a + 2)


def test_eager_work_outside_compilation_runs_on_the_host():
    configure(2)
    host = jax.devices("cpu")[0]
    with ipu.scopes.ipu_scope("/device:IPU:0"), ipu.scopes.ipu_shard(1):
        on_ipu = jnp.ones(3) + 1
        with ipu.scopes.outside_compilation_scope("host"):
            on_host = jnp.ones(3) + 1
    ipu_device = ipu.device.system.require().ipus_of_device(0)[1].device
    assert on_ipu.devices() == {ipu_device} and ipu_device != host
    assert on_host.devices() == {host}


@pytest.mark.parametrize("scope", [
    lambda: ipu.scopes.partials_type(np.float16),
    lambda: ipu.scopes.partials_type("float32"),
    lambda: ipu.scopes.stochastic_rounding(True),
    lambda: ipu.scopes.stochastic_rounding(np.bool_(False)),  # a NumPy configuration's
    lambda: ipu.scopes.frontend_attribute("PARTIALS_TYPE", "DT_HALF", restore_to="DT_FLOAT"),
    lambda: ipu.scopes.ipu_jit_scope("encoder"),
])
def test_option_scopes_leave_the_program_as_it_is(scope):
    def net(x):
        return jnp.tanh(x @ x.T).sum(axis=0)

    x = np.random.default_rng(0).random((3, 3)).astype(np.float32)
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [expected] = ipu.ipu_compiler.compile(net, inputs=[x])
        with scope():
            [result] = ipu.ipu_compiler.compile(net, inputs=[x])
    np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("scope, error, message", [
    (lambda: ipu.scopes.partials_type(np.int8), ValueError, "float16 or float32, got"),
    (lambda: ipu.scopes.partials_type("half-ish"), ValueError, "float16 or float32"),
    (lambda: ipu.scopes.stochastic_rounding(1), TypeError, "takes a bool, got 1"),
    (lambda: ipu.scopes.frontend_attribute("A", 1), TypeError, "attribute_value must be a string"),
    (lambda: ipu.scopes.ipu_jit_scope(1.5), TypeError, "a string or an int"),
    (lambda: ipu.scopes.outside_compilation_scope(None), TypeError, "a name string"),
    (lambda: ipu.scopes.ipu_shard([0, 1]), TypeError, r"integer index of one IPU.*\[0, 1\]"),
    (lambda: ipu.scopes.ipu_shard(1.5), TypeError, "integer index of one IPU"),
])
def test_option_scopes_check_their_arguments(scope, error, message):
    with pytest.raises(error, match=message), scope():
        pass


def test_multi_conv_computes_the_seeds_convolutions_unchanged():
    rng = np.random.default_rng(1)
    keras.utils.set_random_seed(2)
    depthwise_a = keras.layers.DepthwiseConv2D(2, depth_multiplier=2)
    depthwise_b = keras.layers.DepthwiseConv2D(4, depth_multiplier=2)
    conv = keras.layers.Conv2D(8, 3)

    def convs(x, y, z):
        return depthwise_a(x), depthwise_b(y), conv(z)

    inputs = [rng.random((2, 8, 8, 3)).astype(np.float32) for _ in range(3)]
    expected = convs(*inputs)
    for decorated in (ipu.nn_ops.multi_conv(convs),
                      ipu.nn_ops.multi_conv(options={"perConvReservedTiles": "50"})(convs)):
        assert decorated.__name__ == "convs"
        for ours, theirs in zip(decorated(*inputs), expected):
            np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(TypeError, match="positional arguments only"):
        ipu.nn_ops.multi_conv(convs)(*inputs[:2], z=inputs[2])
    with pytest.raises(TypeError, match="options must be a dictionary"):
        ipu.nn_ops.multi_conv(options=["perConvReservedTiles"])
