"""set_pipelining_options: the reference's validation, defaults and saving."""

from __future__ import annotations

import keras
import pytest

import keras_ipu as ipu
from keras_ipu.keras import options

from models import sequential

Schedule = ipu.pipelining_ops.PipelineSchedule
StageOptions = ipu.pipelining_ops.PipelineStageOptions


def _model(strategy):
    with strategy.scope():
        return sequential()


def test_public_names():
    assert ipu.ops.pipelining_ops.PipelineSchedule is Schedule
    assert [s.name for s in Schedule] == ["Grouped", "Interleaved", "Sequential"]
    assert ipu.pipelining_ops.RecomputationMode.Auto.value == 0


def test_setter_stores_and_keeps(strategy):
    model = _model(strategy)
    model.set_pipelining_options(
        gradient_accumulation_steps_per_replica=8, device_mapping=[0, 1, 1, 0],
        accumulate_outfeed=True, gradient_accumulation_reduction_method="mean",
        pipeline_schedule=Schedule.Interleaved,
        recomputation_mode=ipu.pipelining_ops.RecomputationMode.RecomputeThenBackpropagate,
        offload_weight_update_variables=False,
    )
    model.set_pipelining_options()  # None keeps; method and kwargs are replaced
    current = options.options_of(model)
    assert current.pipelining_gradient_accumulation_steps_per_replica == 8
    assert current.pipelining_device_mapping == (0, 1, 1, 0)
    assert current.pipelining_accumulate_outfeed is True
    assert current.gradient_accumulation_reduction_method.name == "SUM"
    assert current.pipelining_kwargs == {}


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"gradient_accumulation_steps_per_replica": 0}, ValueError, "positive integer"),
        ({"device_mapping": [0, "1"]}, ValueError, "`device_mapping` to be a list"),
        ({"device_mapping": 1}, ValueError, "`device_mapping` to be a list"),
        ({"accumulate_outfeed": 1}, TypeError, "`accumulate_outfeed` must be a bool"),
        ({"gradient_accumulation_reduction_method": "max"}, ValueError, "Cannot parse 'max'"),
        ({"gradient_accumulation_count": 4}, ValueError,
         "Set the `gradient_accumulation_steps_per_replica` argument"),
        ({"repeat_count": 2}, ValueError, "automatically set by Keras"),
        ({"outfeed_mask": [True]}, ValueError, "not compatible with Keras"),
        ({"experimental_normalize_gradients": True}, ValueError, "has now been removed"),
        ({"pipeline_schedul": Schedule.Grouped}, ValueError, r"Unknown `pipelining_kwargs`"),
        ({"pipeline_schedule": "Grouped"}, ValueError, r"Invalid `pipeline_schedule`"),
        ({"continuous_weight_updates": True}, NotImplementedError, "not implemented"),
        # Each recomputation mode supports two of the three schedules.
        ({"pipeline_schedule": Schedule.Sequential,
          "recomputation_mode": ipu.pipelining_ops.RecomputationMode.RecomputeThenBackpropagate},
         ValueError, r"RecomputeThenBackpropagate is supported by the PipelineSchedule.Grouped "
                     r"and PipelineSchedule.Interleaved pipeline schedules, not "
                     r"PipelineSchedule.Sequential"),
        ({"pipeline_schedule": Schedule.Interleaved, "recomputation_mode":
          ipu.pipelining_ops.RecomputationMode.RecomputeAndBackpropagateInterleaved},
         ValueError, r"not PipelineSchedule.Interleaved"),
        # The Poplar options have no effect, but are checked as the reference checks them.
        ({"forward_propagation_stages_poplar_options": "abc"}, TypeError,
         "forward_propagation_stages_poplar_options must be a list or a tuple of "
         "PipelineStageOptions objects"),
        ({"backward_propagation_stages_poplar_options": [StageOptions(), {"a": 1}]}, TypeError,
         "Expected all elements of backward_propagation_stages_poplar_options to be of type "
         "PipelineStageOptions"),
        ({"weight_update_poplar_options": [StageOptions()]}, TypeError,
         "weight_update_poplar_options to be of type PipelineStageOptions"),
        ({"accumulate_outfeed_dtype": "no-such-dtype"}, TypeError,
         "Invalid `accumulate_outfeed_dtype`"),
    ],
)
def test_validation_errors_change_nothing(kwargs, error, message, strategy):
    model = _model(strategy)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 pipeline_schedule=Schedule.Sequential)
    before = options.options_of(model)
    with pytest.raises(error, match=message):
        model.set_pipelining_options(**kwargs)
    assert options.options_of(model) == before


