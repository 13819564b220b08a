"""Import-time backend selection and the IPU system, in fresh processes where it matters."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from keras_ipu.device import hardware, system

from conftest import fresh_process_env


def _run(code: str, env_overrides: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter without the test suite's JAX set-up."""
    env = {**fresh_process_env(), **(env_overrides or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=env, timeout=300,
    )


def test_import_selects_jax_and_stays_light():
    result = _run(
        """
        import os, sys
        import keras_ipu
        assert os.environ["KERAS_BACKEND"] == "jax"
        assert "keras" not in sys.modules and "jax" not in sys.modules, sorted(sys.modules)
        import keras
        assert keras.config.backend() == "jax"
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_import_after_keras_with_another_backend_raises():
    result = _run("import keras\nimport keras_ipu", {"KERAS_BACKEND": "numpy"})
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "'numpy'" in result.stderr
    assert "Import keras_ipu before keras" in result.stderr


def test_import_with_another_backend_requested_raises():
    result = _run("import keras_ipu", {"KERAS_BACKEND": "torch"})
    assert result.returncode != 0
    assert "KERAS_BACKEND is 'torch'" in result.stderr


def test_fresh_process_configures_1_2_4_8_ipus_without_environment():
    result = _run(
        """
        import keras_ipu as ipu
        for n in (1, 2, 4, 8):
            config = ipu.config.IPUConfig()
            config.auto_select_ipus = n
            config.configure_ipu_system()
            devices = [i.device for i in ipu.device.system.current().ipus]
            assert len(set(devices)) == n, devices
        print("configured")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "configured"


def test_ipus_share_the_devices_jax_already_started_with():
    # A notebook's JAX work before configuring fixes JAX at one CPU device:
    # the IPUs share it instead of failing (tests/test_shared_devices.py trains on them).
    result = _run(
        """
        import keras_ipu
        import jax, jax.numpy as jnp
        jnp.ones(2).block_until_ready()   # JAX starts with its default single CPU device
        from keras_ipu.device import system, hardware
        configured = system.configure((4,), hardware.hardware_for("ipu2"))
        assert {ipu.device for ipu in configured.ipus} == {jax.devices()[0]}
        print(configured.describe())
        """,
        {"JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4 IPUs on 1 JAX device: IPUs 0-3 share cpu:0"


def test_each_ipu_gets_its_own_device():
    configured = system.configure((2, 2), hardware.hardware_for("ipu2"))
    assert configured.num_ipus == 4
    assert configured.device_names == ("/device:IPU:0", "/device:IPU:1")
    assert [i.index for i in configured.ipus_of_device("/device:IPU:1")] == [2, 3]
    assert len({i.device for i in configured.ipus}) == 4
    assert all(i.device in jax.devices() for i in configured.ipus)
    with pytest.raises(ValueError, match="Unknown IPU device"):
        configured.ipus_of_device("/device:IPU:7")
    # A NumPy integer is a device number (as an index anywhere); a bool is none.
    assert configured.ipus_of_device(np.int64(1)) == configured.ipus_of_device(1)
    for wrong in (True, np.bool_(False), 2, -1):
        with pytest.raises(ValueError, match="Unknown IPU device"):
            configured.ipus_of_device(wrong)


def test_selection_orders():
    assert system.selection_permutation("ZIGZAG", 4) == [0, 1, 2, 3]
    assert system.selection_permutation("SNAKE", 16) == [
        0, 1, 3, 2, 4, 5, 7, 6, 8, 9, 11, 10, 12, 13, 15, 14
    ]
    assert system.selection_permutation("HOOF", 16) == [
        0, 2, 4, 6, 8, 10, 12, 14, 15, 13, 11, 9, 7, 5, 3, 1
    ]
    snake = system.configure((4,), hardware.hardware_for("ipu2"), selection_order="SNAKE")
    assert [i.device.id for i in snake.ipus] == [0, 1, 3, 2]
    with pytest.raises(ValueError, match="Unknown selection order"):
        system.configure((1,), hardware.hardware_for("ipu2"), selection_order="SPIRAL")
    with pytest.raises(ValueError, match="positive integers"):
        system.configure((0,), hardware.hardware_for("ipu2"))


def test_the_device_layer_knows_nothing_of_keras():
    result = _run(
        """
        import sys
        from keras_ipu.device import (accounting, hardware, infeed, program, schedules,
                                      replicate, report, system)
        import keras_ipu.config
        assert not any(name == "keras" or name.startswith("keras.") for name in sys.modules)
        print("keras-free")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "keras-free"


def test_select_ipus_picks_configurations_of_the_gc_info_listing():
    # The seed: `select_ipus = [24, 25]` is "two TensorFlow devices, with four IPUs each".
    import keras_ipu as ipu

    config = ipu.config.IPUConfig()
    config.select_ipus = [24, 25]
    config.configure_ipu_system()
    configured = system.require()
    assert configured.device_sizes == (4, 4) and configured.num_ipus == 8
    assert [ipu.index for ipu in configured.ipus_of_device("/device:IPU:1")] == [4, 5, 6, 7]


@pytest.mark.parametrize("imports", [
    "import keras_ipu, keras", "import keras, keras_ipu",
    # A registering module imported first imports Keras itself (it failed: a circular import).
    "import keras_ipu.keras.layers, keras", "import keras_ipu.keras.group_normalization, keras",
    # A probe for Keras does not use the registration up.
    "import keras_ipu, importlib.util; importlib.util.find_spec('keras'); import keras"])
def test_a_model_saved_with_ipu_layers_loads_after_importing_keras_ipu(imports, tmp_path):
    # Before: "Could not locate class 'PopnnGRU'" until the layers' module was imported by hand.
    import keras

    import keras_ipu as ipu

    inputs = keras.Input((4, 3))  # time-major for rnn_ops: [time, batch, features]
    sequences, _ = ipu.rnn_ops.PopnnGRU(5)(inputs)
    outputs = ipu.keras.layers.GroupNormalization(groups=2)(
        ipu.keras.layers.PopnnLSTM(4)(sequences))
    model = keras.Model(inputs, outputs)
    path = str(tmp_path / "model.keras")
    model.save(path)
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(2, 4, 3)
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    result = _run(
        f"""
        {imports}
        import numpy as np
        model = keras.models.load_model({path!r})
        x = np.linspace(-1, 1, 24, dtype="float32").reshape(2, 4, 3)
        np.testing.assert_allclose(model.predict(x, verbose=0),
                                   np.load({str(tmp_path / "expected.npy")!r}), atol=1e-6)
        print([type(layer).__name__ for layer in model.layers])
        """, {"KERAS_BACKEND": "jax"}  # for Keras imported first
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith(
        "['InputLayer', 'PopnnGRU', 'PopnnLSTM', 'GroupNormalization']")
