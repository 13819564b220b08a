"""`keras-ipu convert`: a saved Keras model to an export; manual, loaded and automatic stages."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import fp16_conversion

from conftest import configure, fresh_process_env

BATCH = 4


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "keras_ipu", "convert", *args],
                          env=fresh_process_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory):
    """A 6-block MLP saved as .keras, and inputs with its predictions."""
    configure(1)
    path = tmp_path_factory.mktemp("convert") / "mlp.keras"
    keras.utils.set_random_seed(0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((64,), name="features")
        h = inputs
        for i in range(6):  # the last block is the output
            h = keras.layers.Dense(64, activation="relu" if i < 5 else None,
                                   name=f"block_{i}")(h)
        model = keras.Model(inputs, h)
        model.save(path)
    x = np.random.default_rng(0).normal(size=(4 * BATCH, 64)).astype("float32")
    return path, x, model.predict(x, batch_size=BATCH, verbose=0)


def _run_export(export_dir, x):
    return ipu.serving.load(str(export_dir)).run_many(x.reshape(-1, BATCH, 64)).reshape(len(x), -1)


@pytest.mark.parametrize("priority", ["cycle", "memory"])
def test_auto_balances_the_stages_and_the_export_matches_predict(priority, saved_mlp, tmp_path):
    path, x, expected = saved_mlp
    config = {"converter": "auto", "priority": priority, "min_ipu_quantity": 2,
              "max_ipu_quantity": 4, "solution_dir": str(tmp_path / "solution")}
    result = _cli("--model", str(path), "--dir", str(tmp_path / "export"), "--batch_size",
                  str(BATCH), "--batch_per_step", "4", "--pipeline_cfg", json.dumps(config))
    assert result.returncode == 0, result.stderr
    solution = json.loads((tmp_path / "solution" / "greedy_search.pipeconfig").read_text())
    assert solution["device_mapping"] == [0, 1]
    stages = solution["pipeline_mapping"]
    assert sorted(set(stages.values())) == [0, 1] and stages["block_0"] == 0
    np.testing.assert_allclose(_run_export(tmp_path / "export", x), expected, atol=1e-5)
    metadata = ipu.serving.load(str(tmp_path / "export")).metadata
    assert metadata["device_mapping"] == [0, 1] and metadata["iterations"] == 4
    # The device model's own report of the split pipeline: the stages balance.
    configure(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.models.load_model(path)
    assignments = model.get_pipeline_stage_assignment()
    for assignment in assignments:
        assignment.pipeline_stage = stages[assignment.layer.name]
    model.set_pipeline_stage_assignment(assignments)
    model.compile(steps_per_execution=4)
    model.predict(x, batch_size=BATCH, verbose=0)
    pipeline = ipu.utils.execution_report(model, "predict").pipeline
    measured = (pipeline.stage_forward_cycles if priority == "cycle"
                else solution["stage_memory"])
    assert max(measured) <= 1.25 * min(measured), measured


def test_manual_sharding_and_the_solution_file_round_trip(saved_mlp, tmp_path):
    path, x, expected = saved_mlp
    # As the seed writes it: `convert ipu ...`.
    manual = _cli("ipu", "--model", str(path), "--dir", str(tmp_path / "manual"), "--batch_size",
                  str(BATCH), "--num_ipus", "2", "--manual_sharding", "^block_[0-1]$",
                  "^block_[2-5]$|head")
    assert manual.returncode == 0, manual.stderr
    assert "'block_0': 0" in manual.stdout and "'block_2': 1" in manual.stdout
    np.testing.assert_allclose(_run_export(tmp_path / "manual", x), expected, atol=1e-5)
    solution = tmp_path / "s.pipeconfig"
    stages = {f"block_{i}": int(i >= 4) for i in range(6)}
    solution.write_text(json.dumps({"device_maping": [1, 0],  # the seed's spelling
                                    "pipeline_mapping": stages}))
    loaded = _cli("--model", str(path), "--dir", str(tmp_path / "loaded"), "--batch_size",
                  str(BATCH), "--pipeline_cfg",
                  json.dumps({"converter": "load", "solution_path": str(solution)}))
    assert loaded.returncode == 0, loaded.stderr
    assert ipu.serving.load(str(tmp_path / "loaded")).metadata["device_mapping"] == [1, 0]
    np.testing.assert_allclose(_run_export(tmp_path / "loaded", x), expected, atol=1e-5)


def test_a_config_file_with_comments_fp16_and_ignored_options(saved_mlp, tmp_path):
    path, x, expected = saved_mlp
    config = tmp_path / "config.json"
    config.write_text("""{
        // the seed's format: comments allowed
        "batch_size": 4,
        "precision_mode": "FP16",
        "precision_conversion_excluded_nodes": ["^head$"],
        "matmul_amp": 0.6,  // and at the end of a line, as in the seed's gelu_replacement
        "gelu_replacement": {"nodes": [ // Nodes in GELU function (regular expressions)
            "intermediate/dense/Sqrt$"]},
        "embedded_runtime_save_config": {"embedded_runtime_exec_cachedir": "http://cache//x"}
    }""")
    result = _cli("--model", str(path), "--dir", str(tmp_path / "half"), "--config_file",
                  str(config))
    assert result.returncode == 0, result.stderr
    assert "matmul_amp" in result.stdout and "gelu_replacement" in result.stdout
    assert "'http://cache//x'" in result.stdout  # a string's "//" is no comment
    outputs = _run_export(tmp_path / "half", x)
    np.testing.assert_allclose(outputs, expected, atol=0.05, rtol=0.05)  # float16 blocks
    assert not np.allclose(outputs, expected, atol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--num_ipus", "2", "--manual_sharding", "^block_0$"], "gives 1 regex lists for --num_ipus 2"),
    (["--num_ipus", "2", "--manual_sharding", "^block_", "^nothing$"],
     "no layer name matches the regexes of IPU 1 (['^nothing$'])"),
    (["--pipeline_cfg", '{"converter": "manual", "manual_pipeline_config": [["^block_"], '
      '["^nothing$"]], "device_info": [0, 1]}'], "no layer name matches the regexes of stage 1"),
    (["--precision_mode", "FP8"], "must be FP16 or FP32"),
    (["--pipeline_cfg", "{not json"], "--pipeline_cfg is not JSON"),
    (["--pipeline_cfg", '{"converter": "magic"}'], "must be auto, manual or load"),
    (["--pipeline_cfg", '{"converter": "load", "solution_path": "nope.json"}'],
     "needs an existing `solution_path`"),
    (["--config_file", "missing.json"], "Cannot read --config_file"),
    # Before: "Give --manual_sharding or --pipeline_cfg", when a config file gave one.
    (["--num_ipus", "2", "--manual_sharding", "^block_0", "^block_[1-5]", "--pipeline_cfg",
      '{"converter": "auto"}'], "Give manual_sharding or pipeline_cfg, not both (on the "
                                "command line and in --config_file together)."),
])
def test_bad_options_are_one_line_errors(args, message, saved_mlp, tmp_path):
    path, _, _ = saved_mlp
    result = _cli("--model", str(path), "--dir", str(tmp_path / "e"), *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_convert_started_by_an_instance_of_a_job_runs_as_a_process_of_its_own(
        saved_mlp, tmp_path):
    # Before: it inherited the instance's job variables and joined the job as a member
    # nobody waited for: it hung (also in a SLURM allocation of several tasks).
    from keras_ipu.distributed import launcher

    path, x, expected = saved_mlp
    env = {**fresh_process_env(), "KERAS_IPU_NUM_INSTANCES": "2", "SLURM_NTASKS": "2",
           "KERAS_IPU_INSTANCE_INDEX": "1",
           "KERAS_IPU_COORDINATOR": f"127.0.0.1:{launcher.free_port()}"}
    result = subprocess.run([sys.executable, "-m", "keras_ipu", "convert", "--model", str(path),
                             "--dir", str(tmp_path / "export"), "--batch_size", str(BATCH)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(_run_export(tmp_path / "export", x), expected, atol=1e-5)


def test_an_export_directory_it_cannot_write_is_refused_before_any_work(saved_mlp, tmp_path):
    # Before: "--model mlp.keras: [Errno 17] File exists: 'afile'", and a solution_dir that
    # is the export directory was written, then the export refused the directory.
    path, _, _ = saved_mlp
    (tmp_path / "afile").write_text("")
    result = _cli("--model", str(path), "--dir", str(tmp_path / "afile"))
    assert result.returncode == 2 and "--model" not in result.stderr
    assert "the export directory must be new or empty" in result.stderr
    same = tmp_path / "e"
    result = _cli("--model", str(path), "--dir", str(same), "--pipeline_cfg",
                  json.dumps({"converter": "auto", "solution_dir": str(same)}))
    assert result.returncode == 2 and "not into it" in result.stderr
    assert not same.exists()


@pytest.mark.parametrize("values, message", [
    ({"precision_mode": 16}, "`precision_mode` must be FP16 or FP32 (a string), got 16 (int)."),
    ({"pipeline_cfg": "auto"}, "`pipeline_cfg` must be a JSON object, such as "
                               "{\"converter\": \"auto\"}, got 'auto' (str)."),
    ({"batch_size": "4"}, "`batch_size` must be a positive integer, got '4' (str)."),
    ({"int64_to_int32_conversion": "yes"},
     "`int64_to_int32_conversion` must be true or false, got 'yes' (str)."),
    ({"precision_conversion_excluded_nodes": "^head$"},
     "`precision_conversion_excluded_nodes` must be a list of regular expressions (strings), "
     "got '^head$' (str)."),
    ({"manual_sharding": [["^a"], 3]}, "`manual_sharding` must be a list with a regular "
     "expression (a string), or a list of them, per IPU, got [['^a'], 3] (list)."),
    ({"pipeline_cfg": {"converter": "auto", "max_ipu_quantity": "4"}},
     "pipeline_cfg `max_ipu_quantity` must be a positive integer, got '4' (str)."),
    ({"pipeline_cfg": {"converter": "load", "solution_path": 7}},
     "pipeline_cfg `solution_path` must be a file path (a string), got 7 (int)."),
])
def test_an_option_of_the_wrong_type_is_named_with_its_value(values, message):
    """Before, a configuration file's `"precision_mode": 16` or `"pipeline_cfg": "auto"` failed
    with an AttributeError traceback."""
    from keras_ipu.keras import convert

    with pytest.raises(ValueError) as raised:
        convert.ConvertOptions.from_mapping(values)
    assert str(raised.value) == message


def test_a_config_file_of_the_wrong_type_is_one_line_and_status_2(saved_mlp, tmp_path):
    path, _, _ = saved_mlp
    (tmp_path / "config.json").write_text('{"pipeline_cfg": "auto"}')
    result = _cli("--model", str(path), "--dir", str(tmp_path / "e"), "--config_file",
                  str(tmp_path / "config.json"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == ("error: `pipeline_cfg` must be a JSON object, such as "
                             "{\"converter\": \"auto\"}, got 'auto' (str).\n")


@pytest.mark.parametrize("solution, message", [
    ({"device_mapping": [0, 1, 0], "pipeline_mapping": {f"block_{i}": int(i >= 3)
                                                         for i in range(6)}},
     "`device_mapping` [0, 1, 0] of {path} has 3 entries for 2 pipeline stages"),
    ({"device_mapping": [0, 1], "pipeline_mapping": {**{f"block_{i}": int(i >= 3)
                                                        for i in range(6)}, "zzz": 1}},
     "`pipeline_mapping` of {path} names layers the model does not have: ['zzz']"),
    ({"device_mapping": [0, 1], "pipeline_mapping": {"block_0": 0, "block_5": 1}},
     "gives no stage to the layers ['block_1', 'block_2', 'block_3', 'block_4']"),
    ({"device_mapping": [0, 1], "pipeline_mapping": {f"block_{i}": 2 * int(i >= 3)
                                                     for i in range(6)}},
     "gives no layer to the stages [1] (of stages 0 to 2)"),
    ({"device_mapping": [0, "1"], "pipeline_mapping": {}},
     "must be a list of IPU indices (integers >= 0), one per pipeline stage; got [0, '1']"),
])
def test_a_solution_file_must_stage_every_layer_and_map_every_stage(solution, message,
                                                                    saved_mlp, tmp_path):
    from keras_ipu.keras import convert

    path, _, _ = saved_mlp
    file = tmp_path / "solution.pipeconfig"
    file.write_text(json.dumps(solution))
    options = convert.ConvertOptions(
        batch_size=BATCH, pipeline_cfg={"converter": "load", "solution_path": str(file)})
    with pytest.raises(ValueError) as raised:
        convert.convert(str(path), str(tmp_path / "export"), options)
    assert message.format(path=file) in str(raised.value)
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("stages", [
    {"manual_sharding": [["^inner$"], ["^head$"]]},
    {"pipeline_cfg": {"converter": "auto", "min_ipu_quantity": 2, "max_ipu_quantity": 2}},
], ids=["manual_sharding", "auto"])
def test_a_nested_model_runs_in_its_stage(stages, tmp_path):
    """A nested model is one layer of the chain: all its calls run in its stage.

    (Before, any stage assignment of a model holding a nested model failed with an
    AttributeError: its assignment has no `.layer`.)
    """
    from keras_ipu.keras import convert

    configure(1)
    keras.utils.set_random_seed(0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inner = keras.Sequential([keras.layers.Dense(8, activation="relu", name="in_0"),
                                  keras.layers.Dense(8, name="in_1")], name="inner")
        x = keras.Input((4,), name="x")
        model = keras.Model(x, keras.layers.Dense(2, name="head")(inner(x)))
        model.save(tmp_path / "nested.keras")
    data = np.random.default_rng(0).normal(size=(BATCH, 4)).astype("float32")
    expected = model.predict(data, batch_size=BATCH, verbose=0)
    options = convert.ConvertOptions(batch_size=BATCH, num_ipus=2, **stages)
    summary = convert.convert(str(tmp_path / "nested.keras"), str(tmp_path / "export"), options)
    assert summary["stage_of_layer"] == {"inner": 0, "head": 1}
    runtime = ipu.serving.load(str(tmp_path / "export"))
    assert runtime.metadata["device_mapping"] == [0, 1]
    np.testing.assert_allclose(runtime(data), expected, atol=1e-5)


def test_manual_sharding_keeps_an_unmatched_layer_after_the_ipus_it_takes_from(tmp_path):
    # The reference puts unmatched layers on IPU 0; a residual Add taking IPU 1's output
    # cannot run in stage 0 ("a dependency from a pipeline stage which has not yet been
    # executed"): it joins IPU 1. Unmatched layers taking only IPU 0's stay there.
    from keras_ipu.keras import convert

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        x = keras.Input((4,), name="x")
        h = keras.layers.Dense(8, name="shard0_dense")(x)
        early = keras.layers.ReLU(name="relu")(h)
        residual = keras.layers.Add(name="add")([early, keras.layers.Dense(8, name="shard1")(h)])
        model = keras.Model(x, keras.layers.Dense(2, name="shard1_out")(residual))
        model.save(tmp_path / "residual.keras")
    data = np.random.default_rng(0).normal(size=(BATCH, 4)).astype("float32")
    expected = model.predict(data, batch_size=BATCH, verbose=0)
    options = convert.ConvertOptions(batch_size=BATCH, num_ipus=2,
                                     manual_sharding=[["^shard0"], ["^shard1"]])
    summary = convert.convert(str(tmp_path / "residual.keras"), str(tmp_path / "export"), options)
    assert summary["stage_of_layer"] == {"shard0_dense": 0, "relu": 0, "shard1": 1, "add": 1,
                                         "shard1_out": 1}
    np.testing.assert_allclose(ipu.serving.load(str(tmp_path / "export"))(data), expected,
                               atol=1e-5)


def test_manual_sharding_onto_three_ipus_is_given_a_device_of_four(saved_mlp, tmp_path):
    # IPUs are acquired in powers of two: 3 shards run on a 4-IPU device, the 4th idle.
    # Before, the converter configured 3 IPUs and its pipeline refused them.
    from keras_ipu.keras import convert

    path, x, expected = saved_mlp
    options = convert.ConvertOptions(batch_size=BATCH, num_ipus=3, manual_sharding=[
        ["^block_[0-1]$"], ["^block_[2-3]$"], ["^block_[4-5]$"]])
    summary = convert.convert(str(path), str(tmp_path / "export"), options)
    assert summary["device_mapping"] == [0, 1, 2]
    assert ipu.serving.load(str(tmp_path / "export")).metadata["num_ipus"] == 3
    np.testing.assert_allclose(_run_export(tmp_path / "export", x), expected, atol=1e-5)


def test_auto_costs_layers_called_with_a_mask_or_several_tensors(tmp_path):
    # The auto converter called each layer on its flat inputs: a masked LSTM got its mask
    # as a second input, an attention lost its value. They are called as the model does.
    from keras_ipu.keras import convert

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        tokens = keras.Input((6,), dtype="int32", name="tokens")
        h = keras.layers.Embedding(50, 8, mask_zero=True, name="embed")(tokens)
        h = keras.layers.MultiHeadAttention(2, 4, name="attend")(h, h)
        h = keras.layers.LSTM(5, name="lstm")(h)
        model = keras.Model(tokens, keras.layers.Dense(2, name="head")(h))
        model.save(tmp_path / "masked.keras")
    data = np.random.default_rng(0).integers(0, 50, size=(BATCH, 6)).astype("int32")
    data[:, 4:] = 0  # padding, masked
    expected = model.predict(data, batch_size=BATCH, verbose=0)
    options = convert.ConvertOptions(batch_size=BATCH, pipeline_cfg={
        "converter": "auto", "min_ipu_quantity": 2, "max_ipu_quantity": 2})
    summary = convert.convert(str(tmp_path / "masked.keras"), str(tmp_path / "export"), options)
    assert summary["device_mapping"] == [0, 1] and len(summary["stage_costs"]) == 2
    np.testing.assert_allclose(ipu.serving.load(str(tmp_path / "export"))(data), expected,
                               atol=1e-5)


@pytest.mark.parametrize("converter", ["manual_sharding", "auto"])
def test_operations_and_tied_layers_go_after_the_stages_they_take_from(converter, tmp_path):
    # `h + 3.0` (keras.applications' hard sigmoid, ConvNeXt's residual add) is an operation
    # of the graph, no layer: it went to stage 0 whatever it took, and every converter
    # failed. A tied layer's stage followed its last call's inputs only.
    from keras_ipu.keras import convert

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        x = keras.Input((6,), name="x")
        first = keras.layers.Dense(6, name="first")(x)
        second = keras.layers.Dense(6, name="second")(first)
        tied = keras.layers.Dense(6, name="tied")
        joined = keras.layers.Concatenate(name="cat")([tied(second), tied(first)])
        shifted = keras.layers.ReLU(6.0, name="relu6")(joined + 3.0)
        model = keras.Model(x, keras.layers.Dense(1, name="head")(shifted))
        model.save(tmp_path / "ops.keras")
    data = np.random.default_rng(0).normal(size=(BATCH, 6)).astype("float32")
    expected = model.predict(data, batch_size=BATCH, verbose=0)
    options = convert.ConvertOptions(batch_size=BATCH, num_ipus=2, **(
        {"manual_sharding": [["^first$"], ["^second$"]]} if converter == "manual_sharding"
        else {"pipeline_cfg": {"converter": "auto", "min_ipu_quantity": 2,
                               "max_ipu_quantity": 2}}))
    summary = convert.convert(str(tmp_path / "ops.keras"), str(tmp_path / "export"), options)
    if converter == "manual_sharding":
        assert summary["stage_of_layer"] == {"first": 0, "second": 1, "tied": 1, "cat": 1,
                                             "relu6": 1, "head": 1}
    np.testing.assert_allclose(ipu.serving.load(str(tmp_path / "export"))(data), expected,
                               atol=1e-5)


def test_auto_cuts_no_stage_between_the_calls_of_a_tied_layer(tmp_path):
    # `proj` is called first and last: before, the auto split put `d2` after the first
    # cut, which `proj`'s second call takes from (the stage check refused the export).
    from keras_ipu.keras import convert

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        x = keras.Input((16,), name="x")
        proj = keras.layers.Dense(16, name="proj")
        h = keras.layers.Dense(64, name="d1")(proj(x))
        h = keras.layers.Dense(16, name="d2")(h)
        model = keras.Model(x, keras.layers.Dense(2, name="out")(proj(h)))
        model.save(tmp_path / "tied.keras")
    data = np.random.default_rng(0).normal(size=(BATCH, 16)).astype("float32")
    expected = model.predict(data, batch_size=BATCH, verbose=0)
    options = convert.ConvertOptions(batch_size=BATCH, pipeline_cfg={"converter": "auto"})
    summary = convert.convert(str(tmp_path / "tied.keras"), str(tmp_path / "export"), options)
    assert summary["stage_of_layer"] == {"proj": 0, "d1": 0, "d2": 0, "out": 1}
    np.testing.assert_allclose(ipu.serving.load(str(tmp_path / "export"))(data), expected,
                               atol=1e-5)
    three = convert.ConvertOptions(batch_size=BATCH, pipeline_cfg={
        "converter": "auto", "min_ipu_quantity": 3, "max_ipu_quantity": 3})
    with pytest.raises(ValueError, match=r"can be cut into at most 2 pipeline stage\(s\)"):
        convert.convert(str(tmp_path / "tied.keras"), str(tmp_path / "three"), three)


def test_auto_costs_a_reloaded_sequentials_layers_once(tmp_path):
    # A reloaded Sequential's layers keep calls of its earlier builds: costing every
    # recorded call made the first layers dear (a 2/4 split of six equal layers).
    from keras_ipu.keras import convert

    model = keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(64) for _ in range(6)])
    model.save(tmp_path / "seq.keras")
    options = convert.ConvertOptions(batch_size=BATCH, pipeline_cfg={
        "converter": "auto", "min_ipu_quantity": 2, "max_ipu_quantity": 2})
    summary = convert.convert(str(tmp_path / "seq.keras"), str(tmp_path / "export"), options)
    assert list(summary["stage_of_layer"].values()) == [0, 0, 0, 1, 1, 1]
    assert summary["stage_costs"][0] == pytest.approx(summary["stage_costs"][1])


def test_comments_are_stripped_outside_strings_only():
    from keras_ipu.keras.convert import strip_comments

    text = '{"a": "http://x", // a comment\n "b": "say \\"//\\"", "c": 1 // "d": 2\n}'
    assert json.loads(strip_comments(text)) == {"a": "http://x", "b": 'say "//"', "c": 1}


def test_the_ipus_convert_is_asked_for_are_the_ones_run_checks(saved_mlp, tmp_path):
    path, x, expected = saved_mlp
    converted = _cli("ipu", "--model", str(path), "--dir", str(tmp_path / "export"),
                     "--batch_size", str(BATCH), "--num_ipus", "2")
    assert converted.returncode == 0, converted.stderr
    metadata = ipu.serving.load(str(tmp_path / "export")).metadata
    # Before, an export without sharding was always for 1 IPU: run --num_ipus 2 refused it.
    assert metadata["num_ipus"] == 2 and metadata["device_mapping"] == [0]
    np.save(tmp_path / "x.npy", x[:BATCH])

    def run(num_ipus):
        return subprocess.run(
            [sys.executable, "-m", "keras_ipu", "run", "--dir", str(tmp_path / "export"),
             "--num_ipus", num_ipus, "--inputs", f"features={tmp_path / 'x.npy'}",
             "--outdir", str(tmp_path / f"out{num_ipus}")],
            env=fresh_process_env(), capture_output=True, text=True, timeout=300)

    ran, refused = run("2"), run("1")
    assert ran.returncode == 0, ran.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out2" / "output_0.npy"), expected[:BATCH],
                               atol=1e-5)
    assert refused.returncode == 2 and "the export runs on 2 IPU(s)" in refused.stderr


def _adapted_normalization(strategy, mean: float, spread: float, head: bool = False):
    """A model normalizing 3 features, adapted to normal data of `mean` and `spread`."""
    with strategy.scope():
        inputs = keras.Input((3,), name="num")
        norm = keras.layers.Normalization(name="norm")
        norm.adapt(np.random.default_rng(0).normal(mean, spread, size=(100, 3)).astype("float32"))
        outputs = norm(inputs)
        if head:
            outputs = keras.layers.Dense(2, name="head")(outputs)
        return keras.Model(inputs, outputs)


def test_half_precision_keeps_an_adapted_normalization(strategy):
    # Cloned in float16, its adapted mean and variance were not finalized: the export
    # computed (x - 0) / 1.
    model = _adapted_normalization(strategy, mean=3, spread=2)
    with strategy.scope():
        half = fp16_conversion.to_float16(model, [])
    x = np.ones((2, 3), "float32")
    np.testing.assert_allclose(np.asarray(half(x.astype("float16")), "float32"),
                               np.asarray(model(x)), atol=5e-3)


def test_a_model_with_a_python_lambda_converts_when_the_user_trusts_it(tmp_path):
    # Keras' advice (`safe_mode=False`) had no way through the command.
    inputs = keras.Input((3,))
    scaled = keras.layers.Lambda(lambda t: t / 127.5 - 1)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(scaled))
    model.save(tmp_path / "m.keras")
    refused = _cli("--model", str(tmp_path / "m.keras"), "--dir", str(tmp_path / "refused"))
    assert refused.returncode == 2 and "--unsafe_deserialization" in refused.stderr
    done = _cli("--model", str(tmp_path / "m.keras"), "--dir", str(tmp_path / "out"),
                "--unsafe_deserialization")
    assert done.returncode == 0, done.stderr
    x = np.full((1, 3), 127.5, "float32")
    np.testing.assert_allclose(ipu.serving.load(str(tmp_path / "out"))(x),
                               model.predict(x, verbose=0), atol=1e-6)


def _dtypes(model) -> dict:
    return {layer.name: sorted({str(w.dtype) for w in layer.weights})
            for layer in model._flatten_layers(include_self=False) if layer.weights}


def test_fp16_recasts_nested_models_and_wrapped_layers_but_the_excluded(strategy):
    # A nested model's layers and a wrapper's inner layers stayed float32; an LSTM could
    # not be recast at all (its Orthogonal initializer has no float16 form).
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="inner_dense")],
                                 name="inner")
        inputs = keras.Input((4, 6))
        h = keras.layers.Bidirectional(keras.layers.LSTM(4, name="lstm"), name="bi")(inputs)
        outputs = keras.layers.Dense(3, name="d2")(inner(keras.layers.Dense(8, name="d1")(h)))
        model = keras.Model(inputs, outputs)
        half = fp16_conversion.to_float16(model, [])
        kept = fp16_conversion.to_float16(model, [re.compile("inner_dense"), re.compile("^bi$")])
    assert set(map(tuple, _dtypes(half).values())) == {("float16",)}
    assert _dtypes(kept)["inner_dense"] == ["float32"] and _dtypes(kept)["bi"] == ["float32"]
    assert _dtypes(kept)["d1"] == ["float16"]
    # A nested model excluded by its own name stays as it is, as a wrapper does.
    with strategy.scope():
        whole = fp16_conversion.to_float16(model, [re.compile("^inner$")])
    assert _dtypes(whole)["inner_dense"] == ["float32"] and _dtypes(whole)["d1"] == ["float16"]
    x = np.random.default_rng(0).normal(size=(2, 4, 6)).astype("float32")
    for converted in (half, kept):
        np.testing.assert_allclose(np.asarray(converted(x), "float32"), np.asarray(model(x)),
                                   atol=2e-3)
    # The layers keep their own initializers (their weights came from the model).
    assert "FP16ConversionZeros" not in json.dumps(half.get_config())
    cells = [m.get_layer("bi").forward_layer.cell for m in (model, half)]
    assert [type(c.recurrent_initializer).__name__ for c in cells] == ["Orthogonal"] * 2


def test_fp16_refuses_a_quantized_model_by_its_layers(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="qd")])
    model.quantize("int8")
    with pytest.raises(ValueError, match=r"the layers \['qd'\] are quantized .*FP32"):
        fp16_conversion.to_float16(model, [])
    # Excluded, it stays quantized in a float16 model.
    half = fp16_conversion.to_float16(model, [re.compile("^qd$")])
    assert half.layers[0].dtype_policy.name == "int8_from_float32"


def test_fp16_refuses_weights_float16_cannot_hold_and_converts_them_excluded(strategy):
    # An adapted Normalization of large values (variance ~1e6): before, its weights became
    # infinities with only NumPy's overflow warning, and the export answered nonsense.
    model = _adapted_normalization(strategy, mean=0, spread=1000, head=True)
    with pytest.raises(ValueError, match=r"infinities of the weights norm/variance \(\|value\| "
                                         r"up to .*--precision_conversion_excluded_nodes"):
        fp16_conversion.to_float16(model, [])
    # 65510 rounds to float16's largest, 65504: no infinity, converted.
    model.layers[-1].bias.assign([65510.0, -65519.0])
    with pytest.raises(ValueError, match="norm/variance") as refused:
        fp16_conversion.to_float16(model, [])
    assert "head/bias" not in str(refused.value)
    half = fp16_conversion.to_float16(model, [re.compile("^norm$")])
    x = np.random.default_rng(1).normal(0, 1000, size=(2, 3)).astype("float32")
    np.testing.assert_allclose(np.asarray(half(x), "float32"), np.asarray(model(x)),
                               atol=2e-2, rtol=2e-2)


@keras.saving.register_keras_serializable(package="convert_test")
class _Doubling(keras.layers.Layer):
    def call(self, x):
        return 2.0 * x


def test_a_custom_class_the_command_cannot_import_is_named_with_what_to_do(tmp_path):
    # Before, the one line kept was Keras' generic first line, without the class.
    model = keras.Sequential([keras.Input((2,)), _Doubling(name="double")])
    model.save(tmp_path / "custom.keras")
    result = _cli("--model", str(tmp_path / "custom.keras"), "--dir", str(tmp_path / "e"))
    assert result.returncode == 2
    assert "Could not locate class '_Doubling'. keras-ipu convert imports none of your code" in (
        result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1
