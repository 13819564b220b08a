"""The device model: per-IPU memory, out-of-memory errors, cycles, the report."""

from __future__ import annotations

import json
import pickle

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import hardware

from conftest import assert_weights_close, configure


def _wide_model(units: int = 512):
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(4),
        ]
    )


def _data(samples=64):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(samples, 64)).astype("float32"),
        rng.normal(size=(samples, 4)).astype("float32"),
    )


def test_hardware_descriptions():
    mk2 = hardware.hardware_for("ipu2")
    assert (mk2.tiles, mk2.bytes_per_tile) == (1472, 624 * 1024)
    assert mk2.memory_capacity_bytes == 1472 * 624 * 1024
    assert mk2.clock_hz == pytest.approx(1.33e9)
    assert hardware.hardware_for("ipu21").clock_hz == pytest.approx(1.85e9)
    assert hardware.hardware_for("ipu2", tiles_per_ipu=8).memory_capacity_bytes == 8 * 624 * 1024
    with pytest.raises(ValueError, match=r"Unknown IPU version 'ipu9'.*'ipu2'"):
        hardware.hardware_for("ipu9")


def test_io_tiles_leave_the_program_the_other_tiles(strategy):
    mk2 = hardware.hardware_for("ipu2", io_tiles=128)
    assert (mk2.tiles, mk2.compute_tiles) == (1472, 1344)
    assert mk2.memory_capacity_bytes == 1344 * 624 * 1024
    assert mk2.flops_per_cycle() == 1344 * 32
    with pytest.raises(ValueError, match=r"between 0 and 7 on an IPU of 8 tiles, got 8"):
        hardware.hardware_for("ipu2", tiles_per_ipu=8, io_tiles=8)

    def fit_report(io_tiles):
        config = ipu.config.IPUConfig()
        config.auto_select_ipus = 1
        config.ipu_model.tiles_per_ipu = 10
        config.io_tiles.num_io_tiles = io_tiles
        config.configure_ipu_system()
        with strategy.scope():
            model = _wide_model()
            model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
        x, y = _data()
        model.fit(x, y, batch_size=16, verbose=0)
        return ipu.utils.execution_report(model, "fit").ipus[0]

    # The wide model's fit needs about 4.8 MB: it fits 10 tiles (6.2 MiB), and 9, not 6.
    ten = fit_report(0)
    assert ten.memory_capacity_bytes == 10 * 624 * 1024
    with pytest.raises(ipu.errors.IPUOutOfMemoryError) as info:
        fit_report(4)
    assert info.value.capacity_bytes == 6 * 624 * 1024
    one_for_io = fit_report(np.int64(1))  # 9 tiles compute: fewer flops and bytes per cycle
    assert one_for_io.memory_capacity_bytes == 9 * 624 * 1024
    assert one_for_io.estimated_cycles > ten.estimated_cycles
    # An impossible count raises when configuring, and the configuration stays as it was.
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.ipu_model.tiles_per_ipu = 4
    config.io_tiles.num_io_tiles = 4
    with pytest.raises(ValueError, match=r"io_tiles.num_io_tiles must leave tiles"):
        config.configure_ipu_system()
    assert ipu.config.get_ipu_config().io_tiles.num_io_tiles == 1


@pytest.mark.parametrize("program, remedy", [
    ("fit", "pipeline the model over more IPUs"),
    ("train_on_batch", "run the model with `fit`, which can pipeline it"),
    ("strategy.run", "split the work between programs"),
])
def test_out_of_memory_suggests_what_frees_memory_for_the_program_it_is(program, remedy):
    # The batch methods and graph-style programs were told to pipeline themselves.
    message = str(ipu.errors.IPUOutOfMemoryError(0, 2_000, 1_000, program))
    assert remedy in message and message.endswith("use a smaller batch size.") == (
        program != "fit")
    assert ("set_pipelining_options" in message) == (program == "fit")


