"""Shared fixtures: a configured IPU system, models built the same way twice."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import keras_ipu as ipu

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The suite's own JAX set-up, which a user's fresh process does not have.
_SUITE_ONLY_ENV = ("KERAS_BACKEND", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")


def fresh_process_env() -> dict:
    """The environment of a user's fresh process: no suite settings, keras_ipu importable."""
    env = {k: v for k, v in os.environ.items() if k not in _SUITE_ONLY_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def use_fresh_process_env(monkeypatch) -> None:
    """Makes processes started from this one (e.g. Jupyter kernels) start as a user's would."""
    for name in _SUITE_ONLY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", fresh_process_env()["PYTHONPATH"])


def configure(num_ipus: int = 1, *, allow_recompute: bool = False, **ipu_model) -> None:
    """Configures `num_ipus` IPUs, with `ipu_model` attributes (e.g. tiles_per_ipu)."""
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.allow_recompute = allow_recompute
    for name, value in ipu_model.items():
        setattr(config.ipu_model, name, value)
    config.configure_ipu_system()


@pytest.fixture(autouse=True)
def ipu_system():
    """Every test starts with one configured IPU and leaves one behind."""
    configure(1)
    yield
    configure(1)


@pytest.fixture(scope="session")
def fork_server():
    """Runs scripts in fresh processes forked from one that has done their imports."""
    from fork_server import ForkServer

    server = ForkServer(fresh_process_env())
    yield server
    server.close()


@pytest.fixture
def strategy():
    return ipu.ipu_strategy.IPUStrategy()


def assert_weights_close(expected, actual, atol=1e-6, rtol=0.0):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, atol=atol, rtol=rtol)


def assert_history_close(expected, actual, atol=1e-6):
    assert expected.keys() == actual.keys()
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], atol=atol, err_msg=key)


def assert_trees_close(expected, actual, atol=1e-6):
    """Same structure (dicts, lists) and values within `atol`."""
    import keras

    keras.tree.assert_same_structure(expected, actual)
    for e, a in zip(keras.tree.flatten(expected), keras.tree.flatten(actual)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=atol)
