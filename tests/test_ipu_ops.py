"""IPU TensorFlow's operator modules (`ipu.nn_ops`, `ipu.replication_ops`, ...) on JAX arrays."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.ops import (
    all_to_all_op,
    cross_replica_ops,
    embedding_ops,
    image_ops,
    math_ops,
    nn_ops,
    rand_ops,
    reduce_scatter_op,
    replication_ops,
)

from conftest import configure


def test_the_modules_are_under_ipu_and_ipu_ops():
    for module in (all_to_all_op, cross_replica_ops, embedding_ops, image_ops, math_ops, nn_ops,
                   rand_ops, reduce_scatter_op, replication_ops):
        name = module.__name__.rsplit(".", 1)[1]
        assert getattr(ipu, name) is module is getattr(ipu.ops, name)


def test_activations():
    x = np.linspace(-4, 4, 17, dtype=np.float32)
    np.testing.assert_allclose(nn_ops.hard_sigmoid(x), np.clip(0.2 * x + 0.5, 0, 1), atol=1e-7)
    with pytest.raises(TypeError, match="floating point input, got int32"):  # before: [0, 0, 1]
        nn_ops.hard_sigmoid(np.array([1, 2, 3], np.int32))
    for activation in (nn_ops.gelu, nn_ops.swish):  # before: JAX's error, or floats for ints
        with pytest.raises(TypeError, match=f"{activation.__name__} takes a floating point "
                                            "input, got int32"):
            activation(np.array([1, 2, 3], np.int32))
    np.testing.assert_allclose(nn_ops.swish(x), x / (1 + np.exp(-x)), rtol=1e-6)
    exact = 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2)))
    np.testing.assert_allclose(nn_ops.gelu(x, approximate=False), exact, atol=1e-6)
    approximate = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(nn_ops.gelu(x), approximate, atol=1e-6)


@pytest.mark.parametrize("dimension", ["a_columns", "a_rows_b_columns", "b_rows"])
@pytest.mark.parametrize("transposed", [False, True])
def test_serialized_matmul_equals_matmul(dimension, transposed):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 6, 8)).astype(np.float32), rng.normal(size=(2, 8, 4)).astype(
        np.float32)
    args = (np.swapaxes(a, -1, -2), np.swapaxes(b, -1, -2)) if transposed else (a, b)
    result = math_ops.serialized_matmul(*args, 2, dimension, transpose_a=transposed,
                                        transpose_b=transposed)
    np.testing.assert_allclose(result, a @ b, rtol=1e-5, atol=1e-5)
    # Differentiable, the backward pass serialized too.
    grad = jax.grad(lambda a: math_ops.serialized_matmul(a, b, 2, dimension).sum())(a)
    np.testing.assert_allclose(grad, np.broadcast_to(b.sum(-1)[:, None, :], a.shape), rtol=1e-5)
    with pytest.raises(ValueError, match=f"dividing the {dimension} dimension"):
        math_ops.serialized_matmul(a, b, 5, dimension)
    with pytest.raises(ValueError, match="valid: a_columns"):
        math_ops.serialized_matmul(a, b, 2, "rows")
    # Before: JAX's error naming a part's shape, which the user never passed.
    for bad in (b[:, :6], np.concatenate([b, b, b])):
        with pytest.raises(ValueError, match=r"a \[\.\.\., m, k\] by b \[\.\.\., k, n\] .* got "
                                             + re.escape(f"a (2, 6, 8) and b {bad.shape}")):
            math_ops.serialized_matmul(a, bad, 2, dimension)
    # Before: IndexError for a vector.
    with pytest.raises(ValueError, match=r"rank 2 or more \(matrices\), got shapes \(8,\)"):
        math_ops.serialized_matmul(a[0, 0], b[0], 2, dimension)


@pytest.mark.parametrize("factor", [1, 2, 5])
def test_embedding_lookup_equals_take(factor):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = np.array([[9, 0, 4], [5, 5, 1]])
    np.testing.assert_array_equal(
        embedding_ops.embedding_lookup(table, ids, serialization_factor=factor), table[ids])
    with pytest.raises(ValueError, match=r"dividing the embedding table's rows \(10\), got 3"):
        embedding_ops.embedding_lookup(table, ids, serialization_factor=3)
    # Before: JAX's "indices must have an integer type".
    with pytest.raises(TypeError, match="ids must be integer indices .* got float32"):
        embedding_ops.embedding_lookup(table, ids.astype("float32"))


@pytest.mark.parametrize("factor", [2.0, True, "2"])
def test_a_serialization_factor_that_is_no_integer_is_refused(factor):
    # Before: a raw "'float' object cannot be interpreted as an integer"; True taken as 1.
    table, ids = np.eye(4, dtype=np.float32), np.array([1, 2])
    with pytest.raises(ValueError, match=f"positive integer dividing .* got {factor!r}"):
        embedding_ops.embedding_lookup(table, ids, serialization_factor=factor)
    with pytest.raises(ValueError, match=f"positive integer dividing .* got {factor!r}"):
        math_ops.serialized_matmul(table, table, factor, "a_columns")
    assert embedding_ops.embedding_lookup(table, ids, serialization_factor=np.int64(2)).shape \
        == (2, 4)


def test_dropout_with_a_seed_pair_repeats():
    x = np.ones((32, 32), np.float32)
    first = np.asarray(rand_ops.dropout(x, rate=0.25, seed=[3, 4]))
    np.testing.assert_array_equal(first, rand_ops.dropout(x, rate=0.25, seed=(3, 4)))
    assert set(np.unique(first)) == {0.0, np.float32(1 / 0.75)}
    assert 0.15 < (first == 0).mean() < 0.35
    # noise_shape as IPU TensorFlow takes it: a shared mask along its axes of 1.
    shared = np.asarray(rand_ops.dropout(x, rate=0.25, noise_shape=(1, 32), seed=[3, 4]))
    assert (shared == shared[0]).all() and (shared[0] == 0).any()
    for bad, message in (((32,), "length of noise_shape must equal the rank"),
                         ((2, 32), "Dimension mismatch: noise_shape \\(2, 32\\) has 2 on axis 0")):
        with pytest.raises(ValueError, match=message):
            rand_ops.dropout(x, rate=0.25, noise_shape=bad, seed=[3, 4])


def test_dropout_without_a_seed_inside_a_compiled_program_says_what_to_pass():
    # Before: Keras' "[JAX RNG] ... seeded random ops", naming neither rand_ops nor seed.
    x = np.ones((8, 8), np.float32)
    assert np.asarray(rand_ops.dropout(x, rate=0.5)).shape == (8, 8)  # eagerly: it draws
    with pytest.raises(ValueError, match="rand_ops.dropout without a seed cannot draw inside "
                                         "a compiled program .* pass seed="):
        jax.jit(lambda a: rand_ops.dropout(a, rate=0.5))(x)


class _ReplicaAware(keras.layers.Layer):
    """Outputs its input, the replica's index, and the sum of the input over replicas."""

    def call(self, x):
        index = keras.ops.cast(replication_ops.replication_index(), x.dtype)
        total = cross_replica_ops.cross_replica_sum(
            cross_replica_ops.assume_equal_across_replicas(x))
        return keras.ops.concatenate([x, keras.ops.ones_like(x) * index, total], axis=-1)


