"""Serving exports: equal to predict, Keras-free runtime, the reference's errors and numbers."""

from __future__ import annotations

import collections
import json
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import configure


def _two_input_model():
    a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(16, activation="relu")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.5)(h)
    return keras.Model([a, b], [keras.layers.Dense(2, name="p")(h),
                                keras.layers.Dense(1, name="q")(h)])


def _data(rows=32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(rows, 5)).astype("float32"),
            rng.normal(size=(rows, 3)).astype("float32")]


def test_an_export_equals_predict_for_two_inputs_batchnorm_and_dropout(strategy, tmp_path):
    x = _data()
    with strategy.scope():
        model = _two_input_model()
    model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
    model.fit(x, [np.ones((32, 2), "float32"), np.zeros((32, 1), "float32")], batch_size=4,
              epochs=2, verbose=0)  # BatchNormalization's statistics move
    runtime = model.export_for_ipu_serving(tmp_path / "export", batch_size=4,
                                           output_names=["p", "q"])
    expected = model.predict(x, batch_size=4, verbose=0)
    first = runtime(x[0][:4], b=x[1][:4])
    np.testing.assert_allclose(first["p"], expected[0][:4], atol=1e-6)
    np.testing.assert_allclose(first["q"], expected[1][:4], atol=1e-6)
    # Positional arrays of the exported signature take the runtime's short path.
    positional = runtime(x[0][:4], x[1][:4])
    for name in ("p", "q"):
        np.testing.assert_array_equal(positional[name], first[name])
    # The exported loop: 4 batches per device call, 8 batches in all.
    many = runtime.run_many(*(a.reshape(8, 4, -1) for a in x))
    np.testing.assert_allclose(many["p"].reshape(32, 2), expected[0], atol=1e-6)
    np.testing.assert_allclose(many["q"].reshape(32, 1), expected[1], atol=1e-6)
    metadata = json.loads((tmp_path / "export" / "metadata.json").read_text())
    assert metadata["batch_size"] == 4 and metadata["iterations"] == 4
    assert [i["name"] for i in metadata["inputs"]] == ["a", "b"]
    assert [o["name"] for o in metadata["outputs"]] == ["p", "q"]
    assert metadata["platforms"] == ["cpu"] and metadata["num_ipus"] == 1


def test_a_pipelined_export_equals_predict(strategy, tmp_path):
    configure(2)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 6)).astype("float32")
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((6,))
        with ipu.keras.PipelineStage(0):
            h = keras.layers.Dense(8, activation="tanh")(inputs)
        with ipu.keras.PipelineStage(1):
            out = keras.layers.Dense(3)(h)
        model = keras.Model(inputs, out)
        model.set_pipelining_options(device_mapping=[1, 0])
        model.compile(steps_per_execution=4)
    runtime = ipu.serving.export_keras(model, str(tmp_path / "export"), batch_size=2)
    expected = model.predict(x, batch_size=2, verbose=0)
    np.testing.assert_allclose(runtime.run_many(x.reshape(8, 2, 6)).reshape(16, 3), expected,
                               atol=1e-6)
    assert runtime.metadata["device_mapping"] == [1, 0]
    assert runtime.metadata["num_ipus"] == 2 and runtime.metadata["pipeline_stages"] == 2
    # Each stage runs on its own IPU's device: stage 0 on IPU 1, stage 1 on IPU 0.
    devices = runtime.devices
    assert len(devices) == 2 and devices[0] != devices[1]
    assert devices == [jax.devices()[1], jax.devices()[0]]
    # The server's warm-up runs a pipelined export too.
    from keras_ipu.serving.server import warm_up

    warm_up(runtime)
    np.testing.assert_allclose(runtime(x[:2]), expected[:2], atol=1e-6)
    # One input: positionally, by name, or as one dict (a list of lists is one array).
    (name,) = runtime.input_names
    for call in (lambda: runtime(**{name: x[:2]}), lambda: runtime({name: x[:2]}),
                 lambda: runtime(x[:2].tolist())):
        np.testing.assert_allclose(call(), expected[:2], atol=1e-6)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_preprocessing_step_may_give_a_dict_models_dict(pipelined, strategy, tmp_path):
    # It failed with JAX's "Too few leaves for PyTreeSpec; expected: 2, got: 1".
    configure(2 if pipelined else 1)
    with strategy.scope():
        image, meta = keras.Input((4,), name="image"), keras.Input((2,), name="meta")
        dense = keras.layers.Dense(1)
        model = keras.Model({"image": image, "meta": meta},
                            dense(keras.layers.Concatenate()([image, meta])))
        if pipelined:
            assignment = model.get_pipeline_stage_assignment()
            for index, entry in enumerate(assignment):  # the Concatenate, then the Dense
                entry.pipeline_stage = index
            model.set_pipeline_stage_assignment(assignment)
    x = {"image": np.arange(8, dtype="float32").reshape(2, 4),
         "meta": np.ones((2, 2), "float32")}
    exported = model.export_for_ipu_serving(
        tmp_path / "e", batch_size=2,
        preprocessing_step=lambda image, meta: {"meta": meta, "image": image / 255})
    expected = model.predict({"image": x["image"] / 255, "meta": x["meta"]}, batch_size=2,
                             verbose=0)
    np.testing.assert_allclose(exported(x["image"], x["meta"]), expected, rtol=1e-6)
    with pytest.raises(ValueError, match=r"returned a dict of \['img', 'meta'\], but the model "
                                         r"takes a dict of \['image', 'meta'\]"):
        model.export_for_ipu_serving(
            tmp_path / "f", batch_size=2,
            preprocessing_step=lambda image, meta: {"img": image, "meta": meta})


