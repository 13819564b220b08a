"""The execution report: what one compiled execution costs on each IPU."""

from __future__ import annotations

import dataclasses
import html
from typing import Any

from keras_ipu.device.system import ipu_ranges


@dataclasses.dataclass(frozen=True)
class IPUReport:
    """One IPU's share of an execution.

    Args:
        index: The IPU's index in the system.
        memory_bytes: Bytes the program needs on this IPU.
        memory_capacity_bytes: Bytes the IPU has for the program (its compute tiles × bytes
            per tile).
        estimated_cycles: Estimated cycles of one execution on this IPU.
        state_bytes: Of `memory_bytes`: weights, optimizer and metric state.
        temporary_bytes: Of `memory_bytes`: activations and workspace.
        io_bytes: Of `memory_bytes`: one step's infeed and outfeed buffers.
        device: The JAX device the IPU runs on.
    """

    index: int
    memory_bytes: int
    memory_capacity_bytes: int
    estimated_cycles: int
    state_bytes: int = 0
    temporary_bytes: int = 0
    io_bytes: int = 0
    device: str = ""

    @property
    def memory_fraction(self) -> float:
        """Memory used over capacity."""
        return self.memory_bytes / self.memory_capacity_bytes


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    """What the schedule of a pipelined execution costs.

    Args:
        schedule: The schedule's name.
        num_stages: Pipeline stages.
        micro_batches: Micro-batches per pass through the pipeline.
        device_mapping: The IPU of each stage.
        stage_forward_cycles: Estimated cycles of each stage's forward.
        stage_backward_cycles: Estimated cycles of each stage's backward
            (zeros for inference).
        utilisation: Busy time over total time of the schedule table, each
            op weighted by its stage's cycles (a tick lasts as long as its
            slowest op).
        stash_counts: Per stage, the most micro-batches whose activations it
            holds at once under the schedule.
        stash_bytes: Per stage, the activation memory that implies: stash
            count × what the stage keeps per micro-batch (its input with
            recomputation; its input and every activation without).
        recomputation: Whether stages recompute activations in the backward
            pass (`IPUConfig.allow_recompute`).
        ticks: Time steps of one pass.
        ignored_options: Pipelining options accepted without effect on the
            device model.
        sync_cycles: The synchronisation and exchange between two ticks,
            which each tick pays besides its slowest op.
        stage_forward_flops: Counted flops of each stage's forward op (one
            micro-batch).
        stage_backward_flops: Counted flops of each stage's backward op
            (zeros for inference).
    """

    schedule: str
    num_stages: int
    micro_batches: int
    device_mapping: tuple[int, ...]
    stage_forward_cycles: tuple[float, ...]
    stage_backward_cycles: tuple[float, ...]
    utilisation: float
    stash_counts: tuple[int, ...]
    ticks: int
    stash_bytes: tuple[int, ...] = ()
    recomputation: bool = False
    ignored_options: tuple[str, ...] = ()
    sync_cycles: float = 0.0
    stage_forward_flops: tuple[float, ...] = ()
    stage_backward_flops: tuple[float, ...] = ()

    @property
    def flops_per_micro_batch(self) -> float:
        """Every stage's forward and backward op on one micro-batch."""
        return float(sum(self.stage_forward_flops) + sum(self.stage_backward_flops))

    def __str__(self) -> str:
        stages = ", ".join(
            f"stage {s} on IPU {ipu}: {_cycles(f)} fwd / {_cycles(b)} bwd cycles, stash {n}"
            + (f" ({self.stash_bytes[s]:,} B)" if self.stash_bytes else "")
            for s, (ipu, f, b, n) in enumerate(zip(
                self.device_mapping, self.stage_forward_cycles, self.stage_backward_cycles,
                self.stash_counts))
        )
        ignored = (f"; accepted without effect: {', '.join(self.ignored_options)}"
                   if self.ignored_options else "")
        return (
            f"Pipeline: {self.schedule} schedule, {self.num_stages} stages, "
            f"{self.micro_batches} micro-batches, {self.ticks} ticks, utilisation "
            f"{100 * self.utilisation:.1f}%{ignored}\n  {stages}"
        )


