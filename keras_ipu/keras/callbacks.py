"""Callbacks for IPU models: TensorBoard logging without TensorFlow.

`keras.callbacks.TensorBoard` needs TensorFlow, also on Keras 3 with JAX.
`TensorBoard` here takes Keras' arguments and writes TensorBoard event files
through tensorboardX (the optional extra `keras_ipu[tensorboard]`), in the
layout Keras uses (`log_dir/train`, `log_dir/validation`, tags such as
`epoch_loss`), plus what an IPU user looked at in PopVision: each IPU's
memory and estimated cycles from the execution report.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np
from keras.src.callbacks.callback import Callback

from keras_ipu.keras import options

# Keras arguments accepted for ported code; the device model has nothing to
# write for them.
_NO_EFFECT = ("profile_batch", "embeddings_freq", "embeddings_metadata")


class TensorBoard(Callback):
    """Writes TensorBoard logs of training, without TensorFlow.

    Scalars (per epoch: `epoch_<metric>`, with `val_` metrics in the
    `validation` run; per batch with `update_freq`: `batch_<metric>`, every
    step with asynchronous callbacks; with `set_replication_options("LIST")`
    one per replica, `epoch_<metric>/replica_<i>`; each evaluation's results,
    `evaluation_<metric>_vs_iterations` at the optimizer's step, in the
    `validation` run), the learning rate, weight histograms
    (`histogram_freq`), kernels as images (`write_images`), the model summary
    as text (`write_graph`: there is no TensorFlow graph), and the IPUs of the
    execution report: `ipu/memory_bytes/ipu_<i>`,
    `ipu/memory_fraction/ipu_<i>` and `ipu/estimated_cycles/ipu_<i>`, each
    epoch.

    Args:
        log_dir: Where the runs' event files go.
        histogram_freq: Epochs between weight histograms (0: none).
        write_graph: Write the model summary (text).
        write_images: Write 2-D kernels as images.
        write_steps_per_second: Write `epoch_steps_per_second`.
        update_freq: `"epoch"`, `"batch"`, or a number of batches between
            batch-level scalars. Their step is the batch's number since
            training began; without asynchronous callbacks a hook sees an
            execution's last batch, so scalars come at the executions that
            reach the next multiple of `update_freq`.
        profile_batch, embeddings_freq, embeddings_metadata: Accepted for
            ported code; no effect.

    Raises:
        ImportError: When tensorboardX is not installed (`pip install
            keras_ipu[tensorboard]`).
        ValueError: For an unknown `update_freq` or a negative frequency.

    Example:

    >>> model.fit(x, y, callbacks=[keras_ipu.keras.callbacks.TensorBoard("logs")])
    """

    def __init__(self, log_dir: str = "logs", histogram_freq: int = 0, write_graph: bool = True,
                 write_images: bool = False, write_steps_per_second: bool = False,
                 update_freq: str | int = "epoch", profile_batch: Any = 0,
                 embeddings_freq: int = 0, embeddings_metadata: Any = None):
        super().__init__()
        _writer_class()  # fail now, not at the first epoch
        if not (update_freq in ("epoch", "batch") or
                (isinstance(update_freq, int) and update_freq > 0)):
            raise ValueError(
                f"`update_freq` must be 'epoch', 'batch' or a positive integer, got "
                f"{update_freq!r}.")
        if not isinstance(histogram_freq, int) or histogram_freq < 0:
            raise ValueError(f"`histogram_freq` must be an integer >= 0, got {histogram_freq!r}.")
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = histogram_freq
        self.write_graph = write_graph
        self.write_images = write_images
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self.ignored = {name: value for name, value in zip(
            _NO_EFFECT, (profile_batch, embeddings_freq, embeddings_metadata)) if value}
        self._writers: dict[str, Any] = {}
        # Batches trained before this epoch, and the last batch step written.
        self._batches_before = 0
        self._written_step = 0
        self._epoch_started = 0.0
        self._epoch_batches = 0

    def _writer(self, run: str) -> Any:
        if run not in self._writers and _another_instance():
            # Instance 0 alone writes the job's logs, as TensorFlow keeps the chief's: each
            # instance's event files would repeat every step.
            self._writers[run] = _Unwritten()
        if run not in self._writers:
            # A name of its own: event files are named by the second they are made in, and a
            # second fit's writer would overwrite the first's (as TensorFlow's, pid and id).
            self._writers[run] = _writer_class()(
                os.path.join(self.log_dir, run),
                filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:12]}")
        return self._writers[run]

    def on_train_begin(self, logs=None):
        # A callback used for another fit counts its batches from 0 again, as Keras' does.
        self._batches_before = self._written_step = self._epoch_batches = 0
        if self.write_graph:
            lines: list[str] = []
            self.model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
            self._writer("train").add_text("model_summary", "\n".join(
                f"    {line}" for line in lines), 0)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_started = time.perf_counter()
        self._batches_before += self._epoch_batches
        self._epoch_batches = 0

    def on_train_batch_end(self, batch, logs=None):
        # The step is the batch's number since training began: the hook runs once per
        # execution (its last batch), or per batch (asynchronous; once per replica).
        self._epoch_batches = batch + 1
        step = self._batches_before + batch + 1
        if self.update_freq == "epoch" or (
                step // self.update_freq <= self._written_step // self.update_freq):
            return
        self._written_step = step
        writer = self._writer("train")
        for name, value in _scalars(logs, _per_replica(self.model)).items():
            writer.add_scalar(f"batch_{name}", value, step)

    def on_epoch_end(self, epoch, logs=None):
        train, validation = self._writer("train"), None
        # The optimizer's rate replaces the logs' (a rate callback's, before it changed
        # the rate), as in Keras' TensorBoard: one value an epoch.
        scalars = _scalars(logs, _per_replica(self.model))
        for name, value in {**scalars, **_learning_rates(self.model)}.items():
            if name.startswith("val_"):
                validation = validation or self._writer("validation")
                validation.add_scalar(f"epoch_{name[4:]}", value, epoch)
            else:
                train.add_scalar(f"epoch_{name}", value, epoch)
        if self.write_steps_per_second and self._epoch_batches:
            seconds = time.perf_counter() - self._epoch_started
            train.add_scalar("epoch_steps_per_second", self._epoch_batches / seconds, epoch)
        self._write_ipus(train, epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            self._write_weights(train, epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_test_end(self, logs=None):
        # An evaluation's results (fit's validation, or `evaluate`'s), at the optimizer's
        # step, as Keras' TensorBoard writes them.
        iterations = getattr(getattr(self.model, "optimizer", None), "iterations", None)
        if iterations is None:
            return
        writer = self._writer("validation")
        step = int(np.asarray(iterations))
        for name, value in _scalars(logs, _per_replica(self.model)).items():
            writer.add_scalar(f"evaluation_{name}_vs_iterations", value, step)
        writer.flush()

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    def _write_ipus(self, writer: Any, epoch: int) -> None:
        """Each IPU's memory and estimated cycles, from the fit's execution report."""
        from keras_ipu.keras import report

        try:
            execution = report.execution_report(self.model, "fit")
        except (ValueError, AttributeError):
            return  # not an IPU model, or nothing compiled
        for ipu in execution.ipus:
            writer.add_scalar(f"ipu/memory_bytes/ipu_{ipu.index}", ipu.memory_bytes, epoch)
            writer.add_scalar(f"ipu/memory_fraction/ipu_{ipu.index}", ipu.memory_fraction, epoch)
            writer.add_scalar(f"ipu/estimated_cycles/ipu_{ipu.index}", ipu.estimated_cycles,
                              epoch)

    def _write_weights(self, writer: Any, epoch: int) -> None:
        for layer in self.model.layers:
            for weight in layer.weights:
                name = weight.path.replace(":", "_")
                values = np.asarray(weight.numpy())
                writer.add_histogram(name, values, epoch)
                if self.write_images and values.ndim == 2:
                    span = float(values.max() - values.min()) or 1.0
                    writer.add_image(f"{name}/image", (values - values.min()) / span, epoch,
                                     dataformats="HW")


def _scalars(logs: Any, per_replica: bool = False) -> dict[str, float]:
    """The scalar entries of Keras logs, as floats; with `per_replica` (the LIST
    reduction), a vector of the replicas' values as `<name>/replica_<i>`."""
    scalars = {}
    for name, value in (logs or {}).items():
        values = np.asarray(value)
        if values.dtype.kind not in "biuf":  # not a number (None would read as NaN)
            continue
        if values.ndim == 0:
            scalars[name] = float(values)
        elif values.ndim == 1 and per_replica:
            scalars.update({f"{name}/replica_{i}": float(v) for i, v in enumerate(values)})
    return scalars


