"""The demo: trains a small model on virtual IPUs and prints the execution report.

Run with `keras-ipu demo` or `python -m keras_ipu.demo`.
"""

from __future__ import annotations

import argparse
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
    num_ipus: int = 2,
    epochs: int = 3,
    steps_per_execution: int = 10,
    gradient_accumulation: int = 2,
    batch_size: int = 32,
    print_fn=print,
) -> dict:
    """Configures `num_ipus` IPUs, trains an MLP with `fit`, evaluates, reports.

    The model runs as one replica per IPU, accumulating gradients over
    `gradient_accumulation` micro-batches per weight update.

    Args:
        num_ipus: IPUs to configure (= replicas).
        epochs: Training epochs.
        steps_per_execution: Steps each execution runs on each replica.
        gradient_accumulation: Micro-batches per weight update and replica.
        batch_size: Micro-batch size.
        print_fn: Where the report goes.

    Returns:
        A dict with the history, the evaluation and the execution report.
    """
    import keras

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.configure_ipu_system()

    x, y = synthetic_classification(samples=4480, features=32, classes=10)
    x_train, y_train, x_test, y_test = x[:3840], y[:3840], x[3840:], y[3840:]

    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            # Gradients are summed over replicas, as on IPUs.
            optimizer=keras.optimizers.Adam(4e-3 / num_ipus),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
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
    effective = batch_size * gradient_accumulation * num_ipus
    print_fn(
        f"\nTrained {epochs} epochs in {seconds:.2f} s on {num_ipus} virtual IPU(s): "
        f"{num_ipus} replica(s), {gradient_accumulation} micro-batches per update, "
        f"effective batch size {effective}."
    )
    print_fn(f"Test loss {loss:.4f}, test accuracy {accuracy:.4f}.\n")
    print_fn(str(report))
    return {"history": history.history, "evaluation": [loss, accuracy], "report": report}


def main(argv: list[str] | None = None) -> int:
    """Command line entry point of the demo."""
    parser = argparse.ArgumentParser(prog="keras-ipu demo", description=__doc__)
    parser.add_argument("--ipus", type=int, default=2, help="IPUs to configure (replicas)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=10)
    parser.add_argument("--gradient-accumulation", type=int, default=2)
    args = parser.parse_args(argv)
    run(
        num_ipus=args.ipus,
        epochs=args.epochs,
        steps_per_execution=args.steps_per_execution,
        gradient_accumulation=args.gradient_accumulation,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
