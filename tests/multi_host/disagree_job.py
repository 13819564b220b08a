"""Callbacks given to one instance only that change the run: every instance's `fit` must
raise the same `ValueError` (the job hung, or aborted in gloo). Prints what each raised,
then that an agreeing `fit` runs."""

import keras
import numpy as np
from job import say, start

import keras_ipu as ipu


class StopAfterFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True


class StopAtFirstBatch(keras.callbacks.Callback):
    """Stops a run mid-epoch, as a time budget given to one instance does."""

    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True

    def on_test_batch_end(self, batch, logs=None):
        self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        self.model.stop_predicting = True


strategy, index = start()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
x, y = ipu.distributed.shard_for_instance((x, x[:, :3]), 4)
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
mid_run = [StopAtFirstBatch()] if index == 1 else []
runs = {
    "stop": (model.fit, dict(callbacks=[StopAfterFirstEpoch()] if index == 0 else [])),
    "validation": (model.fit, dict(validation_data=(x, y), validation_freq=1 + index)),
    # Before: the instance that stopped left the other waiting in a collective for ever.
    "batch stop": (model.fit, dict(callbacks=mid_run)),
    "evaluate stop": (model.evaluate, dict(callbacks=mid_run)),
    "predict stop": (lambda x, y, **kwargs: model.predict(x, **kwargs), dict(callbacks=mid_run)),
}
for name, (method, arguments) in runs.items():
    if method == model.fit:
        arguments = dict(arguments, epochs=2)
    try:
        method(x, y, batch_size=4, verbose=0, **arguments)
        say(name, "ran")
    except ValueError as error:
        say(name, "raised:", error)
history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
say("agreeing fit ran", len(history.history["loss"]), "epochs")

# Generators of unequal lengths (instance 0: 8 batches, instance 1: 4): every instance stops
# where the first runs out (before: the other waited in the next execution for ever).
batches = 8 if index == 0 else 4


def generator():
    for i in range(batches):
        yield x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]


before = int(model.optimizer.iterations.numpy())
model.fit(generator(), steps_per_epoch=16, verbose=0)
say("generator fit ran", int(model.optimizer.iterations.numpy()) - before, "steps")
say("generator evaluate", round(float(model.evaluate(generator(), steps=16, verbose=0)), 6))
say("generator predict", model.predict(generator(), steps=16, verbose=0).shape)
history = model.fit(x, y, batch_size=4, validation_data=generator(), validation_steps=16,
                    verbose=0)
say("generator validation", sorted(history.history))