def test_kwargs_must_be_a_mapping():
    with pytest.raises(TypeError, match="must be a dictionary"):
        options.pipelining_options(options.IPUOptions(), None, None, None, "sum", [1])


def test_saved_without_kwargs(strategy, tmp_path):
    with strategy.scope():
        model = sequential()
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                     device_mapping=[1, 0], accumulate_outfeed=False,
                                     pipeline_schedule=Schedule.Interleaved)
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    restored = options.options_of(loaded)
    assert restored.pipelining_gradient_accumulation_steps_per_replica == 4
    assert restored.pipelining_device_mapping == (1, 0)
    assert restored.pipelining_accumulate_outfeed is False
    assert restored.pipelining_kwargs == {}


def test_numpy_integers_are_taken_and_saved_as_numbers(strategy, tmp_path):
    import numpy as np

    two = np.int64(2)
    with strategy.scope():
        model = sequential()
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=two)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=two,
                                     device_mapping=tuple(np.arange(2)))
        model.set_infeed_queue_options(prefetch_depth=two)
        model.set_outfeed_queue_options(buffer_depth=np.int32(3))
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    restored = options.options_of(loaded)
    assert restored.gradient_accumulation_steps == 2
    assert restored.pipelining_gradient_accumulation_steps_per_replica == 2
    assert restored.pipelining_device_mapping == (0, 1)
    assert restored.infeed_kwargs == {"prefetch_depth": 2}
    assert restored.outfeed_kwargs == {"buffer_depth": 3}
    assert type(options.options_of(model).pipelining_device_mapping[0]) is int


def test_a_mapping_to_an_ipu_the_device_lacks_is_named():
    import numpy as np

    from conftest import configure

    configure(4)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
        model.set_pipeline_stage_assignment([0, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4, device_mapping=[0, 5])
    x = np.zeros((16, 6), "float32")
    with pytest.raises(ValueError, match=r"`device_mapping` \[0, 5\] maps a stage to IPU 5, but "
                                         r"the model's device has 4 IPUs: map the stages to "
                                         r"IPUs 0 to 3\."):
        model.fit(x, np.zeros((16, 3), "float32"), batch_size=4, verbose=0)


def test_the_references_none_defaults_and_numpy_dtypes_are_taken(strategy):
    import jax.numpy as jnp
    import numpy as np

    with strategy.scope():
        model = sequential()
    model.set_pipelining_options(pipeline_schedule=None, recomputation_mode=None,
                                 gradient_accumulation_dtype=None)
    kept = options.options_of(model).pipelining_kwargs
    assert "recomputation_mode" not in kept and "pipeline_schedule" not in kept  # defaults
    model.set_pipelining_options(gradient_accumulation_dtype=np.float16)
    assert options.options_of(model).pipelined_accumulator_dtype == "float16"
    for dtype, name in ((None, None), (np.float16, "float16"), (jnp.bfloat16, "bfloat16"),
                        (np.dtype("float16"), "float16")):
        model.set_gradient_accumulation_options(4, dtype=dtype)
        assert options.options_of(model).accumulator_dtype == name
    with pytest.raises(ValueError, match=r"one of \['float32', 'float16', 'bfloat16'\], got "
                                         r"'no-such-dtype'"):
        model.set_pipelining_options(gradient_accumulation_dtype="no-such-dtype")
    with pytest.raises(ValueError, match="one of RecomputationMode.Auto, "):
        model.set_pipelining_options(recomputation_mode="Auto")
    assert options.options_of(model).pipelined_accumulator_dtype == "float16"  # kept
    for dtype in (None, "float16", np.float32, jnp.bfloat16, lambda tensor: np.float32):
        model.set_pipelining_options(accumulate_outfeed_dtype=dtype)  # as the reference reads it
    # One value spelt two ways is one option (set again mid-fit, it does not stop the run).
    stage = ipu.pipelining_ops.PipelineStageOptions()
    spelt = [dict(accumulate_outfeed_dtype=dtype, forward_propagation_stages_poplar_options=s)
             for dtype, s in ((np.float16, [stage]), ("float16", (stage,)))]
    kept = []
    for kwargs in spelt:
        model.set_pipelining_options(**kwargs)
        kept.append(options.options_of(model))
    assert kept[0] == kept[1]


def test_a_pipelines_accumulator_dtype_is_its_own_option(strategy):
    import numpy as np

    from conftest import configure

    configure(2)
    results = {}
    for dtype in ("float32", "bfloat16"):
        model, x = _two_stages_accumulating_in(dtype, strategy)
        model.fit(x, x[:, :2], batch_size=2, shuffle=False, verbose=0)
        results[dtype] = model.get_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(results["float32"], results["bfloat16"]))
    for a, b in zip(results["float32"], results["bfloat16"]):
        np.testing.assert_allclose(a, b, atol=5e-2)


