"""More IPUs than JAX devices: IPUs share devices, replicas batched, each IPU accounted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import shared_devices_job as job
from jax.sharding import PartitionSpec as P

import keras_ipu as ipu
from keras_ipu.device import cost, hardware, system
from keras_ipu.device.mesh import IPUMesh
from keras_ipu.device.replicate import Replicas
from keras_ipu.device.switch import one_branch_each

from conftest import configure, fresh_process_env


def test_more_ipus_than_devices_share_them_in_contiguous_blocks():
    devices = jax.devices()  # the suite's 8 CPU devices
    configured = system.configure((16,), hardware.hardware_for("ipu2"))
    assert [ipu.device for ipu in configured.ipus] == [d for d in devices for _ in range(2)]
    assert configured.shared_devices[devices[1]] == (2, 3)
    assert configured.describe().startswith("16 IPUs on 8 JAX devices: IPUs 0-1 share cpu:0;")
    # 12 IPUs: the most devices that divide them (6), 2 IPUs each.
    configured = system.configure((12,), hardware.hardware_for("ipu2"))
    assert [ipu.device for ipu in configured.ipus] == [d for d in devices[:6] for _ in range(2)]
    # A selection order orders the blocks.
    configured = system.configure((32,), hardware.hardware_for("ipu2"), selection_order="SNAKE")
    order = system.selection_permutation("SNAKE", 8)
    assert [ipu.device for ipu in configured.ipus] == [devices[order[i // 4]] for i in range(32)]
    assert system.configure((4,), hardware.hardware_for("ipu2")).shared_devices == {}


def test_no_logical_device_straddles_two_blocks_of_shared_ipus():
    # 16 IPUs on 8 devices would be blocks of 2, but /device:IPU:0's 3 IPUs and
    # /device:IPU:1's 13 cannot be whole blocks or lie in one: every block grows to 16.
    devices = jax.devices()
    configured = system.configure((3, 13), hardware.hardware_for("ipu2"))
    assert {ipu.device for ipu in configured.ipus} == {devices[0]}
    configured = system.configure((2, 14), hardware.hardware_for("ipu2"))
    assert [ipu.device for ipu in configured.ipus] == [d for d in devices for _ in range(2)]
    configured = system.configure((1, 1, 2, 12), hardware.hardware_for("ipu2"))  # in one, whole
    assert [ipu.device for ipu in configured.ipus] == [d for d in devices for _ in range(2)]


def test_batched_replicas_have_the_collectives_of_separate_devices():
    d = jax.devices()

    def run(devices):
        replicas = Replicas(tuple(system.VirtualIPU(i, dev) for i, dev in enumerate(devices)))
        state = replicas.replicate({"w": np.arange(3.0, dtype=np.float32)})

        def step(state, batches):
            index = replicas.index()
            grads = replicas.sum(batches[0] * (index + 1))
            return {"w": state["w"] + grads.sum() + index}, batches * index

        new, out = jax.jit(replicas.map(step))(state, np.ones((2, 4, 3), np.float32))
        return replicas, np.asarray(new["w"]), np.asarray(out)

    separate = run(d[:4])
    shared = run([d[0], d[0], d[1], d[1]])
    assert shared[0].ipus_per_device == 2 and shared[0].mesh.devices.shape == (2,)
    np.testing.assert_array_equal(separate[1], shared[1])
    np.testing.assert_array_equal(separate[2], shared[2])
    replicas = shared[0]
    slices = replicas.replica_slices(replicas.replicate({"x": np.ones(2, np.float32)}))
    assert [s["x"].devices() for s in slices] == [{d[0]}, {d[0]}, {d[1]}, {d[1]}]


def test_replicated_programs_without_data_run_on_shared_devices():
    # A program no argument of which is split over the replicas (strategy.run of a
    # function of host values, or of none): "vmap must have at least one non-None value".
    configure(16)
    strategy = ipu.ipu_strategy.IPUStrategy()
    index = ipu.replication_ops.replication_index
    assert system.require().shared_devices  # 16 IPUs on the suite's 8 devices
    np.testing.assert_array_equal(
        strategy.run(lambda x: x * 2, args=(np.ones(2, np.float32),)), [2.0, 2.0])
    sums = strategy.run(lambda: ipu.cross_replica_ops.cross_replica_sum(index() + 1))
    assert int(sums) == sum(range(1, 17))
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        compiled = ipu.ipu_compiler.compile(lambda x: x * 2, [np.ones(2, np.float32)])
    np.testing.assert_array_equal(compiled[0], [2.0, 2.0])


def test_ipus_sharing_devices_must_tile_the_grid():
    d = jax.devices()
    IPUMesh(np.array([[d[0], d[0]], [d[1], d[1]]], dtype=object), ("replica", "ipu"))
    with pytest.raises(ValueError, match="contiguous blocks.*'replica': 1, 'ipu': 3"):
        IPUMesh(np.array([[d[0], d[0], d[1]]], dtype=object), ("replica", "ipu"))
    mesh = IPUMesh(np.array([d[0]] * 2 + [d[1]] * 2, dtype=object), ("replica",))
    gathered = jax.jit(mesh.map(lambda x: mesh.all_gather(x, "replica")[None, :, 0, 0],
                                (P("replica"),), P("replica")))(np.arange(4.0)[:, None])
    np.testing.assert_array_equal(np.asarray(gathered), np.tile(np.arange(4.0), (4, 1)))


@pytest.fixture(scope="module")
def two_device_run(tmp_path_factory):
    """The jobs of `shared_devices_job` in a process whose JAX has 2 CPU devices."""
    folder = tmp_path_factory.mktemp("shared")
    weights, reports = folder / "weights.npz", folder / "reports.json"
    script = Path(job.__file__)
    result = subprocess.run([sys.executable, str(script), str(weights), str(reports)],
                            env=fresh_process_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return dict(np.load(weights)), json.loads(reports.read_text())


def _weights(arrays: dict, name: str) -> list[np.ndarray]:
    return [arrays[f"{name}_{i}"] for i in range(len([k for k in arrays
                                                       if k.startswith(f"{name}_")]))]


def test_eight_replicas_on_two_devices_train_as_on_eight(two_device_run, strategy):
    arrays, reports = two_device_run
    on_two = _weights(arrays, "replicated")
    on_eight, report = job.replicated()  # this process: 8 devices
    assert {r.device for r in report.ipus} == {str(d) for d in jax.devices()}
    for a, b in zip(on_two, on_eight):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(on_two, _weights(arrays, "plain_replicated")):
        np.testing.assert_allclose(a, b, atol=1e-5)
    ipus = reports["replicated"]["ipus"]
    assert ipus == [[i, "cpu:0" if i < 4 else "cpu:1"] for i in range(8)]
    text = reports["replicated"]["text"]
    assert "IPUs 0-3 share cpu:0; IPUs 4-7 share cpu:1" in text
    assert "IPUs 0-3 share cpu:0" in reports["replicated"]["html"]
    assert reports["system"] == (
        "8 IPUs on 2 JAX devices: IPUs 0-3 share cpu:0; IPUs 4-7 share cpu:1")
    # Batched replicas sum their gradients with a reduction the count sees
    # (a collective is not counted): 227 parameters, 3% of this tiny step.
    assert reports["replicated"]["flops_per_step"] == pytest.approx(report.flops_per_step,
                                                                   rel=0.05)


def test_four_stages_times_two_replicas_on_two_devices_equal_the_big_batch(two_device_run):
    arrays, reports = two_device_run
    for a, b in zip(_weights(arrays, "pipelined"), _weights(arrays, "plain_pipelined")):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert reports["pipelined"]["ipus"] == [[i, "cpu:0" if i < 4 else "cpu:1"] for i in range(8)]
    assert "IPUs 0-3 share cpu:0; IPUs 4-7 share cpu:1" in reports["pipelined"]["text"]
    # Each IPU is counted as on a device of its own (this process has 8).
    _, on_eight = job.pipelined()
    assert reports["pipelined"]["flops_per_step"] == pytest.approx(on_eight.flops_per_step,
                                                                  rel=0.01)


def _switching_program(devices):
    """A 2 × 2 grid whose IPUs along "ipu" run different branches (a cheap and a dear one)."""
    mesh = IPUMesh(np.array(devices, dtype=object).reshape(2, 2), ("replica", "ipu"))

    def body(w, x):
        weights, replica = w[0, 0], mesh.axis_index("replica")
        branches = [lambda v: jnp.tanh(v @ weights) + replica,  # an outer axis's index
                    lambda v: (v @ weights) @ weights.T @ weights]
        y = mesh.switch("ipu", mesh.axis_index("ipu"), branches, x[0, 0])
        return mesh.psum(y, "ipu")[None, None]

    specs = (P("replica", "ipu"), P("replica", "ipu"))
    return jax.jit(mesh.map(body, specs, P("replica", "ipu")))


def test_ipus_sharing_a_device_run_only_their_own_branch():
    d = jax.devices()
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 2, 32, 32)).astype(np.float32)
    x = rng.normal(size=(2, 2, 8, 32)).astype(np.float32)
    separate = _switching_program(d[:4])
    expected = np.asarray(separate(w, x))
    own = cost.count_lowered(separate.lower(w, x)).flops  # the dear branch, once
    for devices, sharing in (([d[0]] * 4, 4), ([d[0], d[0], d[1], d[1]], 2)):
        shared = _switching_program(devices)
        np.testing.assert_allclose(np.asarray(shared(w, x)), expected, rtol=1e-6)
        # A vmapped lax.switch would run both branches for every IPU.
        flops = cost.count_lowered(shared.lower(w, x)).flops / sharing
        assert flops == pytest.approx(own, rel=0.01)


def test_a_switch_batched_with_one_index_or_none_operands_is_a_switch():
    def per_ipu(i, x, bias):
        return one_branch_each(i, [lambda v, b: (jnp.sin(v), None),
                                   lambda v, b: (v * b, None)], x, bias)

    x, bias = jnp.arange(6.0).reshape(2, 3), jnp.float32(2.0)
    by_element = jax.vmap(per_ipu, in_axes=(0, 0, None))(jnp.array([1, 0]), x, bias)
    np.testing.assert_allclose(by_element[0], np.stack([x[0] * 2.0, np.sin(x[1])]), rtol=1e-6)
    same = jax.vmap(per_ipu, in_axes=(None, 0, None))(1, x, bias)
    np.testing.assert_allclose(same[0], x * 2.0)
    assert by_element[1] is None and same[1] is None


def test_a_switch_along_an_outer_shared_axis_is_lax_switch():
    # The rule batches the innermost vmap ("ipu") only: along "replica" the
    # switch is JAX's own, so its branches may use "ipu"'s collectives.
    d = jax.devices()
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 2, 16, 16)).astype(np.float32)
    x = rng.normal(size=(2, 2, 4, 16)).astype(np.float32)

    def program(devices):
        mesh = IPUMesh(np.array(devices, dtype=object).reshape(2, 2), ("replica", "ipu"))

        def body(w, x):
            weights = w[0, 0]
            branches = [lambda v: mesh.psum(jnp.tanh(v @ weights), "ipu"),
                        lambda v: v @ weights @ weights]
            y = mesh.switch("replica", mesh.axis_index("replica"), branches, x[0, 0])
            return y[None, None]

        return jax.jit(mesh.map(body, (P("replica", "ipu"),) * 2, P("replica", "ipu")))

    np.testing.assert_allclose(np.asarray(program([d[0]] * 4)(w, x)),
                               np.asarray(program(d[:4])(w, x)), rtol=1e-5, atol=1e-6)


def test_a_batched_switch_differentiates_forward():
    def derivative(i, x):
        return jax.jvp(lambda v: one_branch_each(i, [jnp.sin, jnp.cos], v), (x,), (1.0,))[1]

    x = jnp.array([0.5, 0.7])
    np.testing.assert_allclose(jax.vmap(derivative)(jnp.array([0, 1]), x),
                               [np.cos(0.5), -np.sin(0.7)], rtol=1e-6)


def _pipelined_fit(num_ipus_configured, x, y, mixed: bool):
    """2 replicas × 2 stages with dropout: weights and the fit's and predict's reports.

    `mixed`: under `mixed_float16`, with a loss-scale optimizer and a global
    clip norm, whose update switch takes the finite flag and the norm.
    """
    configure(num_ipus_configured)
    keras.utils.set_random_seed(3)
    optimizer = keras.optimizers.SGD(0.05)
    if mixed:
        keras.mixed_precision.set_global_policy("mixed_float16")
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01, global_clipnorm=1.0))
    try:
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = keras.Sequential([
                keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                keras.layers.Dropout(0.3), keras.layers.Dense(3, dtype="float32")])
            model.set_pipeline_stage_assignment([0, 0, 1])
            model.compile(optimizer=optimizer, loss="mse", steps_per_execution=4)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
            model.predict(x, batch_size=4, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    fit, predict = (ipu.utils.execution_report(model, mode) for mode in ("fit", "predict"))
    return model.get_weights(), fit, predict


@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "mixed_float16"])
def test_a_replicated_pipeline_on_one_device_trains_and_counts_as_on_four(mixed):
    x = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    y = x[:, :3] * 2.0
    separate = _pipelined_fit(4, x, y, mixed)
    # 32 IPUs on 8 devices, 4 per device: the model's logical device (the
    # first 4 IPUs: both replicas' both stages) lies on cpu:0.
    shared = _pipelined_fit([4, 28], x, y, mixed)
    assert {r.device for r in shared[1].ipus} == {str(jax.devices()[0])}
    for a, b in zip(separate[0], shared[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Each IPU counted as if it had its device, but for the sums between the
    # IPUs of a device, counted as additions (docs/device_model.md): with a
    # clip norm and loss scaling, 6% of this tiny model's step.
    tolerance = 0.1 if mixed else 0.01
    for mode in (1, 2):
        assert shared[mode].flops_per_step == pytest.approx(separate[mode].flops_per_step,
                                                            rel=tolerance)


def test_a_fresh_process_asks_for_at_most_64_cpu_devices_and_512_ipus_share_them():
    # Before, 512 IPUs got 512 CPU devices, whose collectives timed out in XLA:CPU: a
    # pipelined fit aborted the process after a minute.
    script = """
import keras_ipu as ipu  # first: it selects Keras' JAX backend
import jax, keras, numpy as np
config = ipu.config.IPUConfig(); config.auto_select_ipus = 512; config.configure_ipu_system()
with ipu.ipu_strategy.IPUStrategy().scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
model.compile("sgd", "mse", steps_per_execution=2)
model.set_pipeline_stage_assignment([0, 1])
model.set_pipelining_options(gradient_accumulation_steps_per_replica=2)
model.fit(np.ones((512, 4)), np.ones((512, 1)), batch_size=1, verbose=0)
print(jax.device_count(), len(ipu.utils.execution_report(model, "fit").ipus))
"""
    result = subprocess.run([sys.executable, "-c", script], env=fresh_process_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["64", "512"]
