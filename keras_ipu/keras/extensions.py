"""The IPU extension classes, and the `Model.__new__` hook that gives models them.

`SequentialExtension`, `FunctionalExtension` and `ModelExtension` give a
model the IPU behaviour of its kind: `fit`, `evaluate` and `predict` run as
executions of `steps_per_execution` steps on the IPU system. They are not
instantiated directly: creating a model inside `strategy.scope()` makes it an
instance of the right one.

Every Keras model is created through `Model.__new__`. In a strategy scope the
hook (`install`) swaps the new instance's class for a subclass that puts the
matching extension first in the MRO, so its `fit`, `evaluate` and `predict`
win. The dynamic class hides behind a `__class__` property so that Keras
serialization records the user's class; pickling goes through the base class.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
from typing import Any

from keras.src.backend.jax.trainer import JAXTrainer
from keras.src.models import model as keras_model_module
from keras.src.models.functional import Functional
from keras.src.models.model import Model, functional_init_arguments
from keras.src.models.sequential import Sequential
from keras.src.utils import python_utils

from keras_ipu.device import interrupts
from keras_ipu.keras import (
    context,
    fit_checks,
    model_config,
    options,
    run,
    saving,
    stages,
    traceable_layers,
    trainer,
)
from keras_ipu.keras.assignments import outside_traces
from keras_ipu.keras.batch_steps import on_this_instance
from keras_ipu.keras.options import ReplicatedMetricReductionMethod
from keras_ipu.keras.stages import (
    FunctionalLayerPipelineStageAssignment,
    FunctionalNestedModelPipelineStageAssignment,
    FunctionalPipelineMixin,
    ModelLayerPipelineStageAssignment,
    ModelPipelineMixin,
    NestedModelPipelineStageAssignment,
    SequentialLayerPipelineStageAssignment,
    SequentialNestedModelPipelineStageAssignment,
    SequentialPipelineMixin,
)
from keras_ipu.keras.tracebacks import user_frames_only

_ASSET_FILE = "ipu_options.json"


class ExtensionBase:
    """Behaviour shared by the three extension classes."""

    def compile(self, *args, **kwargs):
        # A bad `steps_per_execution` is refused here, not at the first fit.
        args, kwargs = fit_checks.compile_arguments(super().compile, args, kwargs)
        self.jax_state_sync()  # called by a callback during a run: the device's state first
        run.forget_programs(self, recompiled=True)
        return super().compile(*args, **kwargs)

    def set_gradient_accumulation_options(
        self,
        gradient_accumulation_steps_per_replica=None,
        gradient_accumulation_reduction_method="sum",
        use_v2_gradient_accumulation_optimizer=False,
        **gradient_accumulation_optimizer_kwargs,
    ):
        """Sets gradient accumulation for training (non-pipelined models).

        Each replica runs `gradient_accumulation_steps_per_replica`
        micro-batches per weight update inside the on-device loop; the
        optimizer (its iteration count, learning-rate schedule, weight decay
        and clipping) runs once per update, on the reduced gradients.
        Non-trainable state such as BatchNormalization statistics still
        updates every micro-batch. `evaluate` and `predict` ignore it.

        Args:
            gradient_accumulation_steps_per_replica: Micro-batches per weight
                update on each replica; `steps_per_execution` must be
                divisible by it. `None` keeps the current value. Saved with
                the model.
            gradient_accumulation_reduction_method: `"sum"` (default),
                `"mean"` or `"running_mean"` (any case), or a
                `keras_ipu.gradient_accumulation.GradientAccumulationReductionMethod`.
                Every call sets it (to SUM when omitted). Saved with the model.
            use_v2_gradient_accumulation_optimizer: A bool, accepted for
                compatibility; there is one accumulation implementation.
            **gradient_accumulation_optimizer_kwargs: `dtype`: the
                accumulator dtype: each variable's own by default (`None`),
                `"float32"`, `"float16"` or `"bfloat16"` for all, or a
                function of the variable that gives its accumulator's dtype.
                `offload_weight_update_variables`,
                `replicated_optimizer_state_sharding` and `name` are accepted
                and have no effect on the device model. Not saved.

        Raises:
            ValueError: For a step count that is not a positive integer, an
                unknown reduction method, the refused keys `opt`,
                `num_mini_batches` and `experimental_normalize_gradients`, an
                unknown key or dtype.
            TypeError: When `use_v2_gradient_accumulation_optimizer` is not
                a bool.

        Example:

        >>> model.compile(optimizer="sgd", loss="mse", steps_per_execution=16)
        >>> model.set_gradient_accumulation_options(
        ...     gradient_accumulation_steps_per_replica=4,
        ...     gradient_accumulation_reduction_method="mean")
        """
        new = options.gradient_accumulation_options(
            options.options_of(self),
            gradient_accumulation_steps_per_replica,
            gradient_accumulation_reduction_method,
            use_v2_gradient_accumulation_optimizer,
            gradient_accumulation_optimizer_kwargs,
        )
        run.change_options(self, new)

    def set_pipelining_options(
        self,
        gradient_accumulation_steps_per_replica=None,
        device_mapping=None,
        accumulate_outfeed=None,
        gradient_accumulation_reduction_method="sum",
        **pipelining_kwargs,
    ):
        """Sets the pipelining options of a pipelined model.

        Args:
            gradient_accumulation_steps_per_replica: Micro-batches per weight
                update. `fit` needs it, except with
                `pipeline_schedule=PipelineSchedule.Sequential`, where each
                batch is one weight update. `None` keeps the current value.
                Saved with the model.
            device_mapping: One IPU index per pipeline stage (default stage
                `i` on IPU `i`); stages that share layers must share an IPU.
                `None` keeps the current mapping. Saved with the model.
            accumulate_outfeed: Accumulate the metrics on the device and
                return them once per weight update. Saved with the model.
            gradient_accumulation_reduction_method: As in
                `set_gradient_accumulation_options` (the same setting).
            **pipelining_kwargs: Options of `pipelining_ops.pipeline`:
                `pipeline_schedule` (a
                `keras_ipu.pipelining_ops.PipelineSchedule`),
                `recomputation_mode` (a `RecomputationMode`; only with
                `IPUConfig.allow_recompute`),
                `gradient_accumulation_dtype`, and the offload and Poplar
                options, which are accepted without effect on the device
                model. Replaced on every call; not saved.

        Raises:
            ValueError: For bad steps, mapping or reduction method, and for
                kwargs that have an argument of their own, are set by Keras,
                do not work with Keras, or are unknown.
            TypeError: When `accumulate_outfeed` is not a bool, or a Poplar
                option is not a `PipelineStageOptions` (a list of them per stage).
            NotImplementedError: For `continuous_weight_updates=True`.

        Example:

        >>> model.set_pipelining_options(
        ...     gradient_accumulation_steps_per_replica=16,
        ...     pipeline_schedule=keras_ipu.pipelining_ops.PipelineSchedule.Interleaved)
        """
        new = options.pipelining_options(
            options.options_of(self), gradient_accumulation_steps_per_replica, device_mapping,
            accumulate_outfeed, gradient_accumulation_reduction_method,
            pipelining_kwargs,
        )
        run.change_options(self, new)

    def set_replication_options(self, replicated_metric_reduction_method="NONE"):
        """Sets how the loss and metrics of the replicas are returned.

        Args:
            replicated_metric_reduction_method: `"NONE"` (the last replica's
                values), `"LIST"`, `"SUM"` or `"MEAN"` (any case), or a
                `keras_ipu.keras.ReplicatedMetricReductionMethod`.
                Predictions are never reduced. Saved with the model.

        Raises:
            ValueError: For an unknown method, listing the valid ones.

        Example:

        >>> model.set_replication_options("mean")
        """
        method = replicated_metric_reduction_method  # in the programs' key: not mid-run
        run.change_options(self, options.replication_options(options.options_of(self), method))

    def set_asynchronous_callbacks(self, asynchronous=False):
        """Sets whether batch callbacks run for every step while the device runs.

        With `True`, `fit`, `evaluate` and `predict` stream each step's logs
        (or predictions) out of the on-device loop as it runs, and the batch
        callbacks and the progress bar get every step, in step order, on a
        host thread of their own (`keras_ipu-callbacks`), while the device
        goes on. With replication each step is reported once per replica
        (logs reduced as `set_replication_options` says; `"NONE"`: each replica's own).
        A pipelined model streams its micro-batches once per weight update
        when training, and with the execution when evaluating or predicting.
        With `False` (the default) callbacks run once per execution with its
        last step's logs. Saved with the model.

        Args:
            asynchronous: Whether callbacks run for every step.

        Raises:
            TypeError: When `asynchronous` is not a bool.

        Example:

        >>> model.compile(optimizer="sgd", loss="mse", steps_per_execution=16)
        >>> model.set_asynchronous_callbacks(True)
        >>> model.fit(x, y, batch_size=4, callbacks=[my_per_batch_callback])
        """
        current = options.options_of(self)  # a program streams its steps or not: not mid-run
        run.change_options(self, options.asynchronous_callbacks_option(current, asynchronous))

    def set_infeed_queue_options(self, **kwargs):
        """Sets the options of the infeed that moves the data to the IPUs.

        `prefetch_depth` is how many executions' inputs are prepared and
        staged on the device ahead of the running one (default 2), on a host
        thread, so a slow `PyDataset` or generator overlaps with the device's
        work. `data_to_prefetch`, `feed_name`, `device_ordinal` and
        `replication_factor` are accepted for ported code and have no
        effect. Each call replaces the previous options. Saved with the model.

        Args:
            **kwargs: The options, as for the reference's `IPUInfeedQueue`.

        Raises:
            ValueError: For `dataset`, `infeed_spec` and `element_spec` (set
                by Keras), an unknown key (naming the closest valid one), or
                a `prefetch_depth` that is not an integer from 1 to 255.

        Example:

        >>> model.set_infeed_queue_options(prefetch_depth=2)
        """
        self._set_feed_options(infeed=kwargs)

    def set_outfeed_queue_options(self, **kwargs):
        """Sets the options of the outfeed that brings the step results to the host.

        `buffer_depth` is how many steps of results the device holds before
        the host must take them; it matters with asynchronous callbacks,
        where the device sends its steps' results in chunks of at most that
        many steps (a divisor of `steps_per_execution`; by default about a
        fifth of an execution) while it runs. Smaller chunks reach the
        callbacks sooner; each costs a host transfer. `feed_name`,
        `replication_factor` and `io_batch_size` are accepted for ported
        code and have no effect. Each call replaces the previous options.
        Saved with the model.

        Args:
            **kwargs: The options, as for the reference's `IPUOutfeedQueue`.

        Raises:
            ValueError: For `outfeed_mode` and `device_ordinal` (not
                compatible with Keras), an unknown key (naming the closest
                valid one), or a `buffer_depth` that is not an integer from
                1 to 255.

        Example:

        >>> model.set_outfeed_queue_options(buffer_depth=2)
        """
        self._set_feed_options(outfeed=kwargs)

    def _set_feed_options(self, **feeds):
        run.change_options(self, options.feed_queue_options(options.options_of(self), **feeds))

    def export_for_ipu_serving(self, export_dir, batch_size=None, output_names=None,
                               preprocessing_step=None, preprocessing_step_signature=None,
                               postprocessing_step=None, postprocessing_step_signature=None,
                               purge_export_dir=False, platforms=None):
        """Exports the model's inference program for serving.

        Writes `export_dir`: the program for a fixed batch size as serialized
        StableHLO (`jax.export`), once for one batch per call and once as a
        loop of `steps_per_execution` batches (from `compile()`), the
        weights (a NumPy archive), and the signatures and metadata. Load it
        with `keras_ipu.serving.load` (no Keras needed) or run it with
        `keras-ipu run`.

        Args:
            export_dir: An empty (or missing) directory.
            batch_size: The batch size (needed when the inputs do not fix it).
            output_names: A name, or one per output (default `output_0`, ...;
                a dict of outputs is served under its keys, renamed in its order).
            preprocessing_step: A JAX-traceable function of the inputs, run
                before the model inside the exported program.
            preprocessing_step_signature: The inputs of
                `preprocessing_step`, which become the export's: specs with a
                `shape` (a leading `None` is the batch size) and a `dtype`
                (`jax.ShapeDtypeStruct`, `keras.Input`, `tf.TensorSpec`). Without
                it, the export takes the model's inputs.
            postprocessing_step: A JAX-traceable function of the outputs.
            postprocessing_step_signature: Accepted for ported code (the
                outputs' signature is traced from the program).
            purge_export_dir: Empty a non-empty `export_dir` first.
            platforms: Platforms the export runs on (default: this one),
                e.g. `("cpu", "cuda")`.

        Returns:
            The export's `keras_ipu.serving.ServingRuntime`: call it with one
            batch.

        Raises:
            ValueError: Model not created in an IPUStrategy, unknown batch
                size, non-empty directory without `purge_export_dir`.
            RuntimeError: Model not built.

        Example:

        >>> runtime = model.export_for_ipu_serving("my_export", batch_size=1)
        >>> runtime(np.ones((1, 4), "float32"))
        """
        from keras_ipu.keras import export

        return export.export_model(self, export_dir, batch_size, output_names,
                                   preprocessing_step, postprocessing_step, purge_export_dir,
                                   platforms,
                                   preprocessing_step_signature=preprocessing_step_signature)

    def _pipeline_assignment_changed(self):
        # Called by the stage assignment methods: compiled programs are stale.
        run.forget_programs(self)

    def jax_state_sync(self):
        # Ctrl-C waits (cut short, the variables stay purged); eager in a trace (strategy.run).
        with interrupts.deferred(), outside_traces():
            trainer.sync_pending_state(self)
            return super().jax_state_sync()

    def get_config(self):
        """Keras' config, with the IPU options where Keras' `from_config` can take them."""
        config = super().get_config()
        if model_config.carries_options(self):
            config = {**config, **model_config.ipu_config(self)}  # the reference's layout
        if options.options_of(self).pipelining_kwargs:
            trainer.logger.info(  # the reference's message: they are not in the config
                "Calling get_config() on %s - `pipelining_kwargs` cannot be serialized and "
                "you will need to call `set_pipelining_options` again if the model is "
                "restored.", self.name)
        return config

    def save_assets(self, dir_path):
        """Saves the IPU options into the `.keras` file (Keras saving hook), then the
        model class's own assets, if it saves any."""
        with open(os.path.join(dir_path, _ASSET_FILE), "w") as f:
            json.dump(model_config.ipu_config(self), f)
        own = getattr(super(), "save_assets", None)
        if own is not None:
            own(dir_path)

    def load_assets(self, dir_path):
        """Restores the IPU options saved by `save_assets` (Keras loading hook), then the
        model class's own assets, if it loads any."""
        path = os.path.join(dir_path, _ASSET_FILE)
        if os.path.exists(path):
            with open(path) as f:
                model_config.restore(self, json.load(f))
        own = getattr(super(), "load_assets", None)
        if own is not None:
            own(dir_path)

    @user_frames_only
    def fit(self, *args, **kwargs):
        """Trains the model on the IPU system; same arguments as `keras.Model.fit`.

        Each execution runs `steps_per_execution` steps on the device;
        callbacks and the progress bar run once per execution with the last
        step's logs. All data checks run before any weight changes. An
        override of `fit` in the model's class runs first, as in plain Keras;
        its `super().fit(...)` trains on the IPUs.

        Args:
            *args: `keras.Model.fit`'s positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            A `History` object, as `keras.Model.fit`.

        Raises:
            RuntimeError: When no IPU system is configured, or the model was
                compiled with `run_eagerly=True`.
            ValueError: When the model is not compiled, or for data the IPU
                cannot run (partial batches, a `steps_per_execution` that
                does not divide the steps, ...).
            keras_ipu.errors.IPUOutOfMemoryError: When the program does not
                fit the IPU's memory.

        Example:

        >>> history = model.fit(x, y, batch_size=8, epochs=2)
        """
        # Through Keras' `fit`, which runs on the IPUs for this model: an override of
        # `fit` in the model's own class runs first and sees the caller's arguments.
        return super().fit(*args, **kwargs)

    @user_frames_only
    def evaluate(self, *args, **kwargs):
        """Evaluates the model on the IPU system; same arguments as `keras.Model.evaluate`.

        Args:
            *args: `keras.Model.evaluate`'s positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            The loss and metrics, as `keras.Model.evaluate`.

        Raises:
            RuntimeError: As `fit`.
            ValueError: As `fit`.

        Example:

        >>> loss = model.evaluate(x, y, batch_size=8)
        """
        return super().evaluate(*args, **kwargs)

    @user_frames_only
    def predict(self, *args, **kwargs):
        """Predicts on the IPU system; same arguments as `keras.Model.predict`.

        Works without `compile()` (one step per execution then).

        Args:
            *args: `keras.Model.predict`'s positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            NumPy array(s) of predictions, in input order.

        Raises:
            RuntimeError: When no IPU system is configured, or the model was
                compiled with `run_eagerly=True`.
            ValueError: For data the IPU cannot run, as `fit`.

        Example:

        >>> predictions = model.predict(x, batch_size=8)
        """
        return super().predict(*args, **kwargs)

    def __reduce__(self):
        # The dynamic class cannot be found by name: unpickle through a
        # loader that recreates the model inside an IPUStrategy scope.
        import keras.src.saving.saving_lib as saving_lib

        buffer = io.BytesIO()
        saving_lib._save_model_to_fileobj(self, buffer, "h5")
        return (_unpickle_model, (buffer, context.state_of(self).strategy))


def _unpickle_model(buffer: Any, strategy: Any) -> Model:
    """Loads a pickled IPU model in its strategy's scope (in another process: hooks first)."""
    install()
    scope = context.strategy_scope(strategy) if strategy is not None else contextlib.nullcontext()
    with scope:
        return keras_model_module.Model._unpickle_model(buffer)


class ModelExtension(ModelPipelineMixin, ExtensionBase):
    """The IPU extension of subclassed `keras.Model`s.

    Example:

    >>> with keras_ipu.IPUStrategy().scope():
    ...     model = MyModel()   # class MyModel(keras.Model)
    >>> isinstance(model, keras_ipu.keras.extensions.ModelExtension)
    True
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A subclass that calls the functional constructor becomes Functional
        # during __init__: it then takes the Functional extension.
        if isinstance(self, Functional):
            set_class(self, extension_class(type(self)._ipu_base_class, True))
            stages.check_scope_stages(self)  # as FunctionalExtension.__init__

    def __call__(self, *args, **kwargs):
        # The dtypes it is called with are the export's: it has no keras.Input to say them.
        context.record_called_dtypes(self, args[0] if args else kwargs.get("inputs"))
        return super().__call__(*args, **kwargs)


class FunctionalExtension(FunctionalPipelineMixin, ExtensionBase):
    """The IPU extension of Functional models (`keras.Model(inputs, outputs)`).

    Example:

    >>> with keras_ipu.IPUStrategy().scope():
    ...     model = keras.Model(inputs, outputs)
    >>> isinstance(model, keras_ipu.keras.extensions.FunctionalExtension)
    True
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # As the reference: scopes that staged only some calls fail at construction.
        stages.check_scope_stages(self)


class SequentialExtension(SequentialPipelineMixin, ExtensionBase):
    """The IPU extension of `keras.Sequential` models.

    Example:

    >>> with keras_ipu.IPUStrategy().scope():
    ...     model = keras.Sequential([keras.layers.Dense(2)])
    >>> isinstance(model, keras_ipu.keras.extensions.SequentialExtension)
    True
    """


# --------------------------------------------------------------------------
# The `Model.__new__` hook.

# First match wins: a Functional-constructed Model subclass is Functional.
_EXTENSION_FOR = (
    (Sequential, SequentialExtension),
    (Functional, FunctionalExtension),
    (Model, ModelExtension),
)
_OBJECT_CLASS_SLOT = object.__dict__["__class__"]
# The `Model.__new__` that `install` replaced, once it has.
_original_new: list[Any] = []


def install() -> None:
    """Installs the `Model.__new__` hook and the `PipelineStage` recording (idempotent).

    Outside every strategy scope the hook changes nothing.

    Example:

    >>> install()
    >>> install()  # a second call changes nothing
    """
    if not _original_new:
        _original_new.append(Model.__dict__["__new__"])
        Model.__new__ = staticmethod(_new_model)
    _route_trainer_methods()
    # PipelineStage scopes record stages on the layers and calls they see.
    stages.install()
    # Inside a scope, a bad .keras file is named for what is wrong with it; an IPU
    # model's files are replaced whole.
    saving.install(lambda model: isinstance(model, ExtensionBase))
    # Configs (JSON, from_config, .h5) carry the IPU options too.
    model_config.install()
    # Layers Keras runs eagerly compile in an IPU program, as in IPU TensorFlow.
    traceable_layers.install()


def _fit_on_ipus(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
                 callbacks=None, validation_split=0.0, validation_data=None, shuffle=True,
                 class_weight=None, sample_weight=None, initial_epoch=0, steps_per_epoch=None,
                 validation_steps=None, validation_batch_size=None, validation_freq=1):
    with context.model_scope(model):
        return trainer.fit(
            model, x=x, y=y, batch_size=batch_size, epochs=epochs, verbose=verbose,
            callbacks=callbacks, validation_split=validation_split,
            validation_data=validation_data, shuffle=shuffle, class_weight=class_weight,
            sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq)


def _evaluate_on_ipus(model, x=None, y=None, batch_size=None, verbose="auto",
                      sample_weight=None, steps=None, callbacks=None, return_dict=False,
                      **kwargs):
    with context.model_scope(model):
        return trainer.evaluate(
            model, x=x, y=y, batch_size=batch_size, verbose=verbose,
            sample_weight=sample_weight, steps=steps, callbacks=callbacks,
            return_dict=return_dict, **kwargs)


def _predict_on_ipus(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    with context.model_scope(model):
        return trainer.predict(model, x, batch_size=batch_size, verbose=verbose, steps=steps,
                               callbacks=callbacks)


# Keras' own `fit`, `evaluate` and `predict`, which an IPU model reaches through `super()`
# (from the extension, or from an override in the model's class) and which run it on the
# IPUs; other models get Keras' methods unchanged.
_original_trainer_methods: dict = {}


_ON_IPUS = {"fit": _fit_on_ipus, "evaluate": _evaluate_on_ipus, "predict": _predict_on_ipus,
            **{name: on_this_instance(name, _original_trainer_methods)
               for name in ("train_on_batch", "test_on_batch", "predict_on_batch")}}


def _route_trainer_methods() -> None:
    for name, on_ipus in _ON_IPUS.items():
        if name not in _original_trainer_methods:
            original = JAXTrainer.__dict__[name]
            _original_trainer_methods[name] = original
            # A wrong keyword's TypeError names the method called, as in Keras.
            on_ipus.__qualname__ = original.__qualname__
            setattr(JAXTrainer, name, _routed(original, on_ipus))


def _routed(original: Any, on_ipus: Any) -> Any:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if isinstance(self, ExtensionBase):
            return on_ipus(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return method


def _new_model(cls, *args, **kwargs):
    obj = _original_new[0].__func__(cls, *args, **kwargs)
    strategy = context.current_strategy()
    if strategy is None or not strategy.enable_keras_extensions or isinstance(obj, ExtensionBase):
        return obj
    functional = functional_init_arguments(args, kwargs)
    set_class(obj, extension_class(type(obj), functional))
    context.state_of(obj).strategy = strategy
    return obj


def set_class(obj: Any, cls: type) -> None:
    """Sets the real type of `obj`, bypassing the `__class__` property.

    Example:

    >>> set_class(model, extension_class(type(model)))
    """
    _OBJECT_CLASS_SLOT.__set__(obj, cls)


def extension_for(cls: type, functional: bool = False) -> type:
    """The extension class for a model class (`functional`: built from inputs/outputs).

    Example:

    >>> extension_for(keras.Sequential)
    <class 'keras_ipu.keras.extensions.SequentialExtension'>
    """
    if functional and not issubclass(cls, Sequential):
        return FunctionalExtension
    return next(ext for base, ext in _EXTENSION_FOR if issubclass(cls, base))


@functools.cache
def extension_class(cls: type, functional: bool = False) -> type:
    """The dynamic class `(Extension, cls)` used for IPU instances of `cls`.

    Example:

    >>> extension_class(keras.Sequential).__mro__[1]
    <class 'keras_ipu.keras.extensions.SequentialExtension'>
    """
    extension = extension_for(cls, functional)
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "_ipu_base_class": cls,
                 # Keras serialization records obj.__class__: show the user's class.
                 "__class__": property(lambda self: type(self)._ipu_base_class)}
    if python_utils.is_default(cls.get_config):  # Keras' guard: no config of its own
        namespace["get_config"] = python_utils.default(
            lambda self: ExtensionBase.get_config(self))
    return type(cls.__name__, (extension, cls), namespace)


# IPU TensorFlow's `keras.extensions` package exports these too.
__all__ = [
    "FunctionalExtension", "FunctionalLayerPipelineStageAssignment",
    "FunctionalNestedModelPipelineStageAssignment", "ModelExtension",
    "ModelLayerPipelineStageAssignment", "NestedModelPipelineStageAssignment",
    "ReplicatedMetricReductionMethod", "SequentialExtension",
    "SequentialLayerPipelineStageAssignment", "SequentialNestedModelPipelineStageAssignment",
]
