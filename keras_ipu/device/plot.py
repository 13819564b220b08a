"""Pictures of the device model: a pipeline's timeline, each IPU's memory (matplotlib).

What PopVision showed IPU users, drawn from the device model's own data: the
timeline lays a schedule table out in estimated cycles (IPUs as rows, each
micro-batch's forward and backward as labelled boxes, so ramp-up, steady
state and ramp-down show); the memory chart stacks each IPU's state,
temporaries, stash and io against its capacity. matplotlib is an optional
extra (`keras_ipu[plot]`), imported when a picture is drawn.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Any

from keras_ipu.device import schedules

_FORWARD, _BACKWARD = "#4C78A8", "#F58518"


def timeline(table: schedules.ScheduleTable, forward_cycles: float | Sequence[float] = 1.0,
             backward_cycles: float | Sequence[float] | None = None, title: str | None = None,
             sync_cycles: float = 0.0):
    """Draws a schedule table in time: one row per IPU, one box per forward or backward.

    Args:
        table: The schedule table.
        forward_cycles: Each stage's forward cycles (one number: all stages).
        backward_cycles: The same for backward passes (default: twice the
            forward cycles).
        title: The figure's title (default: the schedule's name).
        sync_cycles: Cycles each tick ends with (synchronisation and
            exchange), drawn as the gap before the next tick.

    Returns:
        The matplotlib `Figure`; its axes' `boxes` attribute lists the drawn
        boxes as `(ipu, start, length, label)`.

    Raises:
        ImportError: Without matplotlib (`pip install keras_ipu[plot]`).

    Example:

    >>> table = schedules.build_schedule("Grouped", 3, 8)
    >>> timeline(table).savefig("grouped.png")
    """
    durations = table.tick_cycles(forward_cycles, backward_cycles)
    costs = _op_costs(table, forward_cycles, backward_cycles)
    figure, axes = _figure(max(6.0, table.num_ticks * 0.45), 1.0 + 0.6 * table.num_ipus)
    boxes, start = [], 0.0
    for tick, duration in zip(table.ticks, durations):
        for ipu, op in enumerate(tick):
            if op is None:
                continue
            length = costs[op.phase][op.stage]
            label = f"{op.phase}{op.micro_batch}"
            boxes.append((ipu, start, length, label))
            axes.barh(ipu, length, left=start, height=0.8, edgecolor="black", linewidth=0.5,
                      color=_FORWARD if op.phase == "F" else _BACKWARD)
            axes.text(start + length / 2, ipu, label, ha="center", va="center", fontsize=7,
                      color="white")
        start += duration + sync_cycles
    axes.boxes = boxes
    axes.set_yticks(range(table.num_ipus), [f"IPU {i}" for i in range(table.num_ipus)])
    axes.invert_yaxis()
    axes.set_xlabel("estimated cycles")
    axes.set_title(title or f"{table.schedule.name} schedule: {table.num_stages} stages, "
                            f"{table.num_micro_batches} micro-batches")
    figure.set_layout_engine("tight")
    return figure


def steps_timeline(ipus: Sequence[int], steps: int, step_cycles: float, title: str):
    """A non-pipelined execution in time: each IPU runs its `steps` steps back to back.

    Returns:
        The matplotlib `Figure`.
    """
    figure, axes = _figure(8.0, 1.0 + 0.6 * len(ipus))
    boxes = []
    for row in range(len(ipus)):
        for step in range(steps):
            boxes.append((row, step * step_cycles, step_cycles, f"{step}"))
            axes.barh(row, step_cycles, left=step * step_cycles, height=0.8, color=_FORWARD,
                      edgecolor="black", linewidth=0.5)
    axes.boxes = boxes
    axes.set_yticks(range(len(ipus)), [f"IPU {i}" for i in ipus])
    axes.invert_yaxis()
    axes.set_xlabel("estimated cycles")
    axes.set_title(title)
    figure.set_layout_engine("tight")
    return figure


def memory(ipus: Sequence[Any], stash_bytes: Sequence[int] = (), title: str = "Memory per IPU"):
    """Each IPU's memory, stacked by part (state, temporaries, stash, io), against its capacity.

    Args:
        ipus: `IPUReport`s.
        stash_bytes: Per IPU, the part of its temporaries that is the
            pipeline's stash (shown apart).
        title: The figure's title.

    Returns:
        The matplotlib `Figure`.

    Example:

    >>> memory(report.ipus).savefig("memory.png")
    """
    figure, axes = _figure(1.5 + 1.2 * len(ipus), 3.5)
    names = [f"IPU {ipu.index}" for ipu in ipus]
    stash = list(stash_bytes) + [0] * (len(ipus) - len(stash_bytes))
    parts = {
        "state": [ipu.state_bytes for ipu in ipus],
        "temporaries": [max(ipu.temporary_bytes - s, 0) for ipu, s in zip(ipus, stash)],
        "stash": stash,
        "io": [ipu.io_bytes for ipu in ipus],
    }
    bottom = [0.0] * len(ipus)
    for label, values in parts.items():
        mib = [v / 2**20 for v in values]
        axes.bar(names, mib, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, mib)]
    capacity = ipus[0].memory_capacity_bytes / 2**20 if ipus else 0
    axes.axhline(capacity, color="red", linestyle="--", label="capacity")
    axes.set_ylabel("MiB")
    axes.set_title(title)
    axes.legend(fontsize=7)
    figure.set_layout_engine("tight")
    return figure


def _op_costs(table, forward_cycles, backward_cycles) -> dict[str, list[float]]:
    count = table.num_stages
    forward = _per_stage(forward_cycles, count)
    backward = (_per_stage(backward_cycles, count) if backward_cycles is not None
                else [2 * f for f in forward])
    return {"F": forward, "B": backward}


def _per_stage(cycles: float | Sequence[float], count: int) -> list[float]:
    return [float(cycles)] * count if isinstance(cycles, (int, float)) else list(cycles)


def _figure(width: float, height: float):
    """A matplotlib `Figure` and its axes, outside pyplot's state.

    Jupyter shows a bare `Figure` as a picture only once pyplot has loaded
    its inline backend (`%matplotlib inline`); the figure's own
    `_repr_png_` makes it one in any kernel.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "Pictures need matplotlib: `pip install keras_ipu[plot]` (or `pip install "
            "matplotlib`)."
        ) from error
    figure = Figure(figsize=(width, height))
    figure._repr_png_ = functools.partial(_png, figure)
    return figure, figure.subplots()


def _png(figure) -> bytes:
    picture = io.BytesIO()
    figure.savefig(picture, format="png", bbox_inches="tight")
    return picture.getvalue()


__all__ = ["memory", "steps_timeline", "timeline"]
