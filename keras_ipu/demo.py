"""The demo: trains a small model on virtual IPUs and prints the execution report.

Run with `keras-ipu demo` or `python -m keras_ipu.demo`.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import keras_ipu as ipu


def synthetic_classification(samples: int, features: int, classes: int, seed: int = 0):
    """A learnable synthetic classification problem (no downloads needed)."""
    rng = np.random.default_rng(seed)
    projection = rng.normal(size=(features, classes))
    x = rng.normal(size=(samples, features)).astype("float32")
    y = np.argmax(x @ projection, axis=1).astype("int32")
    return x, y


def run(
    num_ipus: int = 4,
    epochs: int = 3,
    steps_per_execution: int = 10,
    gradient_accumulation: int = 5,
    batch_size: int = 32,
    pipelined: bool = True,
    print_fn=print,
) -> dict:
    """Configures `num_ipus` IPUs, trains an MLP with `fit`, evaluates, reports.

    With `pipelined`, the model runs as a 2-stage pipeline (stage i on IPU i)
    and is replicated over the other IPU pairs; without it, one replica per
    IPU. Gradients accumulate over `gradient_accumulation` micro-batches per
    weight update.

    Args:
        num_ipus: IPUs to configure.
        epochs: Training epochs.
        steps_per_execution: Steps each execution runs on each replica.
        gradient_accumulation: Micro-batches per weight update and replica.
        batch_size: Micro-batch size.
        pipelined: Run the model as a 2-stage pipeline.
        print_fn: Where the report goes.

    Returns:
        A dict with the history, the evaluation and the execution report.
    """
    import keras

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.configure_ipu_system()

    replicas = num_ipus // 2 if pipelined else num_ipus
    # About 3,840 training and 640 test samples, in whole executions of every replica.
    per_execution = batch_size * replicas * steps_per_execution
    train, test = (max(1, round(n / per_execution)) * per_execution for n in (3840, 640))
    x, y = synthetic_classification(samples=train + test, features=32, classes=10)
    x_train, y_train, x_test, y_test = x[:train], y[:train], x[train:], y[train:]

    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            # Gradients are summed over replicas, as on IPUs.
            optimizer=keras.optimizers.Adam(1e-2 / replicas),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
        if pipelined:
            model.set_pipeline_stage_assignment([0, 0, 1, 1])
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=gradient_accumulation,
                gradient_accumulation_reduction_method="mean",
                pipeline_schedule=ipu.pipelining_ops.PipelineSchedule.Grouped,
            )
        else:
            model.set_gradient_accumulation_options(
                gradient_accumulation_steps_per_replica=gradient_accumulation,
                gradient_accumulation_reduction_method="mean",
            )
        model.set_replication_options("mean")
        started = time.perf_counter()
        history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=2)
        seconds = time.perf_counter() - started
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)

    report = ipu.utils.execution_report(model, mode="fit")
    effective = batch_size * gradient_accumulation * replicas
    shape = "2-stage pipeline" if pipelined else "1 IPU per replica"
    print_fn(
        f"\nTrained {epochs} epochs in {seconds:.2f} s on {num_ipus} virtual IPU(s): "
        f"{shape}, {replicas} replica(s), {gradient_accumulation} micro-batches per "
        f"update, effective batch size {effective}."
    )
    print_fn(f"Test loss {loss:.4f}, test accuracy {accuracy:.4f}.\n")
    print_fn(str(report))
    return {"history": history.history, "evaluation": [loss, accuracy], "report": report}


def main(argv: list[str] | None = None) -> int:
    """Command line entry point of the demo."""
    parser = argparse.ArgumentParser(prog="keras-ipu demo", description=__doc__)
    parser.add_argument("--ipus", type=int, default=4, help="IPUs to configure")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=10)
    parser.add_argument("--gradient-accumulation", type=int, default=5)
    parser.add_argument("--no-pipeline", action="store_true", help="replicas only")
    args = parser.parse_args(argv)
    least = {"--ipus": 1 if args.no_pipeline else 2, "--epochs": 1, "--steps-per-execution": 1,
             "--gradient-accumulation": 1}
    for flag, minimum in least.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < minimum:
            pipelined = flag == "--ipus" and not args.no_pipeline
            why = " (a 2-stage pipeline; --no-pipeline for 1)" if pipelined else ""
            parser.error(f"{flag} must be at least {minimum}{why}, got {value}")
    try:
        run(
            num_ipus=args.ipus,
            epochs=args.epochs,
            steps_per_execution=args.steps_per_execution,
            gradient_accumulation=args.gradient_accumulation,
            pipelined=not args.no_pipeline,
        )
    except (ValueError, RuntimeError) as error:  # keras_ipu's checks: the numbers do not fit
        print(f"keras-ipu demo: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
