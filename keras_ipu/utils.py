"""General utilities: the device model's execution report, weight placement, schedule pictures."""

from __future__ import annotations

from typing import Any

from keras_ipu.keras.report import execution_report, weight_placement


def plot_schedule(num_stages: int, gradient_accumulation_steps: int, schedule: Any = "Grouped",
                  device_mapping: Any = None, training: bool = True, path: str | None = None):
    """Draws a pipeline schedule before anything runs (each forward 1 unit, each backward 2).

    Args:
        num_stages: Pipeline stages.
        gradient_accumulation_steps: Micro-batches per pass (per weight update).
        schedule: A `keras_ipu.pipelining_ops.PipelineSchedule`, or its name.
        device_mapping: The IPU of each stage (default: stage i on IPU i).
        training: Draw backward passes too.
        path: Also save the picture there (PNG, ...).

    Returns:
        The matplotlib `Figure`.

    Raises:
        ValueError: For a schedule that cannot run with these numbers.
        ImportError: Without matplotlib (`pip install keras_ipu[plot]`).

    Example:

    >>> keras_ipu.utils.plot_schedule(3, 8, "Interleaved", path="interleaved.png")
    """
    from keras_ipu.device import plot, schedules

    table = schedules.build_schedule(schedule, num_stages, gradient_accumulation_steps,
                                     device_mapping, training=training)
    figure = plot.timeline(table)
    if path is not None:
        figure.savefig(path)
    return figure


__all__ = ["execution_report", "plot_schedule", "weight_placement"]
