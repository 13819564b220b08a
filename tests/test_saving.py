"""Saving and loading inside the scope: every IPU option, the stages, weights, optimizer, files."""

from __future__ import annotations

import os
import zipfile

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import options

from conftest import assert_weights_close, configure
from models import data_for, two_stage_mlp


def _functional():
    inputs = keras.Input((6,))
    with ipu.keras.PipelineStage(0):
        h = keras.layers.Dense(8, activation="relu")(inputs)
    with ipu.keras.PipelineStage(1):
        out = keras.layers.Dense(3)(h)
    return keras.Model(inputs, out)


@keras.saving.register_keras_serializable("keras_ipu_tests")
class TwoStages(keras.Model):
    """A subclassed model whose `call` names its two stages."""

    def __init__(self, units=8, staged=True, **kwargs):
        super().__init__(**kwargs)
        self.units, self.staged = units, staged
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        if not self.staged:
            return self.out(self.hidden(x))
        with ipu.keras.PipelineStage(0):
            x = self.hidden(x)
        with ipu.keras.PipelineStage(1):
            return self.out(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "staged": self.staged}


BUILDERS = {"sequential": two_stage_mlp, "functional": _functional, "subclassed": TwoStages}


def _build(kind: str, pipelined: bool):
    if kind == "subclassed":
        return TwoStages(staged=pipelined)
    model = BUILDERS[kind]()
    if not pipelined:
        model.reset_pipeline_stage_assignment()
    return model


def _set_every_option(model, pipelined: bool):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  steps_per_execution=8)
    if pipelined:
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                     device_mapping=[1, 0], accumulate_outfeed=False,
                                     gradient_accumulation_reduction_method="mean")
    else:
        model.set_gradient_accumulation_options(
            gradient_accumulation_steps_per_replica=2,
            gradient_accumulation_reduction_method="running_mean")
    model.set_replication_options("mean")
    model.set_asynchronous_callbacks(True)
    model.set_infeed_queue_options(prefetch_depth=3)
    model.set_outfeed_queue_options(buffer_depth=2)


