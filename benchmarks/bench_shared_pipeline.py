#!/usr/bin/env python
"""A pipeline whose IPUs share JAX devices: each IPU runs its own stage's ops only.

Run from the repository root:

    python benchmarks/bench_shared_pipeline.py                 # 4, 2 and 1 devices (~1 min)
    python benchmarks/bench_shared_pipeline.py --devices 1 --repeats 7
    python benchmarks/bench_shared_pipeline.py --platform default   # on a GPU machine: the
                                                  # 4 IPUs share its one GPU

Models (`--model`), MSE, SGD, float32, 4 pipeline stages of 2 layers (one IPU
each), gradient accumulation 8, steps_per_execution 8, micro-batch 16, 1,024
samples (8 weight updates) a fit:

    dense     Input(256) -> Dense(256, relu) x 7 -> Dense(16);
    convnet   Input(32, 32, 3) -> Conv2D(16, 3, same, relu) x 6 -> Flatten ->
              Dense(16): large activations between stages (256 KiB per
              micro-batch), so each IPU's inbox and stash are large too.

Each device count runs in a process of its own whose JAX has that many CPU
devices (as a notebook's JAX is fixed once it has started): 4 devices give
each IPU its own; 2 and 1 make the IPUs share them. In each process two
models of the same weights are trained, their warm fits interleaved for
`--repeats` rounds (medians reported):

    own       keras_ipu as it is: the schedule's per-IPU switches run each
              IPU's own branch (`keras_ipu/device/switch.py`);
    vmapped   the ablation: `IPUMesh.switch` replaced by a plain `lax.switch`,
              which a `vmap` over the IPUs of a device turns into a select over
              every branch, run for every IPU.

It prints warm fit milliseconds, the execution report's flops per step and the
final loss of each, and the ratio vmapped / own; the flops per step of `own`
should equal the 4-device figure whatever the device count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES, LAYERS_PER_STAGE, WIDTH, MICRO, GA, SAMPLES = 4, 2, 256, 16, 8, 1024


INPUT_SHAPES = {"dense": (WIDTH,), "convnet": (32, 32, 3)}


def _layers(keras, model: str) -> list:
    """The model's 8 layers (2 per stage)."""
    if model == "dense":
        hidden = [keras.layers.Dense(WIDTH, activation="relu")
                  for _ in range(STAGES * LAYERS_PER_STAGE - 1)]
        return [*hidden, keras.layers.Dense(16)]
    convolutions = [keras.layers.Conv2D(16, 3, padding="same", activation="relu")
                    for _ in range(STAGES * LAYERS_PER_STAGE - 2)]
    return [*convolutions, keras.layers.Flatten(), keras.layers.Dense(16)]


def _train(devices: int, repeats: int, model_name: str) -> dict:
    """In this process (JAX's CPU devices set to `devices`): both variants' figures."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    jax.numpy.ones(1).block_until_ready()  # JAX starts with its devices
    sys.path.insert(0, ROOT)
    import keras
    import numpy as np

    import keras_ipu as ipu
    from keras_ipu.device.mesh import IPUMesh

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = STAGES
    config.configure_ipu_system()
    rng = np.random.default_rng(0)
    shape = INPUT_SHAPES[model_name]
    x = rng.normal(size=(SAMPLES, *shape)).astype("float32")
    y = x.reshape(SAMPLES, -1)[:, :16]
    own_switch = IPUMesh.switch

    def vmapped_switch(self, axis, index, branches, *operands):
        return jax.lax.switch(index, branches, *operands)

    models, switches = {}, {"own": own_switch, "vmapped": vmapped_switch}
    for name, switch in switches.items():
        keras.utils.set_random_seed(1)
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = keras.Sequential([keras.Input(shape), *_layers(keras, model_name)])
            model.set_pipeline_stage_assignment(
                [i // LAYERS_PER_STAGE for i in range(STAGES * LAYERS_PER_STAGE)])
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=GA)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA)
            IPUMesh.switch = switch  # read while the program is traced (its first fit)
            try:
                model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
            finally:
                IPUMesh.switch = own_switch
        models[name] = model
    times = {name: [] for name in models}
    losses = {}
    for _ in range(repeats):
        for name, model in models.items():
            started = time.perf_counter()
            history = model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
            times[name].append(time.perf_counter() - started)
            losses[name] = history.history["loss"][-1]
    return {
        "system": ipu.device.system.current().describe(),
        **{name: {"warm_ms": 1000 * statistics.median(times[name]),
                  "flops_per_step": ipu.utils.execution_report(models[name], "fit").flops_per_step,
                  "loss": losses[name]} for name in models},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--devices", default="4,2,1", help="JAX CPU device counts to run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per process")
    parser.add_argument("--platform", choices=("cpu", "default"), default="cpu",
                        help="cpu: JAX's CPU devices; default: JAX's default platform (a GPU "
                             "machine's GPUs, --devices then counts only CPU devices)")
    parser.add_argument("--model", choices=("dense", "convnet"), default="dense")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_train(args.child, args.repeats, args.model)))
        return
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    if args.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    print(f"{'devices':>7}  {'variant':>8}  {'warm fit':>9}  {'flops/step':>12}  {'loss':>9}")
    for devices in (int(d) for d in args.devices.split(",")):
        result = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", str(devices),
             "--repeats", str(args.repeats), "--model", args.model],
            env=env, capture_output=True, text=True, check=True)
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        for name in ("own", "vmapped"):
            f = figures[name]
            print(f"{devices:>7}  {name:>8}  {f['warm_ms']:>7.1f}ms  {f['flops_per_step']:>12,.0f}"
                  f"  {f['loss']:>9.6f}")
        ratio = figures["vmapped"]["warm_ms"] / figures["own"]["warm_ms"]
        print(f"         {figures['system']}; vmapped / own time: {ratio:.2f}")


if __name__ == "__main__":
    main()