def test_out_of_memory_raises_before_running_and_leaves_the_model_usable(strategy):
    configure(1, tiles_per_ipu=2)
    with strategy.scope():
        model = _wide_model()
        model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
    x, y = _data()
    model.build((None, 64))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ipu.errors.IPUOutOfMemoryError) as info:
        model.fit(x, y, batch_size=16, verbose=0)
    error = info.value
    assert isinstance(error, RuntimeError)
    assert error.ipu == 0 and error.capacity_bytes == 2 * 624 * 1024
    assert error.required_bytes > error.capacity_bytes
    message = str(error)
    assert "IPU 0" in message and f"{error.required_bytes:,}" in message
    ratio = error.required_bytes / error.capacity_bytes  # to the hundredth: 1.03x is not 1.0x
    assert f"({ratio:.2f}x its capacity)" in message
    # Adam's state alone is over 2 tiles: only more IPUs help (and recomputation saves
    # memory only in a pipeline's backward pass).
    assert "pipeline the model" in message and "batch size" not in message
    assert "recomputation" not in message and "state alone is over the capacity" in message
    with pytest.raises(ipu.errors.IPUOutOfMemoryError) as info:
        model.predict(np.ones((4096, 64), "float32"), batch_size=4096, verbose=0)
    assert str(info.value).endswith("or use a smaller batch size.")  # no accumulation
    assert_weights_close(before, model.get_weights(), atol=0)
    assert model.optimizer.iterations.numpy() == 0

    configure(1)  # the default tile count: the same model trains
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    report = ipu.utils.execution_report(model, "fit")
    assert report.ipus[0].memory_bytes == pytest.approx(error.required_bytes, rel=0.05)


def test_report_grows_with_the_model(strategy):
    x, y = _data()
    reports = {}
    for units in (32, 256):
        with strategy.scope():
            model = _wide_model(units)
            model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
        model.fit(x, y, batch_size=16, verbose=0)
        reports[units] = ipu.utils.execution_report(model, mode="fit")
    small, large = reports[32].ipus[0], reports[256].ipus[0]
    assert large.memory_bytes > small.memory_bytes
    assert large.state_bytes > small.state_bytes
    assert large.estimated_cycles > small.estimated_cycles
    assert small.memory_capacity_bytes == 1472 * 624 * 1024
    # Weights, gradients' optimizer slots (Adam: 2) and metric state are state.
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert large.state_bytes >= 3 * 4 * params


def test_report_modes_table_and_dict(strategy):
    with strategy.scope():
        model = _wide_model(16)
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = _data(32)
    with pytest.raises(ValueError, match=r"no compiled 'fit' program"):
        ipu.utils.execution_report(model, mode="fit")
    with pytest.raises(ValueError, match=r"Unknown mode 'train'"):
        ipu.utils.execution_report(model, mode="train")
    model.fit(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=8, verbose=0)
    fit_report = ipu.utils.execution_report(model, mode="fit")
    predict_report = ipu.utils.execution_report(model, mode="predict")
    with pytest.raises(ValueError, match="evaluate"):
        ipu.utils.execution_report(model, mode="evaluate")
    assert fit_report.mode == "fit" and predict_report.mode == "predict"
    assert fit_report.steps_per_execution == 2
    # Training needs gradients and optimizer state that inference does not.
    assert fit_report.ipus[0].memory_bytes > predict_report.ipus[0].memory_bytes
    as_dict = json.loads(json.dumps(fit_report.to_dict()))
    assert as_dict["ipus"][0]["index"] == 0
    assert set(as_dict["ipus"][0]) >= {
        "index", "memory_bytes", "memory_capacity_bytes", "estimated_cycles"
    }
    table = str(fit_report)
    assert "IPU" in table and "est. cycles" in table and f"{fit_report.estimated_cycles:,}" in table