@pytest.mark.parametrize("pipelined", [False, True], ids=["one_ipu", "pipelined"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_model_round_trips_with_every_option(kind, pipelined, strategy, tmp_path):
    configure(2)
    x, y = data_for("sequential", samples=64)
    with strategy.scope():
        model = _build(kind, pipelined)
        model(x[:1])
        _set_every_option(model, pipelined)
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    saved, restored = options.options_of(model), options.options_of(loaded)
    assert restored.to_config() == saved.to_config()
    assert restored.asynchronous_callbacks and restored.infeed_kwargs == {"prefetch_depth": 3}
    assert [a.pipeline_stage for a in loaded.get_pipeline_stage_assignment()] == [
        a.pipeline_stage for a in model.get_pipeline_stage_assignment()]
    assert_weights_close(model.get_weights(), loaded.get_weights(), atol=0)
    # The optimizer state and the compiled settings come back too.
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) > 0
    assert_weights_close([v.numpy() for v in model.optimizer.variables],
                         [v.numpy() for v in loaded.optimizer.variables], atol=0)
    assert loaded.steps_per_execution == 8
    np.testing.assert_allclose(loaded.predict(x, batch_size=4, verbose=0),
                               model.predict(x, batch_size=4, verbose=0), atol=1e-6)
    # The loaded model trains on, as the saved one does.
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert_weights_close(model.get_weights(), loaded.get_weights(), atol=1e-6)


ROUTES = {
    "json": lambda model, path: keras.models.model_from_json(model.to_json()),
    "from_config": lambda model, path: type(model).from_config(model.get_config()),
    "h5": lambda model, path: (model.save(path / "m.h5"),
                               keras.models.load_model(path / "m.h5", compile=False))[1],
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_configs_carry_the_options_and_the_stages(kind, route, strategy, tmp_path):
    # As the reference's get_config: JSON, from_config and .h5 keep them, not only .keras.
    configure(2)
    with strategy.scope():
        model = _build(kind, pipelined=True)
        _set_every_option(model, pipelined=True)
        copy = ROUTES[route](model, tmp_path)
    assert options.options_of(copy).to_config() == options.options_of(model).to_config()
    assert [a.pipeline_stage for a in copy.get_pipeline_stage_assignment()] == [0, 1]
    # Outside the scope the config loads as a plain model (Keras ignores the key).
    plain = keras.models.model_from_json(model.to_json())
    assert not isinstance(plain, ipu.keras.extensions.ExtensionBase)
    assert {"ipu_options", "pipeline_stage_assignment", "asynchronous_callbacks"}.isdisjoint(
        plain.get_config())


def test_configs_are_laid_out_as_the_references(strategy):
    # IPU TF 2 put the keys at the top level of get_config (ported code reads them there,
    # its JSON files hold them there); a config holding them under "ipu_options" loads too.
    configure(2)
    with strategy.scope():
        model = _build("sequential", pipelined=True)
        _set_every_option(model, pipelined=True)
        config = model.get_config()
        saved = options.options_of(model).to_config()
        assert {key: config[key] for key in saved} == saved
        assert config["pipeline_stage_assignment"] == [0, 1]
        keras_keys = {k: v for k, v in config.items()
                      if k not in saved and not k.startswith("pipeline_stage_assignment")}
        nested = {**keras_keys, "ipu_options": {k: v for k, v in config.items()
                                                if k not in keras_keys}}
        for layout in (config, nested):
            copy = keras.Sequential.from_config(layout)
            assert options.options_of(copy).to_config() == saved
            assert [a.pipeline_stage for a in copy.get_pipeline_stage_assignment()] == [0, 1]


@keras.saving.register_keras_serializable("keras_ipu_tests")
class StrictFunctional(keras.Model):
    """A Functional subclass whose __init__ takes only its own config's keys."""

    def __init__(self, units=3, name=None):
        inputs = keras.Input((4,))
        super().__init__(inputs, keras.layers.Dense(units)(inputs), name=name)
        self.units = units

    def get_config(self):
        return {"units": self.units, "name": self.name}


def test_a_subclass_config_stays_its_own(strategy, tmp_path):
    # Its from_config may pass the config to __init__ (without keras_ipu there to take the
    # key out): the options travel in .keras files.
    with strategy.scope():
        model = TwoStages(units=5)
        model(np.ones((1, 6), np.float32))
        strict = StrictFunctional(units=2)
    for kind, instance in ((TwoStages, model), (StrictFunctional, strict)):
        config = instance.get_config()
        assert {"ipu_options", "pipeline_stage_assignment", "asynchronous_callbacks"}.isdisjoint(
            config)
        assert kind.from_config(config).units == instance.units


@keras.saving.register_keras_serializable("keras_ipu_tests")
class KeyedLikeOptions(keras.Model):
    """A subclass whose own config has keys named as IPU options."""

    def __init__(self, gradient_accumulation_steps_per_replica=1, asynchronous_callbacks=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.steps = gradient_accumulation_steps_per_replica
        self.asynchronous = asynchronous_callbacks
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)

    def get_config(self):
        return {**super().get_config(), "gradient_accumulation_steps_per_replica": self.steps,
                "asynchronous_callbacks": self.asynchronous}


def test_a_subclass_config_keeps_its_keys_named_as_options(strategy):
    # Only Keras' own Functional and Sequential configs carry IPU options: these keys were
    # taken out of the subclass's config (and applied as options inside a scope).
    config = KeyedLikeOptions(8, True).get_config()
    with strategy.scope():
        inside = KeyedLikeOptions.from_config(config)
    outside = KeyedLikeOptions.from_config(config)
    for model in (inside, outside):
        assert (model.steps, model.asynchronous) == (8, True)
    assert options.options_of(inside).asynchronous_callbacks is False


def test_feed_options_given_as_numpy_integers_are_saved(strategy, tmp_path):
    with strategy.scope():
        model = _functional()
        model.set_infeed_queue_options(prefetch_depth=np.int32(2), replication_factor=np.int64(1))
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    assert options.options_of(loaded).infeed_kwargs == {"prefetch_depth": 2,
                                                         "replication_factor": 1}


def test_loaded_outside_the_scope_is_a_plain_model_with_the_same_weights(strategy, tmp_path):
    # A subclassed model that opens PipelineStage scopes cannot run outside
    # an IPUStrategy (as in the reference): the other kinds can.
    with strategy.scope():
        model = _functional()
        model.save(tmp_path / "m.keras")
    plain = keras.models.load_model(tmp_path / "m.keras")
    assert not isinstance(plain, ipu.keras.extensions.FunctionalExtension)
    assert_weights_close(model.get_weights(), plain.get_weights(), atol=0)
    x = np.ones((4, 6), "float32")
    np.testing.assert_allclose(plain.predict(x, verbose=0), np.asarray(model(x)),
                               atol=1e-6)


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("setup", ["one_ipu", "replicated", "pipelined"])
def test_model_checkpoint_saves_each_epochs_weights(setup, weights_only, strategy, tmp_path):
    configure(2)
    x, y = data_for("sequential", samples=64)
    with strategy.scope():
        model = two_stage_mlp() if setup == "pipelined" else keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    if setup == "pipelined":
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    path = str(tmp_path / ("ckpt_{epoch}.weights.h5" if weights_only else "ckpt_{epoch}.keras"))
    seen = []
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(path, save_weights_only=weights_only),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: seen.append(model.get_weights()))])
    for epoch, expected in enumerate(seen, start=1):
        with strategy.scope():
            if weights_only:
                restored = keras.models.clone_model(model)
                restored.load_weights(path.format(epoch=epoch))
            else:
                restored = keras.models.load_model(path.format(epoch=epoch))
        assert_weights_close(expected, restored.get_weights(), atol=0)


