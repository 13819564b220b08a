"""`ipu.utils`: `reset_ipu_seed`, `running_on_ipu_model`, `use_synthetic_data_for`."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import system as ipu_system
from keras_ipu.utils import SyntheticDataCategory

from conftest import configure


def _trained_with_seed(seed: int) -> list:
    """A model built, shuffled and trained with dropout after `reset_ipu_seed(seed)`."""
    ipu.utils.reset_ipu_seed(seed)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=2)
    x = np.linspace(0, 1, 64, dtype=np.float32).reshape(16, 4)
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0)  # shuffled
    return model.get_weights()


def test_reset_ipu_seed_makes_initialisation_shuffles_and_dropout_repeat():
    first, again, other = _trained_with_seed(3), _trained_with_seed(3), _trained_with_seed(4)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(first[0], other[0])


def test_reset_ipu_seed_checks_the_seed_and_the_device():
    configure(2)  # /device:IPU:0 only, with 2 IPUs
    for seed in (-1, 2**64, 1.0, "1"):
        with pytest.raises(ValueError, match=re.escape(f"[0, 2**64), got {seed!r}")):
            ipu.utils.reset_ipu_seed(seed)
    with pytest.raises(ValueError, match="IPU:1"):
        ipu.utils.reset_ipu_seed(1, device="/device:IPU:1")
    ipu.utils.reset_ipu_seed(1, device="/device:IPU:0", experimental_identical_replicas=True)
    # Before: the string "False" turned identical replicas on.
    with pytest.raises(TypeError, match="`experimental_identical_replicas` must be a bool, "
                                        "got 'False'"):
        ipu.utils.reset_ipu_seed(1, experimental_identical_replicas="False")
    assert ipu_system.require().option("identical_replicas") is True  # left as it was


def test_reset_ipu_seed_takes_numpy_and_64_bit_seeds():
    # The IPU's seeds are 64-bit; Keras' 32-bit: a NumPy integer is a seed like a Python one,
    # and a seed of 2**32 or more still seeds Keras (folded), deterministically.
    ipu.utils.reset_ipu_seed(np.int64(3))
    numpy_seeded = keras.random.uniform((4,))
    ipu.utils.reset_ipu_seed(3)
    np.testing.assert_array_equal(numpy_seeded, keras.random.uniform((4,)))
    draws = []
    for _ in range(2):
        ipu.utils.reset_ipu_seed(2**40 + 5)
        draws.append(keras.random.uniform((4,)))
    np.testing.assert_array_equal(*draws)
    assert not np.array_equal(draws[0], numpy_seeded)


def test_the_ipus_are_always_the_ipu_model():
    assert ipu.utils.running_on_ipu_model() is True


def test_use_synthetic_data_for_follows_the_flag(monkeypatch):
    monkeypatch.delenv("TF_POPLAR_FLAGS", raising=False)
    monkeypatch.delenv("KERAS_IPU_FLAGS", raising=False)
    configure(1)
    assert not any(ipu.utils.use_synthetic_data_for(c) for c in SyntheticDataCategory)
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--use_synthetic_data")
    configure(1)
    assert all(ipu.utils.use_synthetic_data_for(c) for c in SyntheticDataCategory)
    with pytest.raises(TypeError, match="valid: Seed, Infeed, Outfeed"):
        ipu.utils.use_synthetic_data_for("infeed")