def test_a_pipeline_takes_an_accumulator_dtype_per_variable_dtype(strategy):
    # An IPU accumulates each variable dtype's gradients in one vector: a function that
    # gives all of one dtype's variables the same type works; one that splits them raises
    # when the run is prepared, before any weight changes.

    from conftest import assert_weights_close, configure

    configure(2)
    results = {}
    for name, dtype in (("bfloat16", "bfloat16"), ("function", lambda v: "bfloat16")):
        model, x = _two_stages_accumulating_in(dtype, strategy)
        model.fit(x, x[:, :2], batch_size=2, shuffle=False, verbose=0)
        results[name] = model.get_weights()
    assert_weights_close(results["bfloat16"], results["function"], atol=0)
    model, x = _two_stages_accumulating_in(
        lambda v: "float16" if "bias" in v.path else "float32", strategy)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"accumulates the gradients of all its "
                                         r"float32 variables in one dtype; .* gives "
                                         r"float32 for some and float16 for "
                                         r"'[a-z_0-9/]*/bias'"):
        model.fit(x, x[:, :2], batch_size=2, shuffle=False, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)


def _two_stages_accumulating_in(dtype, strategy):
    """A seeded 2-stage Dense pipeline (GA 4) accumulating in `dtype`, and its data."""
    import numpy as np

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(2)])
    model.set_pipeline_stage_assignment([0, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 gradient_accumulation_dtype=dtype)
    model.compile("sgd", "mse", steps_per_execution=4)
    return model, np.random.default_rng(0).normal(size=(16, 4)).astype("float32")


def test_per_stage_poplar_options_give_one_entry_per_stage(strategy):
    """Checked when a run is prepared, before any weight changes; the backward
    stages' options only when training, as in the reference's `pipeline`."""
    import numpy as np

    from conftest import configure

    configure(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(2)])
    model.set_pipeline_stage_assignment([0, 1])
    model.compile("sgd", "mse", steps_per_execution=4)
    x, y = np.ones((16, 4), "float32"), np.ones((16, 2), "float32")
    before = model.get_weights()
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 forward_propagation_stages_poplar_options=[StageOptions()])
    for run in (lambda: model.fit(x, y, batch_size=2, verbose=0),
                lambda: model.predict(x, batch_size=2, verbose=0)):
        with pytest.raises(ValueError, match=r"forward_propagation_stages_poplar_options must "
                                             r"be a list or a tuple of PipelineStageOptions "
                                             r"objects of length 2 \(same number as the number "
                                             r"of computational stages\) but is 1\."):
            run()
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    model.set_pipelining_options(
        gradient_accumulation_steps_per_replica=4,
        forward_propagation_stages_poplar_options=(StageOptions(), StageOptions()),
        backward_propagation_stages_poplar_options=[StageOptions()] * 3,
        weight_update_poplar_options=StageOptions())
    model.predict(x, batch_size=2, verbose=0)  # inference has no backward stages
    with pytest.raises(ValueError, match="backward_propagation_stages_poplar_options must be "
                                         "a list or a tuple of PipelineStageOptions objects of "
                                         "length 2"):
        model.fit(x, y, batch_size=2, verbose=0)
    model.set_pipelining_options(
        gradient_accumulation_steps_per_replica=4,
        forward_propagation_stages_poplar_options=[StageOptions()] * 2,
        backward_propagation_stages_poplar_options=[StageOptions(matmul_options={"a": "1"})] * 2)
    model.fit(x, y, batch_size=2, verbose=0)


def test_get_config_says_the_pipelining_kwargs_are_not_kept(strategy, caplog):
    # The reference's info message: they must be set again on a restored model.
    import logging

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2),
                                  keras.layers.Dense(1)])
        model.set_pipeline_stage_assignment([0, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    with caplog.at_level(logging.INFO, logger="keras_ipu"):
        model.get_config()
    assert "cannot be serialized" not in caplog.text
    model.set_pipelining_options(
        gradient_accumulation_steps_per_replica=4,
        pipeline_schedule=ipu.pipelining_ops.PipelineSchedule.Interleaved)
    with caplog.at_level(logging.INFO, logger="keras_ipu"):
        model.get_config()
    assert (f"Calling get_config() on {model.name} - `pipelining_kwargs` cannot be serialized"
            in caplog.text)