def test_a_file_that_is_not_a_keras_archive_says_what_is_wrong(strategy, tmp_path):
    with strategy.scope():
        for name, content in [("text.keras", b"not a zip file"), ("empty.keras", b"")]:
            (tmp_path / name).write_bytes(content)
            with pytest.raises(ValueError, match="not a valid .keras archive"):
                keras.models.load_model(tmp_path / name)
        with zipfile.ZipFile(tmp_path / "foreign.keras", "w") as archive:
            archive.writestr("readme.txt", "a zip, but not a Keras model")
        with pytest.raises(ValueError, match="config.json"):
            keras.models.load_model(tmp_path / "foreign.keras")


def test_a_failed_save_leaves_the_previous_file_in_place(strategy, tmp_path, monkeypatch):
    x, y = data_for("sequential", samples=16)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
        target = tmp_path / "m.keras"
        model.save(target)
        good = target.read_bytes()

        def broken(*args, **kwargs):
            raise OSError("disk full")

        import keras.src.saving.saving_lib as saving_lib

        monkeypatch.setattr(saving_lib, "_save_state", broken)
        with pytest.raises(OSError, match="disk full"):
            model.save(target)
    assert target.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["m.keras"]


@pytest.mark.parametrize("name", ["m.keras", "m.weights.h5"])
def test_a_saved_file_gets_the_mode_and_the_link_a_plain_save_keeps(name, strategy, tmp_path):
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    save = {"m.keras": lambda m, path: m.save(path),
            "m.weights.h5": lambda m, path: m.save_weights(path)}[name]
    kept, link = "kept" + name.removeprefix("m"), "link" + name.removeprefix("m")
    previous = os.umask(0o022)
    try:
        for owner, saved in (("plain", plain), ("ipu", model)):
            folder = tmp_path / owner
            folder.mkdir()
            save(saved, folder / name)  # new: the umask's mode
            (folder / kept).touch()
            os.chmod(folder / kept, 0o640)
            save(saved, folder / kept)  # existing: its mode stays
            os.symlink(folder / kept, folder / link)
            save(saved, folder / link)  # through the link
    finally:
        os.umask(previous)
    for owner in ("plain", "ipu"):
        folder = tmp_path / owner
        assert os.stat(folder / name).st_mode & 0o777 == 0o644, owner
        assert os.stat(folder / kept).st_mode & 0o777 == 0o640, owner
        assert os.path.islink(folder / link), owner
    assert (tmp_path / "ipu" / kept).stat().st_size > 0
    assert sorted(os.listdir(tmp_path / "ipu")) == sorted([kept, link, name])