def test_the_references_pre_and_postprocessing_numbers(strategy, tmp_path):
    with strategy.scope():
        inputs = keras.Input((3, 1), batch_size=1)
        out = keras.layers.Conv1D(2, 2, kernel_initializer=keras.initializers.Constant(3),
                                  activation="relu")(inputs)
        model = keras.Model(inputs, out)
    x = np.array([[[-1], [2], [-3]]], "float32")
    assert model.export_for_ipu_serving(tmp_path / "a")(x).tolist() == [[[3, 3], [0, 0]]]
    scaled = model.export_for_ipu_serving(tmp_path / "b", preprocessing_step=lambda v: v * 10)
    assert scaled(x).tolist() == [[[30, 30], [0, 0]]]
    summed = model.export_for_ipu_serving(tmp_path / "c", preprocessing_step=lambda v: v * 10,
                                          postprocessing_step=lambda v: jnp.sum(v))
    assert float(summed(x)) == 60
    # `export_keras` takes the method's arguments, the ported signatures included.
    alike = ipu.serving.export_keras(model, str(tmp_path / "d"),
                                     preprocessing_step=lambda v: v * 10,
                                     preprocessing_step_signature=None,
                                     postprocessing_step=lambda v: jnp.sum(v),
                                     postprocessing_step_signature=None)
    assert float(alike(x)) == 60
    # A preprocessing step's signature gives the export's inputs (here int32 [1, 3]).
    def to_model(tokens):
        return jnp.reshape(tokens.astype(jnp.float32), (-1, 3, 1)) * 10

    signature = (keras.Input((3,), batch_size=None, dtype="int32", name="tokens"),)
    for directory, export in (("e", lambda **kw: model.export_for_ipu_serving(
            tmp_path / "e", **kw)), ("f", lambda **kw: ipu.serving.export_keras(
            model, str(tmp_path / "f"), **kw))):
        signed = export(preprocessing_step=to_model, preprocessing_step_signature=signature,
                        postprocessing_step=lambda v: jnp.sum(v))
        assert signed.inputs == [{"name": "tokens", "shape": [1, 3], "dtype": "int32"}], directory
        assert float(signed(tokens=np.array([[-1, 2, -3]], "int32"))) == 60
    # A signature whose first input has no batch axis (a scale): the batch is the model's.
    scaled = model.export_for_ipu_serving(
        tmp_path / "s", preprocessing_step=lambda scale, v: v * scale,
        preprocessing_step_signature=[jax.ShapeDtypeStruct((), "float32"),
                                      keras.Input((3, 1), batch_size=None)])
    assert scaled.batch_size == 1 and scaled(2.0, x).tolist() == [[[6, 6], [0, 0]]]
    with pytest.raises(TypeError, match=r"preprocessing_step_signature\[0\] must have a shape "
                                        r"and a dtype"):
        model.export_for_ipu_serving(tmp_path / "g", preprocessing_step=to_model,
                                     preprocessing_step_signature=[None])


def test_one_export_for_cpu_and_cuda(strategy, tmp_path):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,), batch_size=2), keras.layers.Dense(3)])
    runtime = model.export_for_ipu_serving(tmp_path / "e", platforms=("cpu", "cuda"))
    assert runtime.metadata["platforms"] == ["cpu", "cuda"]
    x = np.ones((2, 4), "float32")
    np.testing.assert_allclose(runtime(x), model.predict(x, batch_size=2, verbose=0), atol=1e-6)


