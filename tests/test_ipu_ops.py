"""IPU TensorFlow's operator modules (`ipu.nn_ops`, `ipu.replication_ops`, ...) on JAX arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.ops import (
    cross_replica_ops,
    embedding_ops,
    math_ops,
    nn_ops,
    rand_ops,
    replication_ops,
)

from conftest import configure


def test_the_modules_are_under_ipu_and_ipu_ops():
    for module in (cross_replica_ops, embedding_ops, math_ops, nn_ops, rand_ops, replication_ops):
        name = module.__name__.rsplit(".", 1)[1]
        assert getattr(ipu, name) is module is getattr(ipu.ops, name)


def test_activations():
    x = np.linspace(-4, 4, 17, dtype=np.float32)
    np.testing.assert_allclose(nn_ops.hard_sigmoid(x), np.clip(0.2 * x + 0.5, 0, 1), atol=1e-7)
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
    with pytest.raises(ValueError, match="must divide the"):
        math_ops.serialized_matmul(a, b, 5, dimension)
    with pytest.raises(ValueError, match="valid: a_columns"):
        math_ops.serialized_matmul(a, b, 2, "rows")


@pytest.mark.parametrize("factor", [1, 2, 5])
def test_embedding_lookup_equals_take(factor):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = np.array([[9, 0, 4], [5, 5, 1]])
    np.testing.assert_array_equal(
        embedding_ops.embedding_lookup(table, ids, serialization_factor=factor), table[ids])
    with pytest.raises(ValueError, match="must divide the 10 rows"):
        embedding_ops.embedding_lookup(table, ids, serialization_factor=3)


def test_dropout_with_a_seed_pair_repeats():
    x = np.ones((32, 32), np.float32)
    first = np.asarray(rand_ops.dropout(x, rate=0.25, seed=[3, 4]))
    np.testing.assert_array_equal(first, rand_ops.dropout(x, rate=0.25, seed=(3, 4)))
    assert set(np.unique(first)) == {0.0, np.float32(1 / 0.75)}
    assert 0.15 < (first == 0).mean() < 0.35


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


def test_cross_replica_sums_in_groups():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("replica",))

    def grouped(x):
        return cross_replica_ops.cross_replica_sum(x, replica_group_size=2)

    out = jax.shard_map(grouped, mesh=mesh, in_specs=P("replica"), out_specs=P("replica"),
                        check_vma=False)(jnp.array([1.0, 2.0, 10.0, 20.0]))
    np.testing.assert_array_equal(out, [3, 3, 30, 30])
    with pytest.raises(ValueError, match="must divide the 4 replicas"):
        jax.shard_map(lambda x: cross_replica_ops.cross_replica_sum(x, 3), mesh=mesh,
                      in_specs=P("replica"), out_specs=P("replica"),
                      check_vma=False)(jnp.ones(4))
