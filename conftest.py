"""Test set-up: CPU only, 8 virtual JAX devices, a persistent compile cache.

This runs before any test module imports JAX or Keras: the device count can
only be chosen before JAX starts its backends.
"""

import os
import pathlib
import tempfile

ROOT = pathlib.Path(__file__).parent
NUM_DEVICES = 8

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_HOME", tempfile.mkdtemp(prefix="keras_home_"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
    ).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