def test_cycles_follow_the_hardware(strategy):
    x, y = _data(32)
    cycles = {}
    for version in ("ipu2", "ipu21"):
        configure(1, version=version)
        with strategy.scope():
            model = _wide_model(64)
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
        model.fit(x, y, batch_size=8, verbose=0)
        report = ipu.utils.execution_report(model, "fit")
        cycles[version] = (report.estimated_cycles, report.estimated_seconds)
    # Same chip, faster clock: same cycles, less time.
    assert cycles["ipu2"][0] == cycles["ipu21"][0]
    assert cycles["ipu21"][1] < cycles["ipu2"][1]


def test_the_balanced_split_is_the_best_contiguous_one():
    from keras_ipu.device import partition

    split = partition.balanced_split([5, 1, 1, 1, 1, 1], [1] * 6, 2)
    assert split.stage_of_layer == (0, 1, 1, 1, 1, 1) and split.stage_costs == (5, 5)
    assert partition.balanced_split([1] * 6, [1] * 6, 3).stage_of_layer == (0, 0, 1, 1, 2, 2)
    # The fewest stages whose memory fits: 2 stages of 30 do not fit 25, 3 of 20 do.
    assert len(partition.fewest_stages([1] * 6, [10] * 6, 25).stage_costs) == 3
    with pytest.raises(ValueError, match="largest stage needs 20 bytes"):
        partition.fewest_stages([1] * 6, [10] * 6, 15, minimum=2, maximum=3)
    # Fewer layers than stages: the count is the reason, not the IPUs' memory.
    with pytest.raises(ValueError, match=r"has 1 layer\(s\): too few for 2 pipeline stages"):
        partition.fewest_stages([1], [10], 1000)
    with pytest.raises(ValueError, match="Cannot split 2 layers into 3"):
        partition.balanced_split([1, 1], [1, 1], 3)


def _fit_report(num_ipus, *, accumulation=1, stages=None):
    """The fit report of a small MLP on `num_ipus` IPUs (pipelined over `stages`)."""
    configure(num_ipus)
    keras.utils.set_random_seed(0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = _wide_model(64)
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    if stages:
        model.set_pipeline_stage_assignment(stages)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=accumulation)
    elif accumulation > 1:
        model.set_gradient_accumulation_options(
            gradient_accumulation_steps_per_replica=accumulation)
    x, y = _data(8 * 4 * num_ipus)
    model.fit(x, y, batch_size=4, verbose=0)
    return model, ipu.utils.execution_report(model, mode="fit")


def _all_reduce(variables, replicas):
    from keras_ipu.device.replicate import all_reduce_cycles

    bytes_ = sum(int(np.prod(v.shape)) * 4 for v in variables)
    return all_reduce_cycles(bytes_, replicas, hardware.hardware_for("ipu2"))


@pytest.mark.parametrize("accumulation", [1, 4])
def test_replicas_sum_their_gradients_once_per_weight_update(accumulation):
    one = _fit_report(1, accumulation=accumulation)[1].ipus[0].estimated_cycles
    model, two = _fit_report(2, accumulation=accumulation)
    updates = 8 // accumulation  # per execution of 8 micro-batches
    expected = updates * _all_reduce(model.trainable_variables, 2)
    assert two.ipus[0].estimated_cycles - one == pytest.approx(expected, abs=2)


def test_a_replicated_pipeline_counts_its_largest_stages_gradient_sum():
    one = _fit_report(2, accumulation=4, stages=[0, 0, 1])[1].ipus[0].estimated_cycles
    model, replicated = _fit_report(4, accumulation=4, stages=[0, 0, 1])
    stage_0 = [v for layer in model.layers[:2] for v in layer.trainable_variables]
    updates = 8 // 4
    expected = updates * _all_reduce(stage_0, 2)  # stage 0 holds the most
    assert replicated.replicas == 2
    assert replicated.ipus[0].estimated_cycles - one == pytest.approx(expected, abs=2)


