"""Fits the cases of `fit_cases.py` on 2 instances × 2 IPUs; each instance saves its results.

`fit_job.py OUT uneven`: instance 0 feeds 64 samples and instance 1 feeds 32 (not
dealt with `shard_for_instance`); each of `fit`, `evaluate` and `predict` must
raise, and so must a `fit` of 32 samples each whose `epochs` differ; each instance
prints what it got, and then the job fails with the last error.
`fit_job.py OUT programs`: the instances' models, options or batches differ; each
`fit` must raise the same error in both (it aborted in the collective library).
"""

import sys

import keras
import numpy as np
from fit_cases import BATCH, CASES, build, data, instance_data, run_case
from job import say, start

import keras_ipu as ipu

out = sys.argv[1]
if sys.argv[2:] == ["ipus"]:  # instance 1 configures 1 IPU, instance 0 two
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1 if ipu.distributed.instance_index() == 1 else 2
    config.configure_ipu_system()
    with ipu.distributed.IPUMultiReplicaStrategy().scope():
        model = build("sequential")
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = instance_data(ipu.distributed.instance_index())
    try:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    except ValueError as error:
        say("fit raised:", error)
    sys.exit()
strategy, index = start()
if sys.argv[2:] == ["uneven"]:
    x, y = data()
    x, y = (x, y) if index == 0 else (x[:32], y[:32])
    with strategy.scope():
        model = build("sequential")
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
        calls = {"fit": lambda: model.fit(x, y, batch_size=BATCH, verbose=0),
                 "evaluate": lambda: model.evaluate(x, y, batch_size=BATCH, verbose=0),
                 "predict": lambda: model.predict(x, batch_size=BATCH, verbose=0),
                 # The same batches, but epochs differ: it hung (until the shutdown timeout).
                 "epochs": lambda: model.fit(x[:32], y[:32], batch_size=BATCH,
                                             epochs=1 + index, verbose=0)}
        for mode, call in calls.items():
            try:
                call()
            except ValueError as error:
                say(mode, "raised:", error)
                failure = error
            else:
                say(mode, "ran without an error")
    ipu.distributed.barrier("every instance said what it got")
    raise failure
if sys.argv[2:] == ["programs"]:
    x, y = instance_data(index)

    def model_of(width=8, accumulation=None, loss="mse", loss_weights=None):
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(width),
                                      keras.layers.Dense(3)])
            model.compile(optimizer="sgd", loss=loss, loss_weights=loss_weights,
                          steps_per_execution=4)
            if accumulation:
                model.set_gradient_accumulation_options(
                    gradient_accumulation_steps_per_replica=accumulation)
        return model

    def evaluating_in_instance_0():
        model = model_of()
        hook = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: index == 0 and (
            model.evaluate(x, y, batch_size=BATCH, verbose=0)))
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[hook])

    def prefetching(depth):
        model = model_of()
        model.set_infeed_queue_options(prefetch_depth=depth)
        return model

    cases = {"width": lambda: model_of(8 + 8 * index).fit(x, y, batch_size=BATCH, verbose=0),
             "options": lambda: model_of(accumulation=1 + index).fit(x, y, batch_size=BATCH,
                                                                    verbose=0),
             "dtype": lambda: model_of().predict(x.astype("float32" if index else "int32"),
                                                 batch_size=BATCH, verbose=0),
             # The host's own prefetching may differ: it changes no program.
             "prefetch": lambda: prefetching(2 + index).fit(x, y, batch_size=BATCH, verbose=0),
             # Before: trained on a blend of both losses, silently.
             "loss": lambda: model_of(loss=("mse", "mae")[index]).fit(x, y, batch_size=BATCH,
                                                                     verbose=0),
             # Before: refused, Keras' one loss told apart by how it was spelt.
             "loss spellings": lambda: model_of(loss=(
                 "mse", keras.losses.MeanSquaredError(name="mine"))[index]).fit(
                 x, y, batch_size=BATCH, verbose=0),
             "loss weights": lambda: model_of(loss_weights=[1.0 + index]).fit(
                 x, y, batch_size=BATCH, verbose=0),
             # Before: the job aborted in gloo (the calls gather plans of other sizes).
             "calls": lambda: (model_of().fit if index == 0 else model_of().evaluate)(
                 x, y, batch_size=BATCH, verbose=0),
             # Before: a garbage `stop_training` value named, and a hang if caught.
             "callback call": evaluating_in_instance_0,
             # Before: each instance trained a table of its own.
             "host embedding": lambda: ipu.embedding_ops.create_host_embedding(
                 "table", [4, 2], np.float32, optimizer_spec=(
                     ipu.embedding_ops.HostEmbeddingOptimizerSpec(0.1))).register().__enter__()}
    for case, call in cases.items():
        try:
            call()
        except (ValueError, RuntimeError) as error:
            say(case, "raised:", error)
        else:
            say(case, "ran without an error")
    sys.exit()
x, y = instance_data(index)
results = {}
for name, kind, accumulation in CASES:
    case = run_case(strategy, name, kind, accumulation, x, y)
    results.update({f"{name}/{key}": value for key, value in case.items()})
# The predict batch hook gets this instance's predictions, as predict returns them (before:
# the program's rows of every instance, [steps, replicas, batch, ...]).
seen = []
with strategy.scope():
    model = build("sequential")
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    hook = keras.callbacks.LambdaCallback(
        on_predict_batch_end=lambda batch, logs: seen.append(np.asarray(logs["outputs"])))
    results["hooks/predict"] = model.predict(x, batch_size=BATCH, verbose=0, callbacks=[hook])
results["hooks/seen"] = np.concatenate(seen)
np.savez(f"{out}/instance{index}.npz", **results)
say("done", index)