def test_the_references_errors(strategy, tmp_path):
    with strategy.scope():
        unbuilt = keras.Sequential([keras.layers.Dense(3)])
        no_batch = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(RuntimeError, match="Cannot get model's input signature"):
        unbuilt.export_for_ipu_serving(tmp_path / "a")
    with pytest.raises(ValueError, match=r"specify `batch_size` parameter.*\(None, 4\)\)$"):
        no_batch.export_for_ipu_serving(tmp_path / "b")
    with strategy.scope():
        sequences = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"axes \[1\] beyond the batch are unknown"):
        sequences.export_for_ipu_serving(tmp_path / "b", batch_size=2)  # no batch size fixes
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        no_batch.export_for_ipu_serving(tmp_path / "full", batch_size=2)
    assert (tmp_path / "full" / "keep.txt").exists()
    no_batch.export_for_ipu_serving(tmp_path / "full", batch_size=2, purge_export_dir=True)
    assert not (tmp_path / "full" / "keep.txt").exists()
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="IPU strategy"):
        ipu.serving.export_keras(plain, str(tmp_path / "c"), batch_size=2)


def test_the_runtime_checks_its_inputs(strategy, tmp_path):
    with strategy.scope():
        model = keras.Model(*_inputs_and_sum())
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    ones = np.ones((2, 4), "float32")
    assert runtime(x=ones, y=ones).tolist() == (ones * 2).tolist()
    assert runtime(ones, y=ones.astype("float16")).dtype == np.float32  # safe cast
    with pytest.raises(ValueError, match=r"has shape \(3, 4\), expected \(2, 4\).*inputs \(x"):
        runtime(np.ones((3, 4), "float32"), ones)
    with pytest.raises(TypeError, match="values are complex64, which does not cast to float32"):
        runtime(ones.astype("complex64"), ones)
    with pytest.raises(TypeError, match=r"Missing inputs \['y'\]"):
        runtime(ones)
    with pytest.raises(TypeError, match=r"Unknown inputs \['z'\]"):
        runtime(ones, ones, z=ones)
    with pytest.raises(ValueError, match="multiple of the export's 1 iterations"):
        runtime.run_many(np.ones((0, 2, 4), "float32"), np.ones((0, 2, 4), "float32"))


def _inputs_and_sum():
    x, y = keras.Input((4,), name="x"), keras.Input((4,), name="y")
    return [x, y], keras.layers.Add()([x, y])


def test_a_subclassed_model_built_with_its_input_shape_exports(strategy, tmp_path):
    class Small(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with strategy.scope():
        model = Small()
        model.build((3, 4))
    runtime = model.export_for_ipu_serving(tmp_path / "e")
    x = np.arange(12, dtype="float32").reshape(3, 4)
    np.testing.assert_allclose(runtime(x), model.predict(x, batch_size=3, verbose=0), atol=1e-6)


def test_a_sequential_export_keeps_its_inputs_names_and_dtypes(strategy, tmp_path):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 50, size=(8, 3)).astype("int32")
    with strategy.scope():
        named = keras.Sequential([keras.Input((3,), batch_size=2, dtype="int32", name="tokens"),
                                  keras.layers.Embedding(50, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(2)])
        built = keras.Sequential([keras.layers.Dense(2)])
        built.build((None, 6))
        inputs = keras.Input((6,))
        functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    named.compile(steps_per_execution=2)
    runtime = ipu.serving.export_keras(named, str(tmp_path / "named"), batch_size=2)
    assert runtime.inputs == [{"name": "tokens", "shape": [2, 3], "dtype": "int32"}]
    expected = named.predict(tokens, batch_size=2, verbose=0)
    np.testing.assert_allclose(runtime.run_many(tokens.reshape(4, 2, 3)).reshape(8, 2),
                               expected, atol=1e-6)
    np.testing.assert_allclose(runtime(tokens=tokens[:2]), expected[:2], atol=1e-6)
    # Inputs Keras named itself (keras_tensor_<n>) are named by position.
    for name, model in (("built", built), ("functional", functional)):
        exported = ipu.serving.export_keras(model, str(tmp_path / name), batch_size=2)
        assert exported.input_names == ["input_0"], name


def test_an_unnamed_input_beside_one_named_input_1_gets_a_name_of_its_own(strategy, tmp_path):
    # The reference's example names its inputs "input_1" and "input_2"; an unnamed second
    # input would be `input_1` by position too, and every call by name would bind it twice.
    with strategy.scope():
        first, second = keras.Input((4,), name="input_1"), keras.Input((4,))
        model = keras.Model([first, second], keras.layers.Subtract()([first, second]))
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    assert runtime.input_names == ["input_1", "input_1_1"]
    a, b = np.ones((2, 4), "float32"), np.full((2, 4), 5, "float32")
    expected = model.predict([a, b], batch_size=2, verbose=0)
    for call in (lambda: runtime(a, b),                                   # the short path
                 lambda: runtime(a.astype("float64"), b.astype("float64")),  # cast
                 lambda: runtime(a.tolist(), b.tolist()),
                 lambda: runtime(input_1=a, input_1_1=b),
                 lambda: runtime({"input_1": a, "input_1_1": b})):
        np.testing.assert_array_equal(call(), expected)
    with pytest.raises(TypeError, match=r"Missing inputs \['input_1_1'\]"):
        runtime(input_1=a)
    # An export naming two inputs alike (written before) is refused when loaded.
    path = tmp_path / "e" / "metadata.json"
    metadata = json.loads(path.read_text())
    metadata["inputs"][1]["name"] = "input_1"
    path.write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match=r"names several inputs \['input_1'\]"):
        ipu.serving.load(str(tmp_path / "e"))


