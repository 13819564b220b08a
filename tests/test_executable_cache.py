"""`--executable_cache_path=DIR`: a later process loads every compiled program instead of compiling.

The suite itself runs with JAX's compilation cache in `.jax_cache` (the top
`conftest.py`), so the cross-process tests start users' fresh processes,
which have no cache of their own.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import warnings

import jax
import pytest

import keras_ipu as ipu
from keras_ipu.device import executable_cache, system

from conftest import configure, fresh_process_env

# A user's program: builds and fits a model, then a pipelined one on 2 IPUs,
# counting the compilations that asked JAX's persistent cache and those it
# answered. Before the IPU system is configured it compiles a program of its
# own: the flag must also work once JAX has started and compiled.
_USER_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from jax import monitoring

    jax.config.update("jax_num_cpu_devices", 8)  # JAX starts here, before keras_ipu.
    jax.jit(lambda v: v * 2)(jnp.ones(3)).block_until_ready()
    counts = {"requests": 0, "hits": 0}
    def count(event, **kwargs):
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            counts["requests"] += 1
        elif event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1
    monitoring.register_event_listener(count)

    import keras_ipu as ipu  # Before Keras: it selects Keras' JAX backend.
    import keras, numpy as np

    def configured(num_ipus):
        config = ipu.config.IPUConfig()
        config.auto_select_ipus = num_ipus
        config.device_connection.type = ipu.config.DeviceConnectionType[sys.argv[1]]
        if sys.argv[1] == "PRE_COMPILE":
            config.device_connection.version = "ipu2"
        config.configure_ipu_system()

    configured(1)
    x = np.linspace(0, 1, 64 * 6, dtype="float32").reshape(64, 6)
    y = x[:, :2] * 2
    keras.utils.set_random_seed(0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile("adam", "mse", metrics=["mae"], steps_per_execution=4)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y))
    model.predict(x, batch_size=4, verbose=0)
    plain = dict(counts)

    configured(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        piped = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2)])
        piped.compile("sgd", "mse", steps_per_execution=8)
    piped.set_pipeline_stage_assignment([0, 1])
    piped.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    piped.fit(x, y, batch_size=4, verbose=0)
    print(json.dumps({"plain": plain, "all": counts,
                      "directory": jax.config.jax_compilation_cache_dir}))
""")


def _run_user_script(cache: str | None, connection: str = "ALWAYS") -> dict:
    env = fresh_process_env()
    env.pop("TF_POPLAR_FLAGS", None)
    if cache is None:
        env.pop("KERAS_IPU_FLAGS", None)
    else:
        env["KERAS_IPU_FLAGS"] = shlex.quote(f"--executable_cache_path={cache}")
    result = subprocess.run([sys.executable, "-c", _USER_SCRIPT, connection], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_program_from_the_cache(tmp_path):
    cache = tmp_path / "ipu cache"  # A space, as a quoted flag value would have.
    first = _run_user_script(str(cache))
    assert first["directory"] == str(cache)
    # The first process compiled everything and saved it.
    assert first["all"]["requests"] > 0
    assert first["all"]["hits"] == 0
    saved = os.listdir(cache)
    assert len(saved) >= first["all"]["requests"] - 1  # The same program may come twice.

    second = _run_user_script(str(cache))
    # The same programs, and not one compiled: every keras_ipu program of
    # a fit (plain, with validation and predict, and pipelined) is
    # cacheable across processes.
    assert second["all"]["requests"] == first["all"]["requests"]
    assert second["all"]["hits"] == second["all"]["requests"]
    assert second["plain"]["hits"] == second["plain"]["requests"] > 0
    assert sorted(os.listdir(cache)) == sorted(saved)


def test_a_process_that_pre_compiles_fills_the_cache_for_one_that_runs(tmp_path):
    # The IPU's way to compile on a machine without IPUs: PRE_COMPILE runs
    # nothing (zeros come back) but compiles and saves every program.
    cache = str(tmp_path / "cache")
    first = _run_user_script(cache, "PRE_COMPILE")
    assert first["all"]["requests"] > 0
    second = _run_user_script(cache, "ALWAYS")
    # The running process compiles nothing: it asks for the same programs, all saved.
    assert second["all"]["requests"] == first["all"]["requests"]
    assert second["all"]["hits"] == second["all"]["requests"]


def test_without_the_flag_nothing_is_cached(tmp_path):
    result = _run_user_script(None)
    assert result["directory"] is None
    assert result["all"]["hits"] == 0


@pytest.fixture
def no_flags(monkeypatch):
    monkeypatch.delenv("TF_POPLAR_FLAGS", raising=False)
    monkeypatch.delenv("KERAS_IPU_FLAGS", raising=False)
    return monkeypatch


def _jax_settings() -> dict:
    return {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_enable_compilation_cache",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes")}