@dataclasses.dataclass(frozen=True)
class ExecutionReport:
    """The device model's account of one compiled execution.

    Args:
        mode: `"fit"`, `"evaluate"` or `"predict"`.
        hardware: The modelled IPU (for example `"Mk2 GC200 (ipu2)"`).
        clock_hz: The modelled clock frequency.
        steps_per_execution: Steps the execution runs on the device.
        ipus: One `IPUReport` per IPU the execution uses.
        flops_per_step: Floating point operations of one step (per IPU);
            for a pipeline, of one micro-batch through every stage op (the
            pipeline's `flops_per_micro_batch`), whichever form runs it.
        compile_seconds: Host time spent compiling the program.
        replicas: The replication factor.
        pipeline: The pipeline's report, for pipelined programs.
        loop: How the steps ran: `"scan"` (an on-device loop), `"host"`
            (one compiled step dispatched per step) or `"schedule"`
            (pipelined programs: the schedule table is the loop).
        loop_reason: Why that loop form.
        compiler: The XLA options the program was compiled with, and why
            (`keras_ipu.device.compiler`).

    Example:

    >>> report = keras_ipu.utils.execution_report(model, mode="fit")
    >>> report.ipus[0].memory_bytes <= report.ipus[0].memory_capacity_bytes
    True
    >>> print(report)  # a table, one row per IPU
    """

    mode: str
    hardware: str
    clock_hz: float
    steps_per_execution: int
    ipus: tuple[IPUReport, ...]
    flops_per_step: float = 0.0
    compile_seconds: float = 0.0
    replicas: int = 1
    pipeline: PipelineReport | None = None
    loop: str = "scan"
    loop_reason: str = ""
    compiler: str = ""

    @property
    def shared_devices(self) -> dict[str, tuple[int, ...]]:
        """The IPUs of each JAX device that runs several of them (empty when none share).

        IPUs that share a device run batched in one program there; each is
        still accounted on its own (an equal share of the device program's
        temporaries and work).

        Example:

        >>> report.shared_devices   # 8 IPUs on 2 CPU devices
        {'cpu:0': (0, 1, 2, 3), 'cpu:1': (4, 5, 6, 7)}
        """
        by_device: dict[str, tuple[int, ...]] = {}
        for ipu in self.ipus:
            by_device[ipu.device] = (*by_device.get(ipu.device, ()), ipu.index)
        return {device: ipus for device, ipus in by_device.items() if len(ipus) > 1}

    @property
    def estimated_cycles(self) -> int:
        """Cycles of one execution: the slowest IPU's."""
        return max(ipu.estimated_cycles for ipu in self.ipus)

    @property
    def estimated_seconds(self) -> float:
        """Estimated device time of one execution on real IPUs."""
        return self.estimated_cycles / self.clock_hz

    @property
    def estimated_steps_per_second(self) -> float:
        """Estimated steps per second on real IPUs."""
        return self.steps_per_execution / self.estimated_seconds

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-serialisable)."""
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("ipus", "pipeline")},
            "pipeline": dataclasses.asdict(self.pipeline) if self.pipeline else None,
            "estimated_cycles": self.estimated_cycles,
            "estimated_seconds": self.estimated_seconds,
            "ipus": [dataclasses.asdict(ipu) for ipu in self.ipus],
            "shared_devices": {d: list(ipus) for d, ipus in self.shared_devices.items()},
        }

    def _header(self) -> str:
        return (
            f"Execution report: {self.mode}, {self.steps_per_execution} step(s) per "
            f"execution on {self.hardware} at {self.clock_hz / 1e9:.2f} GHz, "
            f"{self.replicas} replica(s); loop: {self.loop}"
            + (f" ({self.loop_reason})" if self.loop_reason else "")
        )

    def _footer(self) -> str:
        return (
            f"Estimated {self.estimated_seconds * 1e3:.3f} ms per execution "
            f"({self.estimated_steps_per_second:,.0f} steps/s); "
            f"{self.flops_per_step:,.0f} flops per step; compiled in "
            f"{self.compile_seconds:.2f} s"
            + (f" with {self.compiler}" if self.compiler else "") + "." + self._sharing()
        )

    def _sharing(self) -> str:
        shared = self.shared_devices
        if not shared:
            return ""
        return (" Shared JAX devices (each IPU accounted on its own): "
                + "; ".join(f"IPUs {ipu_ranges(ipus)} share {device}"
                            for device, ipus in shared.items()) + ".")

    def _rows(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        columns = ("IPU", "device", "memory", "capacity", "used", "state", "temporary",
                   "io", "est. cycles")
        rows = [
            (
                str(ipu.index),
                ipu.device,
                _mib(ipu.memory_bytes),
                _mib(ipu.memory_capacity_bytes),
                f"{100 * ipu.memory_fraction:.2f}%",
                _mib(ipu.state_bytes),
                _mib(ipu.temporary_bytes),
                _mib(ipu.io_bytes),
                f"{ipu.estimated_cycles:,}",
            )
            for ipu in self.ipus
        ]
        return columns, rows

    def __str__(self) -> str:
        columns, rows = self._rows()
        widths = [max(len(r[i]) for r in (columns, *rows)) for i in range(len(columns))]
        lines = [self._header(), "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        lines.append(self._footer())
        if self.pipeline is not None:
            lines.append(str(self.pipeline))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The report as an HTML table (how Jupyter shows it)."""
        columns, rows = self._rows()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>"
                       for row in rows)
        pipeline = (f"<pre>{html.escape(str(self.pipeline))}</pre>"
                    if self.pipeline is not None else "")
        return (f"<p>{html.escape(self._header())}</p><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table><p>{html.escape(self._footer())}</p>{pipeline}")

    def plot_timeline(self, path: str | None = None):
        """Draws the execution in estimated cycles: a pipeline's schedule, or each IPU's steps.

        Args:
            path: Also save the picture there (PNG, or any matplotlib format).

        Returns:
            The matplotlib `Figure`.

        Raises:
            ImportError: Without matplotlib (`pip install keras_ipu[plot]`).

        Example:

        >>> keras_ipu.utils.execution_report(model, "fit").plot_timeline("timeline.png")
        """
        from keras_ipu.device import plot, schedules

        pipeline = self.pipeline
        if pipeline is not None:
            table = schedules.build_schedule(pipeline.schedule, pipeline.num_stages,
                                             pipeline.micro_batches, pipeline.device_mapping,
                                             training=self.mode == "fit")
            figure = plot.timeline(table, pipeline.stage_forward_cycles,
                                   pipeline.stage_backward_cycles if self.mode == "fit"
                                   else None,
                                   title=f"{pipeline.schedule} pipeline ({self.mode}), one pass "
                                         f"of {pipeline.micro_batches} micro-batches, "
                                         f"utilisation {pipeline.utilisation:.0%}",
                                   sync_cycles=pipeline.sync_cycles)
        else:
            steps = self.steps_per_execution
            figure = plot.steps_timeline([ipu.index for ipu in self.ipus], steps,
                                         self.estimated_cycles / max(steps, 1),
                                         f"{self.mode}: {steps} steps per execution")
        if path is not None:
            figure.savefig(path)
        return figure

    def plot_memory(self, path: str | None = None):
        """Draws each IPU's memory (state, temporaries, stash, io) against its capacity.

        Args:
            path: Also save the picture there.

        Returns:
            The matplotlib `Figure`.

        Example:

        >>> keras_ipu.utils.execution_report(model, "fit").plot_memory("memory.png")
        """
        from keras_ipu.device import plot

        stash = [0] * len(self.ipus)
        if self.pipeline is not None and self.pipeline.stash_bytes:
            # The IPUs come replica by replica; the mapping names a replica's own IPUs.
            per_replica = len(self.ipus) // max(self.replicas, 1)
            for position in range(len(self.ipus)):
                stash[position] = sum(
                    size for ipu, size in zip(self.pipeline.device_mapping,
                                              self.pipeline.stash_bytes)
                    if ipu == position % per_replica)
        figure = plot.memory(self.ipus, stash, title=f"Memory per IPU ({self.mode})")
        if path is not None:
            figure.savefig(path)
        return figure


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def _cycles(cycles: float) -> str:
    """Whole cycles, or three significant digits below 100 (peak-rate estimates of small
    stages are fractions of a cycle: not 0)."""
    return f"{cycles:,.0f}" if cycles >= 100 else f"{cycles:.3g}"
