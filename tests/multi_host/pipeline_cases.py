"""The pipelined model and feeds of the multi-host pipeline test, the same in the job and the test.

Two stages per replica, one replica per instance: 2 instances × 2 IPUs are
2 global replicas, as a 2-stage pipeline × 2 replicas (4 IPUs) in one process.
"""

from __future__ import annotations

import keras
import numpy as np

import keras_ipu as ipu

BATCH = 4
SAMPLES = 64
FEEDS = ("arrays", "dataset")


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.normal(size=(SAMPLES, 3)).astype("float32")
    return x, y


class Batches(keras.utils.PyDataset):
    """`(x, y)` as a `PyDataset` of `BATCH`-sample batches, in order."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x) // BATCH

    def __getitem__(self, index: int):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def run_case(strategy, x, y, feed: str = "arrays", seed: int = 1) -> dict:
    """Fits a 2-stage pipeline for 2 epochs; returns weights, history, evaluate and predict.

    `seed` sets the initial weights: across instances, instance 0's are the job's.
    """
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3)])
        model.set_pipeline_stage_assignment([0, 0, 1])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                      steps_per_execution=4)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=2)
        if feed == "arrays":
            history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        else:
            history = model.fit(Batches(x, y), epochs=2, shuffle=False, verbose=0)
        result = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
        result.update({f"history_{k}": np.asarray(v) for k, v in history.history.items()})
        result["loop"] = np.asarray(ipu.utils.execution_report(model, "fit").loop_reason)
        if feed == "arrays":
            logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
            result.update({f"eval_{k}": np.asarray(v) for k, v in logs.items()})
            result["predict"] = np.asarray(model.predict(x, batch_size=BATCH, verbose=0))
    return result


def instance_data(instance: int, instances: int = 2):
    """What an instance feeds: the batches its one replica gets when all data is dealt globally."""
    return ipu.distributed.shard_for_instance(data(), BATCH, local_replicas=1,
                                              instance=instance, instances=instances)
