"""The models and data of the multi-host fit tests, the same in the job and in the test process."""

from __future__ import annotations

import keras
import numpy as np

import keras_ipu as ipu

BATCH = 4
SAMPLES = 64
# (case name, model kind, gradient accumulation steps per replica)
CASES = (("sequential", "sequential", 1), ("sequential_ga4", "sequential", 4),
         ("functional", "functional", 1), ("sequential_steps", "sequential", 1))
# `steps_per_epoch` and `steps` of the "_steps" case: batches of all replicas together.
STEPS = 8
REDUCTIONS = ("NONE", "LIST", "SUM", "MEAN")


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.normal(size=(SAMPLES, 3)).astype("float32")
    return x, y


def build(kind: str) -> keras.Model:
    keras.utils.set_random_seed(1)
    if kind == "sequential":
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3)])
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    # Moving statistics are each replica's own: every instance must hold replica 0's.
    hidden = keras.layers.BatchNormalization()(hidden)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


def run_case(strategy, name: str, kind: str, accumulation: int, x, y) -> dict:
    """Fits for 2 epochs; returns the weights, the history and (case "sequential")
    evaluate's logs; case "sequential_steps" gives `steps_per_epoch` and `steps`."""
    steps = STEPS if name.endswith("_steps") else None
    with strategy.scope():
        model = build(kind)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                      steps_per_execution=4)
        if accumulation > 1:
            model.set_gradient_accumulation_options(
                gradient_accumulation_steps_per_replica=accumulation)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            steps_per_epoch=steps)
        result = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
        result.update({f"history_{k}": np.asarray(v) for k, v in history.history.items()})
        # The metric variables: the last global replica's, in every instance.
        result.update({f"fit_state_{k}": np.asarray(v)
                       for k, v in model.get_metrics_result().items()})
        result["iterations"] = np.asarray(model.optimizer.iterations)
        if steps:
            result["eval_steps"] = np.asarray(model.evaluate(x, y, batch_size=BATCH, steps=steps,
                                                             verbose=0))
            rows = len(model.predict(x, batch_size=BATCH, steps=steps, verbose=0))
            result["predict_rows"] = np.asarray(rows * ipu.distributed.num_instances())
        if name == "sequential":
            for method in REDUCTIONS:
                model.set_replication_options(method)
                logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
                result.update({f"eval_{method}_{k}": np.asarray(v) for k, v in logs.items()})
            result.update({f"eval_state_{k}": np.asarray(v)
                           for k, v in model.get_metrics_result().items()})
            result["predict"] = np.asarray(model.predict(x, batch_size=BATCH, verbose=0))
    return result


def instance_data(instance: int, instances: int = 2, local_replicas: int = 2):
    """What an instance feeds: the batches its replicas get when all data is dealt globally."""
    return ipu.distributed.shard_for_instance(data(), BATCH, local_replicas=local_replicas,
                                              instance=instance, instances=instances)
