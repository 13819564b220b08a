"""Pipeline schedules as data: dependency rules, exact tables, utilisation and stash counts."""

from __future__ import annotations

import subprocess
import sys

import pytest

import keras_ipu as ipu
import keras_ipu.ops.pipelining_ops  # noqa: F401  (not in keras_ipu._SUBMODULES yet)
import keras_ipu.pipelining_ops  # noqa: F401
from keras_ipu.device.schedules import (
    Op,
    PipelineSchedule,
    RecomputationMode,
    ScheduleTable,
    build_schedule,
    closed_form_utilisation,
    minimum_micro_batches,
)

GROUPED = PipelineSchedule.Grouped
INTERLEAVED = PipelineSchedule.Interleaved
SEQUENTIAL = PipelineSchedule.Sequential
SCHEDULES = (GROUPED, INTERLEAVED, SEQUENTIAL)


@pytest.fixture(autouse=True)
def ipu_system():
    """Schedules are pure data: no IPU system needed (overrides conftest's fixture)."""
    yield


def op_ticks(table: ScheduleTable) -> dict[Op, int]:
    """Each op's tick; fails if an op appears twice."""
    where: dict[Op, int] = {}
    for t, tick in enumerate(table.ticks):
        for op in tick:
            if op is not None:
                assert op not in where, f"{op} runs twice"
                where[op] = t
    return where


def check_table(table: ScheduleTable) -> dict[Op, int]:
    """Asserts the rules every schedule obeys; returns each op's tick."""
    p, m = table.num_stages, table.num_micro_batches
    for tick in table.ticks:
        assert len(tick) == table.num_ipus
        assert any(op is not None for op in tick), "an all-idle tick"
        for index, op in enumerate(tick):
            if op is not None:
                assert table.device_mapping[op.stage] == index, f"{op} on IPU {index}"
    where = op_ticks(table)
    expected = {Op(s, k, "F") for s in range(p) for k in range(m)}
    if table.training:
        expected |= {Op(s, k, "B") for s in range(p) for k in range(m)}
    assert set(where) == expected
    for k in range(m):
        for s in range(1, p):
            assert where[Op(s, k, "F")] > where[Op(s - 1, k, "F")]
        if table.training:
            assert where[Op(p - 1, k, "B")] > where[Op(p - 1, k, "F")]
            for s in range(p - 1):
                assert where[Op(s, k, "B")] > where[Op(s + 1, k, "B")]
    if table.schedule is SEQUENTIAL:
        assert all(sum(op is not None for op in tick) == 1 for tick in table.ticks)
    if table.schedule is GROUPED and table.training:
        for tick in table.ticks:
            assert len({op.phase for op in tick if op is not None}) == 1, "mixed Grouped tick"
    return where


def check_interleaved_rules(table: ScheduleTable) -> None:
    """Backward first, at most p - s in flight, and no IPU idles while it has allowed work."""
    p, m = table.num_stages, table.num_micro_batches
    where = op_ticks(table)
    in_flight = [0] * p
    for t, tick in enumerate(table.ticks):
        for s in range(p):
            index = table.device_mapping[s]
            # Ready: not run yet, its predecessor ran in an earlier tick.
            ready_b = [
                k
                for k in range(m)
                if where[Op(s, k, "B")] >= t
                and (where[Op(s + 1, k, "B")] if s < p - 1 else where[Op(s, k, "F")]) < t
            ]
            ready_f = [
                k
                for k in range(m)
                if where[Op(s, k, "F")] >= t and (s == 0 or where[Op(s - 1, k, "F")] < t)
            ]
            op = tick[index]
            if ready_b:
                assert op == Op(s, min(ready_b), "B"), (t, s, op, ready_b)
            elif ready_f and in_flight[s] < p - s:
                assert op == Op(s, min(ready_f), "F"), (t, s, op, ready_f)
            else:
                assert op is None, (t, s, op)
        for op in tick:
            if op is not None:
                in_flight[op.stage] += 1 if op.phase == "F" else -1
        assert all(0 <= n <= p - s for s, n in enumerate(in_flight))


def grid(table: ScheduleTable) -> list[str]:
    """The table's rows, without the title line."""
    return table.to_text().splitlines()[1:]