def _per_replica(model: Any) -> bool:
    """Whether the model's logs hold every replica's value (`set_replication_options("LIST")`)."""
    method = options.options_of(model).replicated_metric_reduction_method
    return method is options.ReplicatedMetricReductionMethod.LIST


def _learning_rates(model: Any) -> dict[str, float]:
    """The optimizer's current learning rates by log name, as Keras' TensorBoard names them."""
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    named = {f"learning_rate_{inner.name}": inner
             for inner in getattr(optimizer, "optimizers", ())} or {"learning_rate": optimizer}
    rates = {}
    for name, inner in named.items():
        try:
            rates[name] = float(np.asarray(getattr(inner, "learning_rate", None)))
        except (TypeError, ValueError):
            continue
    return rates


def _writer_class() -> type:
    try:
        from tensorboardX import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "keras_ipu.keras.callbacks.TensorBoard writes event files with tensorboardX: "
            "`pip install keras_ipu[tensorboard]` (or `pip install tensorboardX`)."
        ) from error
    return SummaryWriter




class _Unwritten:
    """A writer that writes nothing (another instance's than instance 0's)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _another_instance() -> bool:
    """Whether this process is an instance of a job other than instance 0."""
    import jax

    return (jax.distributed.is_initialized() and jax.process_count() > 1
            and jax.process_index() != 0)


__all__ = ["TensorBoard"]