class _TakesADict(keras.Model):
    def __init__(self):
        super().__init__()
        self.a, self.b = keras.layers.Dense(4), keras.layers.Dense(4)

    def call(self, inputs):
        return self.a(inputs["u"]) + self.b(inputs["v"])


@pytest.mark.parametrize("kind", ["functional", "subclass"])
def test_a_model_taking_a_dict_is_served_by_its_keys(kind, strategy, tmp_path):
    # Before: "Unknown inputs ['u', 'v']": the export knew the inputs by names only.
    u, v = np.ones((2, 3), "float32"), np.linspace(0, 1, 10, dtype="float32").reshape(2, 5)
    with strategy.scope():
        if kind == "functional":
            a, b = keras.Input((3,), name="a_in"), keras.Input((5,), name="b_in")
            with warnings.catch_warnings():  # Keras prefers keys that are the inputs' names
                warnings.simplefilter("ignore", UserWarning)
                model = keras.Model({"u": a, "v": b},
                                    keras.layers.Dense(4)(a) + keras.layers.Dense(4)(b))
        else:
            model = _TakesADict()
            model.build({"v": (None, 5), "u": (None, 3)})
    expected = np.asarray(model({"u": u, "v": v}))
    runtime = model.export_for_ipu_serving(tmp_path / kind, batch_size=2)
    names = runtime.input_names
    assert "(key 'u')" in runtime.signature()
    np.testing.assert_allclose(runtime({"u": u, "v": v}), expected, atol=1e-6)
    np.testing.assert_allclose(runtime(u=u, v=v), expected, atol=1e-6)
    np.testing.assert_allclose(runtime(**dict(zip(names, (u, v)))), expected, atol=1e-6)
    with pytest.raises(TypeError, match=f"Input '{names[0]}' given twice \\(as 'u' and "
                                        f"'{names[0]}'\\)"):  # it said "(as '{names[0]}' too)"
        runtime(**{"u": u, names[0]: u, "v": v})
    # Over REST too, in both formats (before: 400, "unknown ['u', 'v']").
    from keras_ipu.serving.server import parse_predict

    for body in ({"inputs": {"u": u.tolist(), "v": v.tolist()}},
                 {"instances": [{"u": u[i].tolist(), "v": v[i].tolist()} for i in range(2)]}):
        rows, _ = parse_predict(json.dumps(body).encode(), runtime)
        np.testing.assert_allclose(runtime(**rows), expected, atol=1e-6)


def test_the_models_own_dict_binds_by_key_when_its_keys_are_other_inputs_names(strategy,
                                                                                tmp_path):
    # Keys that are the other inputs' names: the inputs were silently swapped.
    with strategy.scope():
        query, doc = keras.Input((2,), name="doc"), keras.Input((2,), name="query")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = keras.Model({"query": query, "doc": doc}, query - doc)
    given = {"query": np.full((2, 2), 3.0, "float32"), "doc": np.ones((2, 2), "float32")}
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    np.testing.assert_array_equal(runtime(given), np.full((2, 2), 2.0))
    np.testing.assert_array_equal(runtime(given), model.predict(given, batch_size=2, verbose=0))


def test_integer_inputs_take_the_values_their_dtype_holds(strategy, tmp_path):
    # The runtime refused int64 literals for a uint8 input and wrapped 300 into an int8 one.
    with strategy.scope():
        u, i = keras.Input((3,), dtype="uint8", name="u"), keras.Input((3,), dtype="int8", name="i")
        model = keras.Model([u, i], keras.ops.cast(u, "float32") + keras.ops.cast(i, "float32"))
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=1)
    np.testing.assert_array_equal(runtime([[0, 128, 255]], np.array([[1, 2, 3]])),
                                  [[1.0, 130.0, 258.0]])
    with pytest.raises(ValueError, match=r"Input 'i' is not int8 data: its values 2 to 300 are "
                                         r"outside int8's \[-128, 127\]"):
        runtime([[0, 1, 2]], [[2, 3, 300]])
    with pytest.raises(TypeError, match="Input 'u' is not uint8 data: its values are float64"):
        runtime([[0.5, 1, 2]], [[1, 2, 3]])


