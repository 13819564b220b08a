"""Training jobs of tests/test_shared_devices.py.

Run as a script, it is a user's process whose JAX already started with 2 CPU
devices (as a notebook's does after any JAX work) and which then configures 8
IPUs: it trains 8 replicas, and a 4-stage pipeline × 2 replicas, and writes
the weights, plain Keras's big-batch weights and the execution reports to
`argv[1]` (a .npz) and `argv[2]` (JSON). The test process imports the same
jobs to train the same replicas on 8 devices.
"""

from __future__ import annotations

import json
import sys

import numpy as np

SAMPLES, MICRO, LR = 128, 4, 0.05
REPLICAS = 8
PIPELINE_REPLICAS, PIPELINE_GA = 2, 4  # plain Keras: batch 4 × 4 × 2 = 32


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    return x, (x @ rng.normal(size=(6, 3))).astype("float32")


def mlp():
    import models  # imports Keras: only once JAX is set up

    return models.four_layer_mlp()


def initial_weights(model) -> list[np.ndarray]:
    """The same weights in every process (Keras's initializers are seeded per process)."""
    rng = np.random.default_rng(1)
    return [(0.3 * rng.normal(size=w.shape)).astype("float32") for w in model.get_weights()]


def configure(num_ipus: int):
    import keras_ipu as ipu

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.configure_ipu_system()
    return ipu.device.system.current()


def plain(batch_size: int) -> list[np.ndarray]:
    """Plain Keras trained with the big batch."""
    import keras

    model = mlp()
    model.set_weights(initial_weights(model))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.fit(*data(), batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def replicated():
    """8 replicas (one IPU each) of batch 4: `(weights, report)`."""
    import keras

    import keras_ipu as ipu

    configure(REPLICAS)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = mlp()
        model.set_weights(initial_weights(model))
        model.compile(optimizer=keras.optimizers.SGD(LR / REPLICAS), loss="mse",
                      steps_per_execution=2)
        model.fit(*data(), batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), ipu.utils.execution_report(model, "fit")


def pipelined():
    """A 4-stage pipeline × 2 replicas (8 IPUs): `(weights, report)`."""
    import keras

    import keras_ipu as ipu

    configure(4 * PIPELINE_REPLICAS)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = mlp()
        model.set_weights(initial_weights(model))
        model.set_pipeline_stage_assignment([0, 1, 2, 3])
        model.compile(optimizer=keras.optimizers.SGD(LR / PIPELINE_REPLICAS), loss="mse",
                      steps_per_execution=PIPELINE_GA)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=PIPELINE_GA,
                                     gradient_accumulation_reduction_method="mean")
        model.fit(*data(), batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), ipu.utils.execution_report(model, "fit")


def _report(report) -> dict:
    return {"ipus": [[r.index, r.device] for r in report.ipus], "text": str(report),
            "html": report._repr_html_(), "loop": report.loop,
            "loop_reason": report.loop_reason, "flops_per_step": report.flops_per_step}


def main(weights_path: str, reports_path: str) -> None:
    import jax

    import keras_ipu  # noqa: F401  (before Keras: it picks the JAX backend)

    # What a notebook has after any JAX work before configuring: JAX fixed
    # at the devices it started with (here 2 CPU devices).
    jax.config.update("jax_num_cpu_devices", 2)
    jax.numpy.ones(2).block_until_ready()
    assert len(jax.devices()) == 2

    arrays, reports = {}, {}
    for name, job in (("replicated", replicated), ("pipelined", pipelined)):
        weights, report = job()
        arrays.update({f"{name}_{i}": w for i, w in enumerate(weights)})
        reports[name] = _report(report)
    for name, batch in (("plain_replicated", MICRO * REPLICAS),
                        ("plain_pipelined", MICRO * PIPELINE_GA * PIPELINE_REPLICAS)):
        arrays.update({f"{name}_{i}": w for i, w in enumerate(plain(batch))})
    reports["system"] = configure(8).describe()
    np.savez(weights_path, **arrays)
    with open(reports_path, "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