# --- The rules hold for every schedule -------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_every_table_obeys_the_dependency_rules(schedule, training, p, m):
    table = build_schedule(schedule, p, m, training=training)
    check_table(table)
    assert (table.num_stages, table.num_micro_batches, table.training) == (p, m, training)
    assert table.device_mapping == tuple(range(p))
    assert table.num_ipus == p
    if schedule is INTERLEAVED and training:
        check_interleaved_rules(table)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_grouped_runs_stage_s_on_micro_batch_step_minus_s(training, p, m):
    # The definition: in step j, F(s, j - s) then B(s, j - (2p - 2 - s)); empty ticks dropped.
    expected = []
    for j in range(m + 2 * p - 2):
        forward = tuple(Op(s, j - s, "F") if 0 <= j - s < m else None for s in range(p))
        backward = tuple(
            Op(s, j - (2 * p - 2 - s), "B") if 0 <= j - (2 * p - 2 - s) < m else None
            for s in range(p)
        )
        for tick in (forward, backward) if training else (forward,):
            if any(tick):
                expected.append(tick)
    table = build_schedule(GROUPED, p, m, training=training)
    assert table.ticks == tuple(expected)
    assert table.num_ticks == (2 if training else 1) * (m + p - 1)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 4])
def test_sequential_runs_one_micro_batch_after_another(p, m):
    order = []
    for k in range(m):
        order += [Op(s, k, "F") for s in range(p)] + [Op(s, k, "B") for s in reversed(range(p))]
    table = build_schedule(SEQUENTIAL, p, m)
    assert [next(op for op in tick if op is not None) for tick in table.ticks] == order
    assert table.num_ticks == 2 * p * m
    assert build_schedule(SEQUENTIAL, p, m, training=False).num_ticks == p * m


def test_inference_is_the_same_for_grouped_and_interleaved():
    for p, m in [(2, 4), (4, 16), (3, 1)]:
        grouped = build_schedule(GROUPED, p, m, training=False)
        interleaved = build_schedule(INTERLEAVED, p, m, training=False)
        assert interleaved.ticks == grouped.ticks
        assert interleaved.stash_counts() == (0,) * p


# --- Several stages on one IPU ---------------------------------------------------------------


@pytest.mark.parametrize("schedule", [GROUPED, SEQUENTIAL], ids=lambda s: s.name)
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_shared_ipus_follow_the_rules_per_ipu(schedule, training, m):
    table = build_schedule(schedule, 4, m, device_mapping=[0, 1, 1, 0], training=training)
    check_table(table)
    assert table.num_ipus == 2
    assert sorted(table.ops_of(0) + table.ops_of(1)) == sorted(op_ticks(table))
    assert {op.stage for op in table.ops_of(0)} == {0, 3}
    assert {op.stage for op in table.ops_of(1)} == {1, 2}


@pytest.mark.parametrize("m", [4, 8, 16])
def test_interleaved_training_on_shared_ipus(m):
    # The reference refused this; here the interleaved rules apply per IPU.
    table = build_schedule(INTERLEAVED, 4, m, device_mapping=[0, 1, 1, 0])
    check_table(table)  # dependencies, one op per IPU per tick, every op once
    stash = table.stash_counts()
    assert all(count <= 4 - s for s, count in enumerate(stash))  # the in-flight cap


def test_sequential_on_shared_ipus_uses_one_of_num_ipus():
    table = build_schedule(SEQUENTIAL, 4, 4, device_mapping=[0, 1, 1, 0])
    assert table.utilisation(1.0) == pytest.approx(1 / 2)
    assert table.num_ticks == 2 * 4 * 4


def test_an_ipu_without_stages_idles():
    table = build_schedule(GROUPED, 2, 4, device_mapping=[0, 2])
    check_table(table)
    assert table.num_ipus == 3
    assert table.ops_of(1) == ()
    assert table.stage_busy_cycles(1.0)[1] == 0.0


# --- Exact small tables ----------------------------------------------------------------------


def test_grouped_table_for_two_stages_and_four_micro_batches():
    table = build_schedule(GROUPED, 2, 4)
    assert grid(table) == [
        "IPU0 | F0.0 F0.1 .    F0.2 B0.0 F0.3 B0.1 .    B0.2 B0.3",
        "IPU1 | .    F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 .",
    ]
    assert table.num_ticks == 2 * (4 + 2 - 1)
    assert str(table) == table.to_text()
    assert table.to_text().splitlines()[0] == (
        "Grouped training: 2 stages on 2 IPUs, 4 micro-batches, 10 ticks"
    )