def _pipelined_sequential(stages, device_mapping):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(2)])
    model.set_pipeline_stage_assignment(stages)
    model.set_pipelining_options(device_mapping=device_mapping)
    model.compile(steps_per_execution=2)
    return model


def test_export_refuses_the_pipelines_predict_refuses(tmp_path):
    configure(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        stale = _pipelined_sequential([0, 1], [0, 1])
        stale.add(keras.layers.Dense(3))  # the assignment no longer covers every layer
        three_ipus = _pipelined_sequential([0, 1], [0, 1, 0])  # 2 stages, 3 mappings
        one_stage = _pipelined_sequential([0, 0], [0, 1])     # 1 stage, 2 mappings
        absent_ipu = _pipelined_sequential([0, 1], [0, 5])    # the device has 2 IPUs
        unbatched = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(3),
            keras.layers.Lambda(lambda t: keras.ops.mean(t, axis=0)),  # (3,): no batch axis
            keras.layers.Lambda(lambda t: t * 2.0)])
        unbatched.set_pipeline_stage_assignment([0, 0, 1])
        unbatched.compile(steps_per_execution=2)
        three_options = _pipelined_sequential([0, 1], [0, 1])
        three_options.set_pipelining_options(forward_propagation_stages_poplar_options=[
            ipu.pipelining_ops.PipelineStageOptions()] * 3)
    x = np.ones((4, 4), "float32")
    for model, error, message in ((stale, RuntimeError, "no longer valid"),
                                  (three_ipus, ValueError, r"3 mappings != 2 stages"),
                                  (one_stage, ValueError, r"2 mappings != 1 stages"),
                                  (absent_ipu, ValueError, r"maps a stage to IPU 5, but the "
                                                           r"model's device has 2 IPUs"),
                                  (unbatched, ValueError, r"sends .* of shape \(3,\) to a "
                                                          r"later stage"),
                                  (three_options, ValueError, r"PipelineStageOptions objects "
                                                              r"of length 2 .* but is 3")):
        with pytest.raises(error, match=message):
            model.predict(x, batch_size=2, verbose=0)
        # Before, export caught the first and served the model unpipelined, wrote the
        # next three with their device_mapping and the last with a program every call of
        # which failed.
        with pytest.raises(error, match=message):
            model.export_for_ipu_serving(tmp_path / model.name, batch_size=2)
        assert not (tmp_path / model.name).exists()
    # The default mapping (stage i on IPU i) too, on a device of fewer IPUs than stages.
    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        two_stages = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                                       keras.layers.Dense(2)])
        two_stages.set_pipeline_stage_assignment([0, 1])
    for run in (lambda: two_stages.predict(x, batch_size=2, verbose=0),
                lambda: two_stages.export_for_ipu_serving(tmp_path / "two", batch_size=2)):
        with pytest.raises(ValueError, match="has 1 IPUs attached, however the current model "
                                             "requires a multiple of 2 IPUs"):
            run()
    assert not (tmp_path / "two").exists()


def test_a_numpy_batch_size_is_an_int_and_a_bad_one_leaves_the_export_alone(strategy, tmp_path):
    with strategy.scope():
        inputs = keras.Input((4,), name="x")
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    directory = tmp_path / "e"
    model.export_for_ipu_serving(directory, batch_size=2)
    files = sorted(p.name for p in directory.iterdir())
    # Before, np.int64 reached metadata.json, which json refused after the purge: the
    # export was gone and the directory held half an export.
    runtime = model.export_for_ipu_serving(directory, batch_size=np.int64(4),
                                           purge_export_dir=True)
    assert json.loads((directory / "metadata.json").read_text())["batch_size"] == 4
    x = np.random.default_rng(3).normal(size=(4, 4)).astype("float32")
    np.testing.assert_allclose(runtime(x), model.predict(x, batch_size=4, verbose=0), atol=1e-6)
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(ValueError, match="`batch_size` must be a positive integer"):
            model.export_for_ipu_serving(directory, batch_size=bad, purge_export_dir=True)
    assert sorted(p.name for p in directory.iterdir()) == files
    assert ipu.serving.load(str(directory)).batch_size == 4


def test_a_bfloat16_model_exports_and_loads(strategy, tmp_path):
    import ml_dtypes

    with strategy.scope():
        inputs = keras.Input((4,), name="x", dtype="bfloat16")
        model = keras.Model(inputs, keras.layers.Dense(2, dtype="bfloat16")(inputs))
    model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    # Before, np.savez stored the bfloat16 weights as void bytes (V2) that load could not use.
    runtime = ipu.serving.load(str(tmp_path / "e"))
    assert runtime.inputs == [{"name": "x", "shape": [2, 4], "dtype": "bfloat16"}]
    x = np.random.default_rng(4).normal(size=(2, 4)).astype(ml_dtypes.bfloat16)
    expected = model.predict(x, batch_size=2, verbose=0)
    assert runtime(x).dtype == expected.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(runtime(x).astype("float32"), expected.astype("float32"))
    np.testing.assert_array_equal(runtime(x.astype("float32")), runtime(x))  # same_kind cast