@pytest.mark.parametrize("refused", ["file", "folder"])
def test_where_the_user_may_not_replace_the_file_keras_writes_it_in_place(
        refused, strategy, tmp_path, monkeypatch):
    # Before: a writable file in a folder the user may not write in was refused, naming a
    # temporary file; a read-only file was replaced. (Root may write anywhere: the refusals
    # are the system's answers, given as they would be to another user.)
    from keras_ipu.keras import saving

    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    target = tmp_path / "m.keras"
    model.save(target)
    inode = target.stat().st_ino
    if refused == "file":
        monkeypatch.setattr(saving.os, "access", lambda path, mode: path != str(target))
    else:
        def no_new_file(*args):
            raise PermissionError(13, "Permission denied", str(tmp_path / ".m.keras.1.keras"))

        monkeypatch.setattr(saving, "_new_file", no_new_file)
    model.layers[0].kernel.assign(np.ones((6, 3)))
    model.save(target)
    assert target.stat().st_ino == inode  # written where it is, as Keras writes
    assert (keras.models.load_model(target).get_weights()[0] == 1).all()
    assert os.listdir(tmp_path) == ["m.keras"]


def test_an_unzipped_save_is_keras_own(strategy, tmp_path):
    with strategy.scope():
        model = _functional()
    with pytest.raises(ValueError, match=f"Received: filepath={tmp_path / 't.keras'}$"):
        model.save(tmp_path / "t.keras", zipped=False)  # the user's path, as plain Keras says
    model.save(tmp_path / "folder", zipped=False)
    assert {"config.json", "model.weights.h5", "assets"} <= set(os.listdir(tmp_path / "folder"))


def test_an_unzipped_save_to_a_relative_folder_keeps_a_subclassed_models_options(
        strategy, tmp_path, monkeypatch):
    # Keras writes a relative folder's assets into its temporary folder: the options
    # (an asset of a subclassed model) were lost (GA None after loading).
    monkeypatch.chdir(tmp_path)
    with strategy.scope():
        model = TwoStages(staged=False)
        model(np.ones((2, 6), "float32"))
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4)
        model.save("folder", zipped=False)
        loaded = keras.models.load_model("folder")
    assert options.options_of(loaded).gradient_accumulation_steps_per_replica == 4


