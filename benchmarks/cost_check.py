#!/usr/bin/env python
"""The device model's flops per step against the analytic count, for Dense stacks.

Run from the repository root, on any platform (CPU, GPU):

    python benchmarks/cost_check.py            # 3 x Dense(64) batch 32, 4 x Dense(4096) batch 512
    python benchmarks/cost_check.py --json cpu.json             # on a CPU
    python benchmarks/cost_check.py --compare cpu.json          # on a GPU: same cycles?

On a GPU machine, both in one go (its CPU, then its GPU):

    JAX_PLATFORMS=cpu python benchmarks/cost_check.py --json /tmp/cpu.json &&
        python benchmarks/cost_check.py --compare /tmp/cpu.json

For each model, `fit` and `predict`, it prints the execution report's flops per
step, the analytic count, their ratio and the report's estimated cycles per
step, and exits with status 1 when a ratio is off by more than 5% (`--tolerance`),
or, with `--compare`, when flops or estimated cycles differ by more than that
from another run's `--json` file (another platform's). The same figures are
expected on every platform: the report counts the program before any backend
lowers it (`keras_ipu/device/cost.py`).

The models are `Input(width) -> Dense(width, relu) x (layers - 1) -> Dense(width)`,
MSE loss, SGD, float32, synthetic data, on one IPU; each runs one execution of
`steps_per_execution` (2) steps for fit and for predict (the report exists once
an execution has been compiled), so the script also shows that a run works.

The analytic count (`analytic_flops`), per step of batch B, layer l mapping a_l
to b_l features (a multiply-accumulate is 2 flops):

* matrix work: forward 2·B·a_l·b_l per layer; training adds the weight
  gradient (2·B·a_l·b_l per layer) and the input gradient (2·B·a_l·b_l per
  layer but the first, whose input needs none): about 3 x forward;
* elementwise work, one flop per element: forward bias add (B·b_l) and ReLU
  (B·b_l, hidden layers); training adds the loss (difference, square, sum:
  3·B·b_L), its gradient (2·B·b_L), the ReLU gradient (compare and select:
  2·B·b_l, hidden layers), the bias gradient (a sum over the batch: B·b_l) and
  the SGD update (multiply and subtract: 2 per parameter).

Matrix work dominates 4 x Dense(4096) (elementwise work is under 0.1%); for
3 x Dense(64) at batch 32 elementwise work is about 3% of a training step, so
a count that missed it would still pass, but one that missed a matrix product
or miscounted a loop would not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this checkout's keras_ipu, not an installed one
    sys.path.insert(0, ROOT)

TOLERANCE = 0.05
STEPS = 2
# (name, width, layers, batch)
MODELS = (("3 x Dense(64)", 64, 3, 32), ("4 x Dense(4096)", 4096, 4, 512))


def analytic_flops(width: int, layers: int, batch: int, mode: str) -> float:
    """Flops of one step of a Dense stack (see the module's docstring).

    Args:
        width: Input and layer widths.
        layers: Dense layers; all but the last have a ReLU.
        batch: Samples per step.
        mode: `"fit"` or `"predict"` (also `"evaluate"`: forward and loss).

    Returns:
        The flops of one step.

    Raises:
        ValueError: For an unknown mode.

    Example:

    >>> analytic_flops(64, 3, 32, "predict")
    796672.0
    """
    if mode not in ("fit", "evaluate", "predict"):
        raise ValueError(f"Unknown mode {mode!r}: fit, evaluate or predict.")
    matmul = 2.0 * batch * width * width  # one layer's forward product
    hidden = layers - 1
    activations = batch * width  # one layer's outputs
    forward = layers * matmul + layers * activations + hidden * activations
    if mode == "predict":
        return forward
    loss = 3 * activations
    if mode == "evaluate":
        return forward + loss
    parameters = layers * (width * width + width)
    backward = (
        layers * matmul  # weight gradients
        + hidden * matmul  # input gradients, not for the first layer
        + 2 * activations  # loss gradient
        + 2 * hidden * activations  # ReLU gradients
        + layers * activations  # bias gradients
    )
    return forward + loss + backward + 2 * parameters


def dense_stack(keras, width: int, layers: int):
    """`Input(width) -> Dense(width, relu) x (layers - 1) -> Dense(width)`."""
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
        + [keras.layers.Dense(width)]
    )


def measure(width: int, layers: int, batch: int, steps: int = STEPS,
            stages: int = 1) -> dict[str, dict]:
    """Runs one fit and one predict execution; the report's figures per mode.

    Args:
        width: Input and layer widths.
        layers: Dense layers.
        batch: Samples per step.
        steps: `steps_per_execution` (one execution of each mode runs).
        stages: Pipeline stages (one IPU each, the layers shared out in
            order, `steps` micro-batches accumulated); 1 for no pipeline.
            A pipeline's step is a micro-batch of `batch` samples.

    Returns:
        `{mode: {"flops": report, "analytic": count, "ratio": report / count,
        "cycles_per_step": estimated cycles, "platform": JAX platform,
        "loop": the report's loop form}}`.

    Example:

    >>> measure(64, 3, 32)["fit"]["ratio"]
    """
    import jax
    import keras
    import numpy as np

    import keras_ipu as ipu

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = stages
    config.configure_ipu_system()
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = dense_stack(keras, width, layers)
        if stages > 1:
            model.set_pipeline_stage_assignment([i * stages // layers for i in range(layers)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse",
                      steps_per_execution=steps)
        if stages > 1:
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=steps)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, width)).astype("float32")
    y = rng.normal(size=(steps * batch, width)).astype("float32")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    model.predict(x, batch_size=batch, verbose=0)
    results = {}
    for mode in ("fit", "predict"):
        report = ipu.utils.execution_report(model, mode)
        analytic = analytic_flops(width, layers, batch, mode)
        results[mode] = {
            "flops": report.flops_per_step,
            "analytic": analytic,
            "ratio": report.flops_per_step / analytic,
            "cycles_per_step": report.estimated_cycles / report.steps_per_execution,
            "platform": jax.devices()[0].platform,
            "loop": report.loop,
        }
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="largest accepted |ratio - 1| (default 0.05)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--compare", help="a --json file of another run (another platform) "
                        "whose flops and estimated cycles these must match")
    args = parser.parse_args(argv)
    reference = {}
    if args.compare:
        with open(args.compare) as file:
            reference = {(row["model"], row["mode"]): row for row in json.load(file)}
    os.environ.setdefault("KERAS_BACKEND", "jax")
    started = time.perf_counter()
    rows, failed = [], False
    print(f"{'model':<16} {'mode':<8} {'report flops':>18} {'analytic':>18} {'ratio':>7} "
          f"{'est. cycles/step':>17}")
    for name, width, layers, batch in MODELS:
        for mode, result in measure(width, layers, batch).items():
            ok = abs(result["ratio"] - 1) <= args.tolerance
            note = "" if ok else f"  <-- off by more than {100 * args.tolerance:.0f}%"
            other = reference.get((name, mode))
            if other is not None:
                same = all(abs(result[key] / other[key] - 1) <= args.tolerance
                           for key in ("flops", "cycles_per_step"))
                note += (f"  vs {other['platform']}: flops x{result['flops'] / other['flops']:.4f}"
                         f", cycles x{result['cycles_per_step'] / other['cycles_per_step']:.4f}"
                         + ("" if same else " <-- differ"))
                ok &= same
            failed |= not ok
            rows.append({"model": name, "batch": batch, "mode": mode, **result, "ok": ok})
            print(f"{name:<16} {mode:<8} {result['flops']:>18,.0f} {result['analytic']:>18,.0f} "
                  f"{result['ratio']:>7.4f} {result['cycles_per_step']:>17,.0f}{note}")
    platform = rows[0]["platform"] if rows else "?"
    print(f"platform: {platform}; {time.perf_counter() - started:.1f} s; "
          + ("FAILED" if failed else "all within tolerance"))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