class _TwoInputs(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        a, b = inputs
        return self.dense(a) + b


def test_a_subclassed_model_built_with_several_input_shapes_exports(strategy, tmp_path):
    # The reference's example builds with `model.build([input_shape, input_shape])`; before,
    # the export took the list for one shape ("Cannot convert ... to a shape").
    rng = np.random.default_rng(6)
    a, b = rng.normal(size=(3, 4)).astype("float32"), rng.normal(size=(3, 2)).astype("float32")
    for shapes in ([(None, 4), (None, 2)], ((None, 4), (None, 2))):
        with strategy.scope():
            model = _TwoInputs()
            model.build(shapes)
        runtime = model.export_for_ipu_serving(tmp_path / str(len(list(tmp_path.iterdir()))),
                                               batch_size=3)
        assert runtime.inputs == [{"name": "input_0", "shape": [3, 4], "dtype": "float32"},
                                  {"name": "input_1", "shape": [3, 2], "dtype": "float32"}]
        np.testing.assert_allclose(runtime(a, b), model.predict([a, b], batch_size=3, verbose=0),
                                   atol=1e-6)


def test_a_subclassed_model_exports_the_dtype_it_was_called_with(strategy, tmp_path):
    class PlusOne(keras.Model):
        def call(self, x):
            return x + 1

    with strategy.scope():
        called, built = PlusOne(), _TwoInputs()
    tokens = np.array([[16777217, 3]], "int32")  # float32 has no 16777218
    expected = np.asarray(called(tokens))
    # Before, exported as float32: 16777217 + 1 came back 16777216.0.
    runtime = called.export_for_ipu_serving(tmp_path / "called", batch_size=1)
    assert runtime.inputs == [{"name": "input_0", "shape": [1, 2], "dtype": "int32"}]
    assert runtime(tokens).dtype == np.int32
    np.testing.assert_array_equal(runtime(tokens), expected)
    np.testing.assert_array_equal(runtime(tokens), [[16777218, 4]])
    # Float data reaches `call` in Keras' floatx, as predict feeds it, so float64 data is
    # float32; a model never called has float32 inputs.
    built([np.ones((2, 4)), np.ones((2, 2))])
    exported = built.export_for_ipu_serving(tmp_path / "built", batch_size=2)
    assert [i["dtype"] for i in exported.inputs] == ["float32", "float32"]


class _Float32Head(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = keras.layers.Dense(1, dtype="float32")

    def call(self, x):
        return self.head(x)


def test_a_mixed_precision_subclassed_model_serves_its_float32_layers_unrounded_data(
        strategy, tmp_path):
    # Keras' predict gives `call` the data uncast; the export took the policy's bfloat16
    # input, rounding what the float32 head saw (-26.59 where predict gave -26.28).
    x = (np.random.default_rng(0).normal(size=(4, 3)) * 100).astype("float32")
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        with strategy.scope():
            model = _Float32Head()
            model(x)
    finally:
        keras.config.set_dtype_policy("float32")
    runtime = model.export_for_ipu_serving(tmp_path / "mixed", batch_size=4)
    assert runtime.inputs == [{"name": "input_0", "shape": [4, 3], "dtype": "float32"}]
    np.testing.assert_allclose(runtime(x), model.predict(x, batch_size=4, verbose=0),
                               rtol=1e-6, atol=1e-4)


def test_a_pipeline_stage_forwarding_integers_exports_their_type(tmp_path):
    # A Lambda's output is float32 in Keras' graph whatever it returns: the export took
    # that type for the next stage's input, and every call failed (int32 given).
    configure(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((4,))
        with ipu.keras.PipelineStage(0):
            ids = keras.layers.Lambda(
                lambda t: keras.ops.cast(keras.ops.argmax(t, axis=-1), "int32"))(inputs)
        with ipu.keras.PipelineStage(1):
            outputs = keras.layers.Embedding(4, 2)(ids)
        model = keras.Model(inputs, outputs)
        model.compile(steps_per_execution=2)
    x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    np.testing.assert_array_equal(runtime(x), model.predict(x, batch_size=2, verbose=0))


def test_a_mask_from_a_nested_model_crosses_the_exported_stages(tmp_path):
    # The mask rides on the nested model's output only: the export's second stage ran the
    # LSTM over the padding (served outputs as plain Keras without the mask).
    configure(2)
    keras.utils.set_random_seed(5)
    with ipu.ipu_strategy.IPUStrategy().scope():
        ids = keras.Input((6,), dtype="int32")
        backbone = keras.Model(ids, keras.layers.Embedding(10, 8, mask_zero=True)(ids))
        inputs = keras.Input((6,), dtype="int32")
        with ipu.keras.PipelineStage(0):
            embedded = backbone(inputs)
        with ipu.keras.PipelineStage(1):
            outputs = keras.layers.Dense(1)(keras.layers.LSTM(8)(embedded))
        model = keras.Model(inputs, outputs)
        model.compile(steps_per_execution=2)
    x = np.random.default_rng(0).integers(1, 10, size=(4, 6)).astype("int32")
    x[0, 2:] = x[1, 4:] = x[3, 1:] = 0
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    served = np.concatenate([runtime(x[:2]), runtime(x[2:])])
    np.testing.assert_allclose(served, model.predict(x, batch_size=2, verbose=0), atol=1e-6)
    embedded = backbone.layers[-1].embeddings.numpy()[x]  # without the mask
    unmasked = np.asarray(model.layers[-1](model.layers[-2](embedded)))
    assert np.abs(served - unmasked).max() > 1e-3


class _KeywordsCall(keras.Model):
    """A `call(x, **kwargs)` passing its keywords on: Keras gives it no `training`."""

    def call(self, inputs, **kwargs):
        return self._head(inputs, **kwargs)

    def _head(self, inputs, scale=3.0):
        return inputs * scale


@pytest.mark.parametrize("platforms, message", [
    ("cpu", None),  # one name: not its letters
    (("cpu", "ipu"), r"Cannot export for the platforms \['ipu'\]"),
])
def test_platforms_are_names(platforms, message, strategy, tmp_path):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,), batch_size=2), keras.layers.Dense(3)])
    if message is not None:
        with pytest.raises(ValueError, match=message):
            model.export_for_ipu_serving(tmp_path / "e", platforms=platforms)
        assert not (tmp_path / "e").exists()
        return
    runtime = model.export_for_ipu_serving(tmp_path / "e", platforms=platforms)
    assert runtime.metadata["platforms"] == ["cpu"]
    x = np.ones((2, 4), "float32")
    np.testing.assert_allclose(runtime(x), model.predict(x, batch_size=2, verbose=0), atol=1e-6)


