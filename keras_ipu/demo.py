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
    num_ipus: int = 1,
    epochs: int = 3,
    steps_per_execution: int = 25,
    batch_size: int = 32,
    print_fn=print,
) -> dict:
    """Configures `num_ipus` IPUs, trains an MLP with `fit`, evaluates, reports.

    Args:
        num_ipus: IPUs to configure.
        epochs: Training epochs.
        steps_per_execution: Steps each execution runs on the device.
        batch_size: Batch size.
        print_fn: Where the report goes.

    Returns:
        A dict with the history, the evaluation and the execution report.
    """
    import keras

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.configure_ipu_system()

    x, y = synthetic_classification(samples=4000, features=32, classes=10)
    x_train, y_train, x_test, y_test = x[:3200], y[:3200], x[3200:], y[3200:]

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
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
        started = time.perf_counter()
        history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=2)
        seconds = time.perf_counter() - started
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)

    report = ipu.utils.execution_report(model, mode="fit")
    print_fn(f"\nTrained {epochs} epochs in {seconds:.2f} s on {num_ipus} virtual IPU(s).")
    print_fn(f"Test loss {loss:.4f}, test accuracy {accuracy:.4f}.\n")
    print_fn(str(report))
    return {"history": history.history, "evaluation": [loss, accuracy], "report": report}


def main(argv: list[str] | None = None) -> int:
    """Command line entry point of the demo."""
    parser = argparse.ArgumentParser(prog="keras-ipu demo", description=__doc__)
    parser.add_argument("--ipus", type=int, default=1, help="IPUs to configure")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=25)
    args = parser.parse_args(argv)
    run(num_ipus=args.ipus, epochs=args.epochs, steps_per_execution=args.steps_per_execution)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