def test_interleaved_table_for_two_stages_and_four_micro_batches():
    table = build_schedule(INTERLEAVED, 2, 4)
    assert grid(table) == [
        "IPU0 | F0.0 F0.1 .    B0.0 F0.2 B0.1 F0.3 B0.2 .    B0.3",
        "IPU1 | .    F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 .",
    ]
    assert table.num_ticks == 2 * (4 + 2 - 1)
    assert table.ops_of(0)[:3] == (Op(0, 0, "F"), Op(0, 1, "F"), Op(0, 0, "B"))


def test_sequential_table_for_two_stages_and_four_micro_batches():
    table = build_schedule(SEQUENTIAL, 2, 4)
    assert grid(table) == [
        "IPU0 | F0.0 .    .    B0.0 F0.1 .    .    B0.1 F0.2 .    .    B0.2 F0.3 .    .    B0.3",
        "IPU1 | .    F1.0 B1.0 .    .    F1.1 B1.1 .    .    F1.2 B1.2 .    .    F1.3 B1.3 .",
    ]
    assert table.num_ticks == 2 * 2 * 4


def test_inference_table_for_two_stages():
    table = build_schedule(GROUPED, 2, 3, training=False)
    assert grid(table) == [
        "IPU0 | F0.0 F0.1 F0.2 .",
        "IPU1 | .    F1.0 F1.1 F1.2",
    ]


# --- Utilisation -----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 16])
@pytest.mark.parametrize("costs", [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)], ids=str)
def test_table_utilisation_matches_the_closed_form(schedule, p, m, costs):
    forward, backward = costs
    table = build_schedule(schedule, p, m)
    expected = closed_form_utilisation(schedule, p, m, forward, backward)
    # The formulas are exact for equal stages; the brief's bound was 2%.
    assert table.utilisation(forward, backward) == pytest.approx(expected, rel=1e-9)
    assert table.utilisation([forward] * p, [backward] * p) == pytest.approx(expected, rel=1e-9)
    inference = build_schedule(schedule, p, m, training=False)
    assert inference.utilisation(forward) == pytest.approx(
        closed_form_utilisation(schedule, p, m, forward, training=False), rel=1e-9
    )


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_closed_forms_hold_for_few_micro_batches_too(p, m):
    for schedule in SCHEDULES:
        for forward, backward in [(1.0, 2.0), (1.0, 1.0), (3.0, 1.0)]:
            table = build_schedule(schedule, p, m)
            assert table.utilisation(forward, backward) == pytest.approx(
                closed_form_utilisation(schedule, p, m, forward, backward), rel=1e-9
            )


def test_closed_form_values():
    assert closed_form_utilisation(GROUPED, 4, 16) == pytest.approx(16 / 19)
    assert closed_form_utilisation(GROUPED, 4, 16, 1.0, 1.0) == pytest.approx(16 / 19)
    assert closed_form_utilisation(INTERLEAVED, 4, 16, 1.0, 1.0) == pytest.approx(16 / 19)
    assert closed_form_utilisation(INTERLEAVED, 4, 16, 1.0, 2.0) == pytest.approx(48 / 72)
    assert closed_form_utilisation(INTERLEAVED, 2, 4) == pytest.approx(2 / 3)
    assert closed_form_utilisation(SEQUENTIAL, 4, 16) == pytest.approx(1 / 4)
    assert closed_form_utilisation(INTERLEAVED, 4, 16, training=False) == pytest.approx(16 / 19)
    assert closed_form_utilisation(GROUPED, 1, 5) == 1.0
    # backward defaults to twice the forward.
    assert closed_form_utilisation(INTERLEAVED, 4, 16, 3.0) == pytest.approx(48 / 72)