def test_a_call_taking_keywords_gets_no_training_argument(strategy, tmp_path):
    with strategy.scope():
        model = _KeywordsCall()
        model.build((2, 2))
    x = np.ones((2, 2), "float32")
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    np.testing.assert_allclose(runtime(x), np.full((2, 2), 3.0))


@pytest.mark.parametrize("stages", [1, 2])
def test_dict_outputs_are_served_under_their_keys_and_renamed_in_their_order(strategy, tmp_path,
                                                                             stages):
    configure(stages)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 4)).astype("float32")
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((4,))
        with ipu.keras.PipelineStage(0):
            h = keras.layers.Dense(6, activation="tanh")(inputs)
        with ipu.keras.PipelineStage(stages - 1):
            # Keys not in sorted order: Keras flattens a dict by sorted keys.
            outputs = {"zeta": keras.layers.Dense(1)(h), "alpha": keras.layers.Dense(3)(h)}
        model = keras.Model(inputs, outputs)
        if stages > 1:
            model.set_pipelining_options()
        model.compile(steps_per_execution=2)
    expected = model.predict(x, batch_size=2, verbose=0)
    served = model.export_for_ipu_serving(str(tmp_path / "keys"), batch_size=2)
    assert served.output_names == ["alpha", "zeta"]
    got = served(x[:2])
    np.testing.assert_allclose(got["zeta"], expected["zeta"][:2], atol=1e-6)
    np.testing.assert_allclose(got["alpha"], expected["alpha"][:2], atol=1e-6)
    # `output_names` follow the dict's own order, as the model returns it.
    renamed = model.export_for_ipu_serving(str(tmp_path / "renamed"), batch_size=2,
                                           output_names=["z", "a"])
    got = renamed(x[:2])
    assert got["z"].shape == (2, 1) and got["a"].shape == (2, 3)
    np.testing.assert_allclose(got["a"], expected["alpha"][:2], atol=1e-6)
    with pytest.raises(ValueError, match=r"keys \['zeta', 'alpha'\], in that order"):
        model.export_for_ipu_serving(str(tmp_path / "bad"), batch_size=2, output_names=["z"])
    # Names that are no strings made JSON that clients refuse, and `run --outdir` fail.
    with pytest.raises(ValueError, match=r"once, with a string.*, got \[1, 2\]"):
        model.export_for_ipu_serving(str(tmp_path / "ints"), batch_size=2, output_names=[1, 2])
    # Keys that are the same text, and a None among the outputs, are refused before
    # anything is written (the export was written, then refused by its own runtime).
    with pytest.raises(ValueError, match=r"dict keys give the names \['1', '1'\], some twice"):
        model.export_for_ipu_serving(str(tmp_path / "same"), batch_size=2,
                                     postprocessing_step=lambda out: {1: out["zeta"],
                                                                      "1": out["alpha"]})
    with pytest.raises(ValueError, match=r"outputs hold None \(at flat position \[1\]\)"):
        model.export_for_ipu_serving(str(tmp_path / "none"), batch_size=2,
                                     postprocessing_step=lambda out: (out["zeta"], None))
    assert not any((tmp_path / name).exists() for name in ("same", "none", "ints"))
    # An OrderedDict flattens in its own order, not by sorted keys.
    ordered = model.export_for_ipu_serving(
        str(tmp_path / "ordered"), batch_size=2, postprocessing_step=lambda out: (
            collections.OrderedDict([("zeta", out["zeta"]), ("alpha", out["alpha"])])))
    got = ordered(x[:2])
    np.testing.assert_allclose(got["zeta"], expected["zeta"][:2], atol=1e-6)
    np.testing.assert_allclose(got["alpha"], expected["alpha"][:2], atol=1e-6)