@keras.saving.register_keras_serializable("keras_ipu_tests")
class WithVocabulary(keras.Model):
    """A subclassed model with assets of its own and a `save` that writes a sidecar file."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)
        self.vocabulary = ["<unk>"]

    def call(self, x):
        return self.dense(x)

    def save(self, filepath, *args, **kwargs):
        super().save(filepath, *args, **kwargs)
        with open(str(filepath) + ".vocabulary.txt", "w") as f:
            f.write("\n".join(self.vocabulary))

    def save_assets(self, dir_path):
        with open(os.path.join(dir_path, "vocabulary.txt"), "w") as f:
            f.write("\n".join(self.vocabulary))

    def load_assets(self, dir_path):
        with open(os.path.join(dir_path, "vocabulary.txt")) as f:
            self.vocabulary = f.read().split("\n")


def test_a_models_own_assets_and_save_override_work_as_in_plain_keras(strategy, tmp_path):
    # The IPU extension comes first in the model's classes: its saving hooks and
    # `save` hand over to the model's own (which once got a temporary path, or never ran).
    with strategy.scope():
        model = WithVocabulary()
        model(np.ones((2, 4), "float32"))
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=2)
        model.vocabulary = ["<unk>", "cat", "dog"]
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.vocabulary == ["<unk>", "cat", "dog"]
    assert options.options_of(loaded).gradient_accumulation_steps_per_replica == 2
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.keras.vocabulary.txt"]
    assert_weights_close(model.get_weights(), loaded.get_weights(), atol=0)


def test_save_and_save_weights_take_keras_positional_arguments(strategy, tmp_path):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.save_weights(tmp_path / "m.weights.h5", True, None)  # overwrite, max_shard_size
    model.save(tmp_path / "m.keras", True, None)  # overwrite, zipped
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    plain.load_weights(tmp_path / "m.weights.h5")
    assert_weights_close(model.get_weights(), plain.get_weights(), atol=0)
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.weights.h5"]


@pytest.mark.parametrize("save, name", [
    ("save_weights", "weights.h5"), ("save_weights", "model.keras"),  # not `.weights.h5`
    ("save", "missing/folder/model.keras"), ("save_weights", "missing/m.weights.h5"),
])
def test_a_bad_path_gets_plain_keras_error(save, name, strategy, tmp_path):
    # Before: the error named a temporary file, and a missing folder was made.
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    errors = []
    for each in (plain, model):
        with pytest.raises((ValueError, OSError)) as raised:
            getattr(each, save)(str(tmp_path / name))
        errors.append((type(raised.value), str(raised.value)))
    assert errors[1] == errors[0]
    assert not (tmp_path / "missing").exists()


def test_an_ipu_model_unpickled_in_a_fresh_process_is_an_ipu_model(strategy, tmp_path,
                                                                      fork_server):
    import pickle

    from conftest import fresh_process_env

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4)
    (tmp_path / "model.pickle").write_bytes(pickle.dumps(model))
    # Before: a plain Keras model, the options lost (the hooks are installed by a strategy).
    script = (
        "import pickle, keras_ipu as ipu\n"
        "config = ipu.config.IPUConfig(); config.auto_select_ipus = 1\n"
        "config.configure_ipu_system()\n"
        "model = pickle.loads(open('model.pickle', 'rb').read())\n"
        "assert isinstance(model, ipu.keras.extensions.ExtensionBase), type(model)\n"
        "options = ipu.keras.options.options_of(model)\n"
        "assert options.gradient_accumulation_steps == 4, options\n")
    status, _, stderr = fork_server.run(["-c", script], tmp_path, fresh_process_env(), 300)
    assert status == 0, stderr[-3000:]


class _WithoutConfig(keras.Model):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)


def test_a_subclassed_model_without_a_config_of_its_own_is_refused_as_in_plain_keras(tmp_path):
    # Keras' guard: a subclass whose `__init__` takes arguments must define get_config.
    # Before: the IPU model's config lacked `units`; the file was written and never loaded.
    configure(1)
    with pytest.raises(NotImplementedError) as plain:
        _WithoutConfig(3).get_config()
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = _WithoutConfig(3)
        model(np.ones((2, 4), "float32"))
        with pytest.raises(NotImplementedError) as refused:
            model.save(tmp_path / "m.keras")
    assert str(refused.value) == str(plain.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key, value, refusal", [
    ("gradient_accumulation_steps_per_replica", 0, "to be a positive integer, but got 0"),
    ("gradient_accumulation_steps_per_replica", "4", "to be a positive integer, but got '4'"),
    ("asynchronous_callbacks", "false", "`asynchronous` must be a bool, got 'false'"),
    ("replicated_metric_reduction_method", 0, "Cannot parse 0 as a ReplicatedMetricReduction"),
])
def test_a_hand_edited_config_with_a_bad_ipu_option_is_refused_as_its_setter_refuses(
        key, value, refusal, strategy):
    # Before: 0 loaded (a fit without accumulation), "4" failed in fit with a TypeError,
    # "false" loaded as True.
    with strategy.scope():
        config = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]).get_config()
        with pytest.raises((TypeError, ValueError), match=refusal) as refused:
            keras.Sequential.from_config({**config, key: value})
    assert "saved with the model" in "".join(refused.value.__notes__)


def test_a_config_whose_ipu_options_are_unset_loads_with_their_defaults(strategy):
    # A None `asynchronous_callbacks` (a foreign or hand-edited config) loaded as False
    # before the options were checked as their setters check them; it still does.
    with strategy.scope():
        config = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]).get_config()
        loaded = keras.Sequential.from_config({**config, "asynchronous_callbacks": None,
                                               "gradient_accumulation_steps_per_replica": None})
    assert options.options_of(loaded).asynchronous_callbacks is False
    assert options.options_of(loaded).gradient_accumulation_steps_per_replica is None