def test_grouped_is_faster_than_interleaved_when_backward_costs_more():
    grouped = build_schedule(GROUPED, 4, 16)
    interleaved = build_schedule(INTERLEAVED, 4, 16)
    assert grouped.total_cycles(1.0, 2.0) == 19 * 3  # (m + p - 1)(f + b)
    assert interleaved.total_cycles(1.0, 2.0) == 4 * 1 + 5 * 2 + 29 * 2
    assert grouped.utilisation(1.0, 2.0) > interleaved.utilisation(1.0, 2.0) + 0.15
    assert grouped.utilisation(1.0, 1.0) == pytest.approx(interleaved.utilisation(1.0, 1.0))


def test_utilisation_grows_with_micro_batches():
    ms = (4, 16, 64, 256)
    for schedule, costs in [
        (GROUPED, (1.0, 2.0)),
        (GROUPED, (1.0, 1.0)),
        (INTERLEAVED, (1.0, 1.0)),
    ]:
        values = [build_schedule(schedule, 4, m).utilisation(*costs) for m in ms]
        assert all(a < b for a, b in zip(values, values[1:])), (schedule, values)
        assert values[-1] > 0.95
    # With b = 2f the mixed ticks of Interleaved wait for the backward: the limit is 3/4.
    values = [build_schedule(INTERLEAVED, 4, m).utilisation(1.0, 2.0) for m in ms]
    assert all(a < b for a, b in zip(values, values[1:]))
    assert 0.74 < values[-1] < 0.75
    for m in ms:
        assert build_schedule(SEQUENTIAL, 4, m).utilisation(1.0, 2.0) == pytest.approx(1 / 4)


def test_unequal_stage_costs():
    table = build_schedule(GROUPED, 2, 4)
    forward, backward = [1.0, 3.0], [2.0, 6.0]
    assert table.tick_cycles(forward, backward) == (1, 3, 6, 3, 6, 3, 6, 3, 6, 2)
    assert table.total_cycles(forward, backward) == 39
    assert table.stage_busy_cycles(forward, backward) == (12, 36)
    assert table.utilisation(forward, backward) == pytest.approx(48 / 78)
    # Backward defaults to twice the forward.
    assert table.utilisation(forward) == pytest.approx(48 / 78)