def test_several_outputs_come_back_as_the_reference_returns_them(strategy, tmp_path):
    # The reference calls `postprocessing_step(*outputs)` and returns a list unless the
    # outputs are named; keras_ipu passed one list and returned a dict keyed output_0...
    # (so `sum_out, prod_out = runtime(x1, x2)` unpacked the key strings, silently).
    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
        model = keras.Model([a, b], [keras.layers.Add()([a, b]), keras.layers.Multiply()([a, b])])
        model.compile(steps_per_execution=1)
    x1, x2 = np.ones((1, 4), "float32"), np.full((1, 4), 2.0, "float32")
    sum_out, prod_out = model.export_for_ipu_serving(str(tmp_path / "plain"), batch_size=1)(x1, x2)
    np.testing.assert_array_equal(sum_out, 3.0)
    np.testing.assert_array_equal(prod_out, 2.0)

    def post(sum_out, prod_out):  # the reference's form: one argument per output
        return sum_out + prod_out, prod_out * 10

    runtime = model.export_for_ipu_serving(str(tmp_path / "post"), batch_size=1,
                                           postprocessing_step=post)
    added, scaled = runtime(x1, x2)
    np.testing.assert_array_equal(added, 5.0)
    np.testing.assert_array_equal(scaled, 20.0)
    assert set(runtime.by_output_name(runtime(x1, x2))) == {"output_0", "output_1"}
    named = model.export_for_ipu_serving(str(tmp_path / "named"), batch_size=1,
                                         output_names=["s", "p"])
    np.testing.assert_array_equal(named(x1, x2)["p"], 2.0)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_model_calling_the_host_is_refused_with_what_to_do(stages, tmp_path):
    # JAX cannot serialize host callbacks: before, its NotImplementedError came raw.
    configure(stages)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((4,), name="x")
        printed = keras.layers.Lambda(
            lambda z: (ipu.ops.internal_ops.print_tensor(z, "z"), z)[1], output_shape=(4,))
        outputs = keras.layers.Dense(3)(printed(keras.layers.Dense(4)(inputs)))
        model = keras.Model(inputs, outputs)
    if stages == 2:
        assignments = model.get_pipeline_stage_assignment()
        for assignment, stage in zip(assignments, [0, 1, 1]):
            assignment.pipeline_stage = stage
        model.set_pipeline_stage_assignment(assignments)
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"calls the host from its program .*`print_tensor`"):
        model.export_for_ipu_serving(str(tmp_path / "export"), batch_size=2)
    assert not (tmp_path / "export").exists()
    np.testing.assert_array_equal(model.get_weights()[0], weights[0])


@pytest.mark.parametrize("steps", ["auto", 2.7, 0, -3])
def test_export_refuses_the_steps_per_execution_fit_refuses(steps, tmp_path):
    # Before: "auto" raised int()'s message, 2.7 and 0 exported 2 and 1 iterations, -3
    # failed in MLIR.
    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    message = rf"`steps_per_execution` must be a positive integer, got {steps!r}"
    with pytest.raises(ValueError, match=message):  # `compile` refuses it first
        model.compile(steps_per_execution=steps)
    model.steps_per_execution = steps  # set past compile: export refuses it too
    with pytest.raises(ValueError, match=message):
        model.export_for_ipu_serving(str(tmp_path / "export"), batch_size=2)
    assert not (tmp_path / "export").exists()
