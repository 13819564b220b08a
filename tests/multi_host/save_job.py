"""A 2-instance fit with ModelCheckpoint; instance 0 alone writes, every instance reloads.

Then a fit with BackupAndRestore, whose folder instance 0 alone writes and removes."""

import os
import sys

import keras
import keras.src.saving.saving_lib as saving_lib
import numpy as np
from fit_cases import BATCH, build, instance_data
from job import say, start

out = sys.argv[1]
strategy, index = start()
x, y = instance_data(index)
# Counts the weights files this instance's Keras writes (where `save_weights` writes).
written = []
keras_writes_weights = saving_lib.save_weights_only


def counting_writes(model, filepath, *args, **kwargs):
    written.append(os.path.basename(str(filepath)))
    return keras_writes_weights(model, filepath, *args, **kwargs)


saving_lib.save_weights_only = counting_writes


class Writes(keras.callbacks.Callback):
    """Records, at each epoch's end, the checkpoint files that exist."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        # Only the checkpoints: instance 0 may already be saving the model.
        self.seen.append(sorted(n for n in os.listdir(out) if n.startswith("ckpt_")))


with strategy.scope():
    model = build("sequential")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    writes = Writes()
    checkpoint = keras.callbacks.ModelCheckpoint(
        os.path.join(out, "ckpt_{epoch}.weights.h5"), save_weights_only=True)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[checkpoint, writes])
    say("seen", writes.seen)
    say("written", len(written))
    model.save(os.path.join(out, "model.keras"))
    fresh = build("sequential")
    fresh.load_weights(os.path.join(out, "ckpt_2.weights.h5"))
    same = all(np.allclose(a, b, rtol=1e-6) for a, b in
               zip(fresh.get_weights(), model.get_weights()))
    loaded = keras.models.load_model(os.path.join(out, "model.keras"))
    same_model = all(np.allclose(a, b, rtol=1e-6) for a, b in
                     zip(loaded.get_weights(), model.get_weights()))
    say("reloaded", same, same_model)
    backup = os.path.join(out, "backup")
    for epochs in (1, 3):  # the second fit saves epochs 2 and 3 over the first's backup
        model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup, delete_checkpoint=epochs == 3)])
        say("backup", epochs, sorted(os.listdir(backup)) if os.path.exists(backup) else None)
    # Saved mid-epoch (by instance 0 alone, which reads the model): before, the job hung.
    by_batch = build("sequential")
    by_batch.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    by_batch.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(os.path.join(out, "backup_by_batch"), save_freq=1,
                                         delete_checkpoint=False)])
    say("backup by batch", sorted(os.listdir(os.path.join(out, "backup_by_batch"))))
# Horovod's idiom: instance 0 alone saves, and gives a ModelCheckpoint to its own fit only
# (saving mid-epoch: before, the other instance hung in the next execution's collectives).
only_first = ([keras.callbacks.ModelCheckpoint(os.path.join(out, "first_only.weights.h5"),
                                               save_weights_only=True, save_freq=1)]
              if index == 0 else [])
with strategy.scope():
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=only_first)
    if index == 0:
        model.save_weights(os.path.join(out, "saved_by_first.weights.h5"))
say("first only", sorted(n for n in os.listdir(out) if "first" in n))
# A save of a path of the instance's own: instance 1 would wait for instance 0 to write it
# (for 24 hours before); now it gives up with advice, and keras.saving.save_model writes it.
import keras_ipu.keras.saving as ipu_saving  # noqa: E402

ipu_saving._WAIT_FOR_WRITER_MS = 3000  # the job's own patience, for the test
own = os.path.join(out, f"own_{index}.weights.h5")
with strategy.scope():
    try:
        model.save_weights(own)
        say("own path", "saved")
    except RuntimeError as error:
        say("own path", str(error).split(". In a job")[0])
    keras.saving.save_model(model, os.path.join(out, f"own_{index}.keras"))
say("own files", sorted(n for n in os.listdir(out) if n.startswith("own_")))
# One step on a batch would train this instance's weights alone.
for step in (model.train_on_batch, model.test_on_batch):
    try:
        step(x[:BATCH], y[:BATCH])
        say("on batch", "ran")
    except NotImplementedError as error:
        say("on batch", str(error).split(",")[0])
# An export made in every instance: instance 0 writes it, the others wait and load it
# (before, the second found the directory full, or both purged it).
import keras_ipu as ipu  # noqa: E402

with strategy.scope():
    exported = model.export_for_ipu_serving(os.path.join(out, "export"), batch_size=BATCH)
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    same = np.allclose(exported(x[:BATCH]), predicted[:BATCH], atol=1e-5)
say("export", sorted(os.listdir(os.path.join(out, "export"))), same)
# TensorBoard in every instance: instance 0 alone writes the logs (each wrote every step).
with strategy.scope():
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[ipu.keras.callbacks.TensorBoard(os.path.join(out, "tb"))])
ipu.distributed.barrier("instance 0 closed its event files")
say("event files", len(os.listdir(os.path.join(out, "tb", "train"))))