def test_cost_validation():
    table = build_schedule(GROUPED, 2, 4)
    with pytest.raises(ValueError, match=r"forward_cycles must be one number or one per stage"):
        table.utilisation([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"backward_cycles must be non-negative"):
        table.total_cycles(1.0, [-1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        closed_form_utilisation(GROUPED, 2, 4, forward=0.0)
    assert table.utilisation(0.0) == 0.0


# --- Stashed activations ---------------------------------------------------------------------


def test_interleaved_stashes_fewer_activations_than_grouped():
    grouped = build_schedule(GROUPED, 4, 16).stash_counts()
    interleaved = build_schedule(INTERLEAVED, 4, 16).stash_counts()
    assert grouped == (7, 5, 3, 1)  # 2(p - 1 - s) + 1
    assert interleaved == (4, 3, 2, 1)  # p - s
    assert interleaved[0] < grouped[0]
    assert build_schedule(SEQUENTIAL, 4, 16).stash_counts() == (1, 1, 1, 1)
    assert build_schedule(GROUPED, 4, 16, training=False).stash_counts() == (0, 0, 0, 0)


def test_stash_counts_are_capped_by_the_micro_batches():
    assert build_schedule(GROUPED, 4, 2).stash_counts() == (2, 2, 2, 1)
    assert build_schedule(INTERLEAVED, 4, 2).stash_counts() == (2, 2, 2, 1)
    assert build_schedule(INTERLEAVED, 4, 3).stash_counts() == (3, 3, 2, 1)


# --- Minimum micro-batches, validation, enums and public names -------------------------------


def test_minimum_micro_batches():
    assert minimum_micro_batches(GROUPED, 4) == 4
    assert minimum_micro_batches(INTERLEAVED, 3) == 3
    assert minimum_micro_batches(SEQUENTIAL, 4) == 1
    assert minimum_micro_batches("Interleaved", 2) == 2
    with pytest.raises(ValueError, match="num_stages"):
        minimum_micro_batches(GROUPED, 0)


def test_validation_errors():
    with pytest.raises(
        ValueError, match=r"Each stage must be mapped to an IPU: 3 mappings != 4 stages"
    ):
        build_schedule(GROUPED, 4, 8, device_mapping=[0, 1, 2])
    with pytest.raises(ValueError, match=r"non-negative int.*\[-1\] in \[0, -1\]"):
        build_schedule(GROUPED, 2, 8, device_mapping=[0, -1])
    with pytest.raises(ValueError, match=r"num_stages must be an int >= 1, got -2"):
        build_schedule(GROUPED, -2, 8)
    with pytest.raises(ValueError, match=r"num_micro_batches must be an int >= 1, got 0"):
        build_schedule(GROUPED, 2, 0)
    with pytest.raises(ValueError, match=r"num_micro_batches must be an int >= 1, got 2.5"):
        build_schedule(GROUPED, 2, 2.5)
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule 5.*PipelineSchedule.Grouped"):
        build_schedule(5, 2, 4)
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule 'OneFOneB'"):
        build_schedule("OneFOneB", 2, 4)
    with pytest.raises(ValueError, match="IPU 2 is not in this pipeline"):
        build_schedule(GROUPED, 2, 4).ops_of(2)


def test_schedule_values_and_names_select_the_member():
    assert build_schedule(1, 2, 4).schedule is INTERLEAVED
    assert build_schedule("Sequential", 2, 4).schedule is SEQUENTIAL
    assert build_schedule(GROUPED, 1, 3).num_ticks == 6  # one stage: F, B per micro-batch


def test_enum_values():
    assert [(s.name, s.value) for s in PipelineSchedule] == [
        ("Grouped", 0),
        ("Interleaved", 1),
        ("Sequential", 2),
    ]
    assert [(r.name, r.value) for r in RecomputationMode] == [
        ("Auto", 0),
        ("RecomputeThenBackpropagate", 1),
        ("RecomputeAndBackpropagateInterleaved", 2),
    ]


def test_public_names():
    for module in (ipu.pipelining_ops, ipu.ops.pipelining_ops):
        assert module.PipelineSchedule is PipelineSchedule
        assert module.RecomputationMode is RecomputationMode
        assert module.PipelineStageOptions is ipu.pipelining_ops.PipelineStageOptions
    assert ipu.ops.pipelining_ops.PipelineSchedule.Interleaved.value == 1
    assert "pipelining_ops" in dir(ipu.ops)


def test_pipeline_stage_options():
    options = ipu.pipelining_ops.PipelineStageOptions(
        convolution_options={"availableMemoryProportion": 0.3}
    )
    assert options.convolution_options == {"availableMemoryProportion": 0.3}
    assert options.matmul_options == {}
    assert options.get_proto()["convolution_options"] == {"availableMemoryProportion": "0.3"}
    assert options == ipu.pipelining_ops.PipelineStageOptions({"availableMemoryProportion": "0.3"})
    with pytest.raises(TypeError, match=r"matmul_options must be a dict.*got list"):
        ipu.pipelining_ops.PipelineStageOptions(matmul_options=["partialsType"])


def test_device_schedules_import_neither_keras_nor_jax():
    code = (
        "import sys, keras_ipu.device.schedules; "
        "assert 'keras' not in sys.modules and 'jax' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith(('keras', 'jax')))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ipu.__path__[0] + "/..")


@pytest.mark.parametrize("schedule", list(PipelineSchedule), ids=lambda s: s.name)
@pytest.mark.parametrize("stages, micro_batches, mapping", [
    (2, 4, None), (2, 16, None), (4, 8, None), (4, 8, (0, 1, 1, 0)),
])
def test_exchange_blocks_never_hold_a_message_and_its_consumer(schedule, stages,
                                                               micro_batches, mapping):
    table = build_schedule(schedule, stages, micro_batches, mapping)
    blocks = table.exchange_blocks(2)
    assert all(len(block) == 2 for block in blocks)
    assert [t for block in blocks for t in block if t is not None] == list(range(table.num_ticks))
    for block in blocks:
        ops = {op for t in block if t is not None for op in table.ticks[t] if op is not None}
        for op in ops:
            source = op.stage - 1 if op.phase == "F" else op.stage + 1
            assert Op(source, op.micro_batch, op.phase) not in ops, (op, block)
    assert table.exchange_blocks(1) == tuple((t,) for t in range(table.num_ticks))


def test_two_stages_exchange_half_as_often():
    table = build_schedule(PipelineSchedule.Grouped, 2, 16)
    assert table.num_ticks == 34 and len(table.exchange_blocks(2)) == 18
