"""Pictures of the device model: timelines that match the schedule table, memory, HTML reports."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import schedules

from conftest import configure
from models import data_for, two_stage_mlp

SCHEDULES = list(ipu.pipelining_ops.PipelineSchedule)


def _rows(figure):
    """Per IPU row, the drawn boxes' labels left to right."""
    boxes = figure.axes[0].boxes
    return [[label for row, _, _, label in sorted(boxes, key=lambda b: b[1]) if row == ipu]
            for ipu in range(1 + max(b[0] for b in boxes))]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_the_timeline_draws_the_schedule_table(schedule, tmp_path):
    figure = ipu.utils.plot_schedule(3, 8, schedule, path=tmp_path / "t.png")
    table = schedules.build_schedule(schedule, 3, 8)
    assert _rows(figure) == [[f"{op.phase}{op.micro_batch}" for op in table.ops_of(i)]
                             for i in range(table.num_ipus)]
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each box starts when its tick starts, and the ticks follow each other.
    starts = {b[1] for b in figure.axes[0].boxes}
    assert min(starts) == 0 and len(starts) == table.num_ticks - sum(
        all(op is None for op in tick) for tick in table.ticks)


def test_a_schedule_that_cannot_run_is_refused_as_fit_refuses_it():
    for schedule in ("Grouped", "Interleaved"):
        with pytest.raises(ValueError, match=rf"2 micro-batches are too few for the {schedule} "
                                             r"schedule of 3 pipeline stages: the minimum is 3"):
            ipu.utils.plot_schedule(3, 2, schedule)
    assert len(ipu.utils.plot_schedule(3, 1, "Sequential").axes[0].boxes) == 3 * 2


def test_the_three_schedules_look_different():
    drawn = {s: [(row, start, length) for row, start, length, _ in
                 ipu.utils.plot_schedule(3, 8, s).axes[0].boxes] for s in SCHEDULES}
    assert len({tuple(sorted(boxes)) for boxes in drawn.values()}) == 3


def _pipelined_fit_report(num_ipus: int):
    """The fit report of a 2-stage pipeline (GA 8, one pass an execution) on `num_ipus` IPUs."""
    configure(num_ipus)
    x, y = data_for("sequential", samples=64)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = two_stage_mlp()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=8)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    return ipu.utils.execution_report(model, "fit")


def test_a_pipelined_reports_pictures_and_html(strategy, tmp_path):
    report = _pipelined_fit_report(2)
    figure = report.plot_timeline(tmp_path / "fit.png")
    table = schedules.build_schedule("Grouped", 2, 8)
    assert _rows(figure) == [[f"{op.phase}{op.micro_batch}" for op in table.ops_of(i)]
                             for i in range(2)]
    # Boxes last as long as the report's per-stage cycles.
    lengths = {label[0]: length for row, _, length, label in figure.axes[0].boxes if row == 0}
    assert lengths["F"] == pytest.approx(report.pipeline.stage_forward_cycles[0])
    # The timeline is one pass, with each tick's synchronisation: as long as the report's.
    end = max(start + length for _, start, length, _ in figure.axes[0].boxes)
    assert end + report.pipeline.sync_cycles == pytest.approx(report.estimated_cycles, abs=1)
    memory = report.plot_memory(tmp_path / "memory.png")
    bars = [p.get_height() for p in memory.axes[0].patches]
    assert len(bars) == 4 * 2 and (tmp_path / "memory.png").exists()
    state = [bar * 2**20 for bar in bars[:2]]
    np.testing.assert_allclose(state, [i.state_bytes for i in report.ipus], rtol=1e-6)
    html = report._repr_html_()
    assert html.count("<tr>") == 1 + 2 and "Execution report: fit" in html


def test_a_single_ipu_timeline(strategy):
    x, y = data_for("sequential", samples=32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    figure = ipu.utils.execution_report(model, "fit").plot_timeline()
    assert len(figure.axes[0].boxes) == 4


def test_every_replica_of_a_pipeline_shows_its_stash(strategy):
    report = _pipelined_fit_report(4)
    assert report.replicas == 2 and len(report.ipus) == 4
    bars = [p.get_height() * 2**20 for p in report.plot_memory().axes[0].patches]
    stash = bars[2 * 4: 3 * 4]  # state, temporaries, stash, io: 4 bars each
    np.testing.assert_allclose(stash, list(report.pipeline.stash_bytes) * 2, rtol=1e-6)
    assert min(stash) > 0