def test_the_flag_turns_the_cache_on_and_reset_puts_jax_settings_back(no_flags, tmp_path):
    before = _jax_settings()
    cache = tmp_path / "a" / "b"
    no_flags.setenv("KERAS_IPU_FLAGS", f"--executable_cache_path={cache}")
    with pytest.warns(UserWarning, match="replaces JAX's compilation cache directory"):
        configure(1)  # The suite's own cache directory is replaced, saying so.
    assert cache.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(cache)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert system.require().option("executable_cache_path") == str(cache)
    assert executable_cache.directory() == str(cache)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Configuring again: no second warning.
        configure(2)
    assert jax.config.jax_compilation_cache_dir == str(cache)

    ipu.config.reset_ipu_configuration()
    assert _jax_settings() == before
    assert executable_cache.directory() is None


def test_configuring_without_the_flag_turns_the_cache_off(no_flags, tmp_path):
    before = _jax_settings()
    no_flags.setenv("TF_POPLAR_FLAGS", f"--executable_cache_path={tmp_path}")
    with pytest.warns(UserWarning):
        configure(1)
    no_flags.setenv("TF_POPLAR_FLAGS", f"--executable_cache_path={tmp_path / 'other'}")
    configure(1)  # Another directory: the cache moves.
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "other")
    no_flags.delenv("TF_POPLAR_FLAGS")
    configure(1)
    assert _jax_settings() == before
    assert system.require().option("executable_cache_path") is None


def test_a_relative_directory_is_taken_from_the_current_directory(no_flags, tmp_path):
    no_flags.chdir(tmp_path)
    no_flags.setenv("KERAS_IPU_FLAGS", "--executable_cache_path=cache")
    with pytest.warns(UserWarning):
        configure(1)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")


def test_a_directory_that_cannot_be_made_raises_and_keeps_the_system(no_flags, tmp_path):
    (tmp_path / "file").write_text("in the way")
    configured = system.require()
    no_flags.setenv("KERAS_IPU_FLAGS", f"--executable_cache_path={tmp_path / 'file' / 'cache'}")
    with pytest.raises(ValueError, match="--executable_cache_path=.*cannot be created"):
        configure(1)
    assert system.require() is configured
    assert executable_cache.directory() is None


def test_a_directory_that_cannot_be_written_is_read_and_says_so(no_flags, tmp_path,
                                                               monkeypatch):
    # JAX warned at every program it could not write; a cache shipped read-only must
    # still serve its programs, so it is used, with one warning.
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "cache"))

    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(executable_cache.tempfile, "mkstemp", read_only)
    no_flags.setenv("KERAS_IPU_FLAGS", f"--executable_cache_path={tmp_path / 'cache'}")
    with pytest.warns(UserWarning, match=r"--executable_cache_path=.*cannot be written "
                                         r"\(\[Errno 13\] Permission denied.*programs already "
                                         r"in it are read, new ones are not kept"):
        configure(1)
    assert executable_cache.directory() == str(tmp_path / "cache")


def test_without_a_jax_cache_of_its_own_there_is_no_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(executable_cache, "_saved", None)
    own = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert executable_cache.use(tmp_path) == str(tmp_path)
        assert executable_cache.use(None) is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", own)