@pytest.mark.parametrize("replicas", [1, 2, 4, 16])  # 16: two IPUs per device
def test_replicas_see_their_index_and_sum_across_replicas(replicas):
    configure(replicas)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((1,)), _ReplicaAware()])
        model.compile(steps_per_execution=2)
    x = np.arange(4 * replicas, dtype=np.float32).reshape(-1, 1)
    out = model.predict(x, batch_size=1, verbose=0)
    # Batch i runs on replica i % replicas, alongside the other replicas' batches of its step.
    replica = np.arange(len(x)) % replicas
    step_sums = x.reshape(-1, replicas).sum(axis=1).repeat(replicas)
    np.testing.assert_array_equal(out[:, 0], x[:, 0])
    np.testing.assert_array_equal(out[:, 1], replica)
    np.testing.assert_array_equal(out[:, 2], step_sums)


def test_outside_a_replicated_program_there_is_one_replica():
    x = jnp.arange(3.0)
    assert int(replication_ops.replication_index()) == 0
    np.testing.assert_array_equal(cross_replica_ops.cross_replica_sum(x), x)


def test_a_collective_on_a_keras_tensor_says_to_wrap_it_in_a_layer():
    # Before: the Keras tensor came back unchanged, so the model never summed.
    inputs = keras.Input((1,))
    for op in (cross_replica_ops.cross_replica_sum,
               lambda x: ipu.ops.all_to_all_op.all_gather(x, 2)):
        with pytest.raises(ValueError, match="Wrap the operation in a layer"):
            op(inputs)
    configure(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        summed = keras.layers.Lambda(lambda x: cross_replica_ops.cross_replica_sum(x))(inputs)
        model = keras.Model(inputs, summed)
    out = model.predict(np.array([[1.0], [2.0]], "float32"), batch_size=1, verbose=0)
    np.testing.assert_array_equal(out, [[3.0], [3.0]])


def _on_4_replicas(fn, x):
    """`fn` on each of 4 replicas' rows of `x` (`[4, ...]`, one row each); rows stacked."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("replica",))
    return np.asarray(jax.shard_map(lambda row: fn(row[0])[None], mesh=mesh,
                                    in_specs=P("replica"), out_specs=P("replica"),
                                    check_vma=False)(jnp.asarray(x)))


def test_cross_replica_sums_in_groups():
    x = np.array([1.0, 2.0, 10.0, 20.0])
    out = _on_4_replicas(lambda v: cross_replica_ops.cross_replica_sum(v, 2), x)
    np.testing.assert_array_equal(out, [3, 3, 30, 30])
    for size in (3, 2.0, -2, 0, True, "2"):  # 2.0: from R / 2; -2 divides 4, but is no size
        with pytest.raises(ValueError, match=rf"group size must be a positive integer that "
                                             rf"divides the 4 replicas .*got {size!r}\. "
                                             rf"Valid sizes: 1, 2, 4\."):
            _on_4_replicas(lambda v, size=size: cross_replica_ops.cross_replica_sum(v, size), x)
    for op in (all_to_all_op.all_gather, reduce_scatter_op.reduce_scatter):
        with pytest.raises(ValueError, match=r"got 2\.0\. Valid sizes"):
            _on_4_replicas(lambda v, op=op: op(v[None], 2.0), x)
    from keras_ipu.device import collectives

    with pytest.raises(ValueError, match=r"positive integer \(or None, for one group of all "
                                         r"replicas\); got 2\.0\.$"):  # no replicas here
        collectives.checked_group_size(2.0)
    for size in (np.int64(2), jnp.array(2)):  # a 0-d JAX integer raised a tracer error
        np.testing.assert_array_equal(
            _on_4_replicas(lambda v, size=size: cross_replica_ops.cross_replica_sum(v, size), x),
            out)


def test_all_gather_and_all_to_all_within_groups():
    x = np.arange(16, dtype=np.float32).reshape(4, 4)  # replica r holds 4r .. 4r + 3
    gathered = _on_4_replicas(lambda v: all_to_all_op.all_gather(v, 2), x)
    np.testing.assert_array_equal(gathered[0], x[:2])
    np.testing.assert_array_equal(gathered[1], x[:2])
    np.testing.assert_array_equal(gathered[3], x[2:])
    # Replica p of the group gets block p (2 elements) of each replica of its group.
    exchanged = _on_4_replicas(lambda v: all_to_all_op.all_to_all(v, 0, 0, 2), x)
    np.testing.assert_array_equal(exchanged, [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13],
                                              [10, 11, 14, 15]])
    with pytest.raises(ValueError, match="must divide dimension 0"):
        _on_4_replicas(lambda v: all_to_all_op.all_to_all(v, 0, 0, 4)[:1], x[:, :3])
    with pytest.raises(ValueError, match="replication_factor must be a positive int"):
        _on_4_replicas(lambda v: all_to_all_op.all_to_all(v, 0, 0, 0), x)  # ZeroDivisionError
    exchanged_np = _on_4_replicas(lambda v: all_to_all_op.all_to_all(v, 0, 0, np.int64(2)), x)
    np.testing.assert_array_equal(exchanged_np, exchanged)  # NumPy ints count as ints


@pytest.mark.parametrize("op, expected", [
    ("COLLECTIVE_OP_ADD", [[11, 22], [33, 0], [11, 22], [33, 0]]),
    ("COLLECTIVE_OP_MAX", [[10, 20], [30, 0], [10, 20], [30, 0]]),
    ("COLLECTIVE_OP_SQUARE_ADD", [[101, 404], [909, 0], [101, 404], [909, 0]]),
    ("COLLECTIVE_OP_LOCAL", [[1, 2], [30, 0], [1, 2], [30, 0]]),
])
def test_reduce_scatter_pads_and_scatters(op, expected):
    # The seed's example over groups of 2: [x, y, z] -> [x0 + x1, y0 + y1] and [z0 + z1, 0].
    x = np.array([[1, 2, 3], [10, 20, 30], [1, 2, 3], [10, 20, 30]], np.float32)
    out = _on_4_replicas(lambda v: reduce_scatter_op.reduce_scatter(v, 2, op), x)
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="valid: COLLECTIVE_OP_ADD"):
        reduce_scatter_op.reduce_scatter(x[0], 1, "SUM")


@pytest.mark.parametrize("dtype, out_dtype", [("uint8", "float16"), ("float32", "float32")])
def test_normalise_image_pads_to_four_channels(dtype, out_dtype):
    image = np.arange(24).reshape(2, 2, 2, 3).astype(dtype)
    out = np.asarray(image_ops.normalise_image(image, [1, 2, 3], [0.5, 2, 1], scale=2))
    assert out.shape == (2, 2, 2, 4) and out.dtype == out_dtype
    expected = (image.astype(np.float32) * 2 - [1, 2, 3]) * [0.5, 2, 1]
    np.testing.assert_allclose(out[..., :3], expected, rtol=1e-3)
    assert not out[..., 3].any()
    with pytest.raises(ValueError, match="3 channels innermost"):
        image_ops.normalise_image(np.ones((2, 4), dtype), [0] * 3, [1] * 3)
    # The seed's [3] arrays: one value was applied to every channel, two raised JAX's error.
    for offsets, scales, bad, shape in (([5.0], [1] * 3, "channel_offsets", "(1,)"),
                                        ([0] * 3, [1, 2], "channel_scales", "(2,)")):
        with pytest.raises(ValueError, match=rf"{bad} must be a \[3\] array .*got shape "
                                             rf"\{shape[:-1]}\)"):
            image_ops.normalise_image(image, offsets, scales)
    with pytest.raises(TypeError, match="scale must be a number, got None"):  # before: JAX's
        image_ops.normalise_image(image, [0] * 3, [1] * 3, scale=None)


def test_dropout_seeds_computed_in_the_program_match_fixed_pairs_and_rates_are_checked():
    x = np.ones((8, 8), np.float32)
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [traced] = ipu.ipu_compiler.compile(
            lambda a, s: rand_ops.dropout(a, 0.5, seed=s + 1), [x, np.array([2, 3], np.int32)])
    np.testing.assert_array_equal(traced, rand_ops.dropout(x, 0.5, seed=[3, 4]))
    for rate in (-0.5, 1.0, 1.5, "0.1"):
        with pytest.raises(ValueError, match=r"a number in \[0, 1\); got"):
            rand_ops.dropout(x, rate, seed=[1, 2])


def test_all_to_all_takes_negative_dimensions_and_refuses_others():
    x = np.arange(8, dtype=np.float32).reshape(4, 1, 2)  # replica r holds [[2r, 2r + 1]]
    positive = _on_4_replicas(lambda v: all_to_all_op.all_to_all(v, 1, 1, 2), x)
    negative = _on_4_replicas(lambda v: all_to_all_op.all_to_all(v, -1, -1, 2), x)
    np.testing.assert_array_equal(positive, [[[0, 2]], [[1, 3]], [[4, 6]], [[5, 7]]])
    np.testing.assert_array_equal(negative, positive)
    for bad in (2, -3, 1.0):
        with pytest.raises(ValueError, match="split_dimension must be a dimension of the "
                                             r"input's shape \(1, 2\), from -2 to 1"):
            all_to_all_op.all_to_all(x[0], bad, 0, 1)


def test_a_group_on_one_replica_is_named_with_the_sizes_it_takes():
    # Before: "must be a positive integer ...; got 2" (2 is one), the replicas unsaid.
    configure(1)
    with pytest.raises(ValueError, match=r"divides the 1 replica \(the program is not "
                                         r"replicated: replicas run `strategy.run` or a step "
                                         r"of a model made in an `IPUStrategy` scope.*got 2\. "
                                         r"Valid sizes: 1\."):
        ipu.ipu_strategy.IPUStrategy().run(
            lambda x: cross_replica_ops.cross_replica_sum(x, 2), [np.ones(3, np.float32)])


class _Exchange(keras.layers.Layer):
    def __init__(self, concat_dimension=0):
        super().__init__()
        self.concat_dimension = concat_dimension

    def call(self, x):
        return all_to_all_op.all_to_all(x, 0, self.concat_dimension, 2)


def test_all_to_all_over_the_batch_builds_without_a_batch_size():
    # Before: the build split a dimension of unknown size ("array split does not result in
    # an equal division"); with a batch size it built and ran.
    configure(2)
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    predicted = []
    for batch_size in (None, 4):
        with ipu.ipu_strategy.IPUStrategy().scope():
            inputs = keras.Input((3,), batch_size=batch_size)
            model = keras.Model(inputs, _Exchange()(inputs))
        predicted.append(model.predict(x, batch_size=4, verbose=0))
    np.testing.assert_array_equal(predicted[0], predicted[1])
    # Replica 0's batch is rows 0, 2, 4, 6 and replica 1's rows 1, 3, 5, 7 (dealt in turn):
    # each keeps its first two rows and takes the other's.
    assert not np.array_equal(predicted[0], x)
    with pytest.raises(ValueError, match=r"all_to_all cannot split dimension 0 of .* whose "
                                         r"size is unknown"):
        with ipu.ipu_strategy.IPUStrategy().scope():
            _Exchange(concat_dimension=1)(keras.Input((4,)))


class _Gathering(keras.layers.Layer):
    """Each replica's rows with its group's: all_gather, all_to_all, reduce_scatter, sums."""

    def call(self, x):
        gathered = keras.ops.reshape(all_to_all_op.all_gather(x, 2), (-1, 4))  # [2b, 2] -> ..
        exchanged = all_to_all_op.all_to_all(x, 1, 1, 2)
        scattered = reduce_scatter_op.reduce_scatter(keras.ops.reshape(x, (-1,)), 2)
        summed = cross_replica_ops.cross_replica_sum(x, 2)
        return (gathered, exchanged, keras.ops.reshape(scattered, (1, -1)), summed)


def test_a_layer_using_group_collectives_builds_and_runs_replicated():
    # Keras infers the layer's outputs outside the replicated step: the groups must not fail.
    configure(4)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((2,), batch_size=1)
        model = keras.Model(inputs, _Gathering()(inputs))
        model.compile()
    assert [tuple(o.shape) for o in model.outputs] == [(1, 4), (1, 2), (1, 1), (1, 2)]
    x = np.arange(8, dtype=np.float32).reshape(4, 2)  # replica r's batch: [[2r, 2r + 1]]
    gathered, exchanged, scattered, summed = model.predict(x, batch_size=1, verbose=0)
    np.testing.assert_array_equal(gathered, [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7],
                                             [4, 5, 6, 7]])
    np.testing.assert_array_equal(exchanged, [[0, 2], [1, 3], [4, 6], [5, 7]])
    np.testing.assert_array_equal(scattered[:, 0], [0 + 2, 1 + 3, 4 + 6, 5 + 7])
    np.testing.assert_array_equal(summed, [[2, 4], [2, 4], [10, 12], [10, 12]])