def test_the_report_stays_the_last_run_programs_after_an_out_of_memory_error(strategy):
    # A program that did not fit is not the model's last: before, the report said
    # "no compiled 'fit' program yet" after an out-of-memory error on a smaller system.
    configure(1)
    with strategy.scope():
        model = _wide_model()
        model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
    x, y = _data()
    model.fit(x, y, batch_size=16, verbose=0)
    ran = ipu.utils.execution_report(model, "fit").ipus[0].memory_bytes
    configure(1, tiles_per_ipu=2)
    for _ in range(2):  # the stale program is not run on the small system either
        with pytest.raises(ipu.errors.IPUOutOfMemoryError):
            model.fit(x, y, batch_size=16, verbose=0)
        assert ipu.utils.execution_report(model, "fit").ipus[0].memory_bytes == ran
    with pytest.raises(TypeError, match="takes a Keras model, got NoneType"):
        ipu.utils.execution_report(None)


def test_a_pipeline_reports_fractions_of_a_cycle_not_zero():
    # Peak-rate estimates of small stages are below one cycle: they printed as "0 fwd / 0 bwd".
    from keras_ipu.device.report import PipelineReport

    report = PipelineReport("Grouped", 2, 4, (0, 1), (0.276, 1234.5), (0.42, 0.0801), 0.5,
                            (2, 1), 6)
    assert ("stage 0 on IPU 0: 0.276 fwd / 0.42 bwd cycles, stash 2, "
            "stage 1 on IPU 1: 1,234 fwd / 0.0801 bwd cycles, stash 1") in str(report)


