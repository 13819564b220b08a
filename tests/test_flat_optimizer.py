"""An elementwise optimizer updating an IPU's weights as one vector: equal to per variable."""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_ipu.keras.pipelined import flat_optimizer
from keras_ipu.keras.pipelined.flat_optimizer import FlatOptimizer
from keras_ipu.keras.pipelined.model import FlatLayout, padded_lengths

SHAPES = [(3, 4), (4,), (2, 2, 3), (1,)]

OPTIMIZERS = [
    lambda: keras.optimizers.SGD(0.1),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True, clipvalue=0.5),
    lambda: keras.optimizers.Adam(0.01),
    lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    lambda: keras.optimizers.Adamax(0.01),
    lambda: keras.optimizers.Adagrad(0.05),
    lambda: keras.optimizers.Adadelta(1.0),
    lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    lambda: keras.optimizers.Lion(0.001),
    lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)),
]


def _variables(shapes=SHAPES, dtype="float32"):
    return [keras.Variable(np.zeros(s, dtype), name=n, dtype=dtype)
            for s, n in zip(shapes, ["kernel", "bias", "kernel", "bias"])]


def _built(make, variables):
    optimizer = make()
    optimizer.build(variables)
    return optimizer


@pytest.mark.parametrize("make", OPTIMIZERS, ids=lambda m: m().__class__.__name__)
def test_the_flat_update_equals_the_per_variable_update(make):
    rng = np.random.default_rng(0)
    variables = _variables()
    clone = _built(make, variables)
    flat = FlatOptimizer.of(clone, variables)
    assert flat is not None
    order = flat.storage_order
    # Slots positive (accumulators of squares must be), scalars as built.
    state = [np.asarray(v.value) if v.ndim == 0 or "iteration" in v.name
             else rng.uniform(0.1, 1.0, v.shape).astype(v.dtype) for v in clone.variables]
    weights = [rng.normal(size=s).astype("float32") for s in SHAPES]
    layout = FlatLayout.of(flat_optimizer.in_storage_order(state, order))
    w_layout = FlatLayout.of(weights)
    lengths = {d: n + 3 for d, n in padded_lengths([layout]).items()}  # padded, as IPUs are
    packed_state = layout.pack(flat_optimizer.in_storage_order(state, order), lengths)
    packed_weights = w_layout.pack(weights, {"float32": w_layout.sizes["float32"] + 5})
    per_variable_state, per_variable_weights = [jnp.asarray(s) for s in state], weights
    for step in range(3):
        grads = [rng.normal(size=s).astype("float32") for s in SHAPES]
        flat_grads = jnp.concatenate([jnp.ravel(g) for g in grads] + [jnp.zeros(5)])
        packed_weights, packed_state = flat.apply(layout, packed_weights, packed_state,
                                                  flat_grads)
        per_variable_weights, per_variable_state = clone.stateless_apply(
            per_variable_state, grads, per_variable_weights)
        for got, want in zip(w_layout.unpack(packed_weights), per_variable_weights):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"step {step}")
        unpacked = flat_optimizer.in_clone_order(layout.unpack(packed_state), order)
        for got, want in zip(unpacked, per_variable_state):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"step {step}")
    # The padding after the weights and after the optimizer's values is untouched.
    assert np.all(np.asarray(packed_weights["float32"][-5:]) == 0)
    assert np.all(np.asarray(packed_state["float32"][-3:]) == 0)


def test_slots_are_stored_slot_by_slot_in_the_weights_order():
    variables = _variables()
    clone = _built(lambda: keras.optimizers.Adam(), variables)
    flat = FlatOptimizer.of(clone, variables)
    names = [clone.variables[p].name for p in flat.storage_order]
    assert names == ["iteration", "learning_rate",
                     "kernel_momentum", "bias_momentum", "kernel_momentum", "bias_momentum",
                     "kernel_velocity", "bias_velocity", "kernel_velocity", "bias_velocity"]
    # The flat clone holds no values of its own: nothing the size of the weights is allocated.
    assert all(v._value is None for v in flat.optimizer.variables if v.ndim)


@pytest.mark.parametrize("make, why", [
    (lambda: keras.optimizers.SGD(0.1, clipnorm=1.0), "a norm per variable"),
    (lambda: keras.optimizers.Adam(global_clipnorm=1.0), "a norm over all variables"),
    (lambda: keras.optimizers.Adam(use_ema=True), "an average per variable"),
    (lambda: keras.optimizers.Adafactor(), "factored second moments"),
    (lambda: keras.optimizers.Lamb(), "a trust ratio per variable"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "a wrapper"),
    (lambda: keras.optimizers.Nadam(), "a variable built with a value"),
])
def test_updates_that_read_more_than_one_value_keep_the_per_variable_form(make, why):
    variables = _variables()
    assert FlatOptimizer.of(_built(make, variables), variables) is None, why


def test_weight_decay_skipping_some_weights_keeps_the_per_variable_form():
    variables = _variables()
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.build(variables)
    assert FlatOptimizer.of(optimizer, variables) is None


def test_weights_of_two_dtypes_keep_the_per_variable_form():
    variables = _variables()[:2] + _variables(SHAPES[2:], "float16")
    assert FlatOptimizer.of(_built(lambda: keras.optimizers.Adam(), variables), variables) is None


def test_in_clone_order_inverts_in_storage_order():
    order = (0, 3, 1, 2)
    values = ["a", "b", "c", "d"]
    stored = flat_optimizer.in_storage_order(values, order)
    assert stored == ["a", "d", "b", "c"]
    assert flat_optimizer.in_clone_order(stored, order) == values