def test_a_pipeline_out_of_memory_names_the_ipu_that_needs_most(strategy):
    # IPU 0 holds a Dense(64 -> 8) and was named for it, with its smaller need.
    configure(2, tiles_per_ipu=4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8),
                                  keras.layers.Dense(1024, activation="relu"),
                                  keras.layers.Dense(1024), keras.layers.Dense(4)])
        model.compile("adam", "mse", steps_per_execution=8)
        model.set_pipeline_stage_assignment([0, 1, 1, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    x, y = _data(128)
    with pytest.raises(ipu.errors.IPUOutOfMemoryError) as info:
        model.fit(x, y, batch_size=16, verbose=0)
    assert info.value.ipu == 1 and info.value.pipelined
    assert "move layers from this IPU's stages" in str(info.value)
    # Adam's state of 2 x Dense(1024) alone is over 4 tiles: neither recomputation nor a
    # smaller batch would fit it.
    assert str(info.value).endswith("(its state alone is over the capacity).")
    configure(2)
    model.fit(x, y, batch_size=16, verbose=0)
    needs = [i.memory_bytes for i in ipu.utils.execution_report(model, "fit").ipus]
    assert needs[1] > needs[0] and info.value.required_bytes == pytest.approx(needs[1], rel=0.05)


def test_the_on_batch_methods_check_their_program_fits_before_anything_changes(strategy):
    # Keras' own methods run Keras' step on one batch: a program like fit's executions.
    configure(1, tiles_per_ipu=4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(4096)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((128, 64), "float32")  # each of the three needs 5 tiles or more for 128
    y = np.ones((128, 4096), "float32")
    small_x, small_y = x[:4], y[:4]
    model.train_on_batch(small_x, small_y)  # a batch of 4 fits 4 tiles
    kernel = model.layers[0].kernel
    kernel.assign(np.full(kernel.shape, 0.5, "float32"))  # the user's, after that step
    expected = model.get_weights()
    for run, name in ((lambda: model.train_on_batch(x, y), "train_on_batch"),
                      (lambda: model.test_on_batch(x, y), "test_on_batch"),
                      (lambda: model.predict_on_batch(x), "predict_on_batch")):
        with pytest.raises(ipu.errors.IPUOutOfMemoryError, match=f"the {name} program needs"):
            run()
    # Nothing ran, and nothing stale comes back: the assigned kernel is the model's.
    model.jax_state_sync()
    assert_weights_close(expected, model.get_weights(), atol=0)
    np.testing.assert_allclose(model.predict_on_batch(small_x), small_x @ expected[0]
                               + expected[1], rtol=1e-5)


def test_strategy_run_and_compile_check_their_program_fits_before_running(strategy):
    configure(2, tiles_per_ipu=1)  # 624 KiB
    matrix = np.ones((256, 256), np.float32)  # 256 KiB: it, its product and the sum do not fit
    with strategy.scope():
        with pytest.raises(ipu.errors.IPUOutOfMemoryError,
                           match=r"IPU 0: the strategy.run program needs"):
            strategy.run(lambda a: a @ a + 1, args=(matrix,))
        variable = keras.Variable(np.ones(3, np.float32))
        # What fits runs, on every replica.
        np.testing.assert_array_equal(strategy.run(lambda a: a @ a, args=(matrix[:64, :64],)),
                                      np.full((64, 64), 64.0))

    def assigning(a):
        variable.assign(a[0, :3])
        return a @ a + 1

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        with pytest.raises(ipu.errors.IPUOutOfMemoryError,
                           match=r"the ipu_compiler.compile program needs"):
            ipu.ipu_compiler.compile(assigning, inputs=[matrix * 5])
    np.testing.assert_array_equal(variable.numpy(), np.ones(3))  # nothing assigned


def test_the_batch_methods_are_checked_against_the_system_configured_now(strategy):
    # Their programs were kept per model: one checked on a big IPU ran on a small one.
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 256), np.float32), np.ones((8, 1024), np.float32)
    model.train_on_batch(x, y)
    model.predict_on_batch(x)
    configure(1, tiles_per_ipu=1)  # 624 KiB: the kernel alone is 1 MiB
    for run, name in ((lambda: model.train_on_batch(x, y), "train_on_batch"),
                      (lambda: model.predict_on_batch(x), "predict_on_batch")):
        with pytest.raises(ipu.errors.IPUOutOfMemoryError, match=f"the {name} program"):
            run()


def test_out_of_memory_says_what_the_need_is_made_of_and_suggests_only_what_helps():
    parts = (600, 1_300, 100)
    message = str(ipu.errors.IPUOutOfMemoryError(0, 2_000, 1_000, "fit", pipelined=True,
                                                 parts=parts))
    assert ("needs 2,000 bytes (weights, optimizer and metric state 600; temporaries and "
            "code 1,300; one step's inputs and outputs 100)") in message
    assert "enable recomputation" in message and "smaller batch size" in message
    # Recomputation on already: not suggested again.
    message = str(ipu.errors.IPUOutOfMemoryError(0, 2_000, 1_000, "fit", pipelined=True,
                                                 recomputing=True, parts=parts))
    assert "recomputation" not in message and "smaller batch size" in message
    # The state alone over the capacity: a smaller batch would not fit it either.
    message = str(ipu.errors.IPUOutOfMemoryError(0, 2_000, 1_000, "fit", pipelined=True,
                                                 parts=(1_500, 400, 100)))
    assert "batch size" not in message and "recomputation" not in message
    assert message.endswith("(its state alone is over the capacity).")
    error = ipu.errors.IPUOutOfMemoryError(0, 2_000, 1_000, "fit", True, True, parts)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_a_recomputing_pipeline_out_of_memory_is_not_told_to_recompute(strategy):
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 2
    config.ipu_model.tiles_per_ipu = 2
    config.allow_recompute = True
    config.configure_ipu_system()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16),
                                  keras.layers.Dense(512), keras.layers.Dense(512)])
    model.set_pipeline_stage_assignment([0, 1, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile("sgd", "mse", steps_per_execution=4)
    with pytest.raises(ipu.errors.IPUOutOfMemoryError) as info:
        model.fit(np.zeros((64, 16), "float32"), np.zeros((64, 512), "float32"), batch_size=4,
                  verbose=0)
    assert info.value.recomputing and "recomputation" not in str(info.value)
    assert sum(info.value.parts) == info.value.required_bytes
