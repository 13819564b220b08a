"""The IPU extension classes that models created in an `IPUStrategy` scope gain.

`SequentialExtension`, `FunctionalExtension` and `ModelExtension` give a
model the IPU behaviour of its kind: `fit`, `evaluate` and `predict` run as
executions of `steps_per_execution` steps on the IPU system. They are not
instantiated directly: creating a model inside `strategy.scope()` makes it an
instance of the right one.
"""

from __future__ import annotations

import io

from keras_ipu.keras import trainer


class ExtensionBase:
    """Behaviour shared by the three extension classes."""

    def compile(self, *args, **kwargs):
        trainer.forget_programs(self)
        return super().compile(*args, **kwargs)

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
    ):
        """Trains the model on the IPU system; same arguments as `keras.Model.fit`.

        Each execution runs `steps_per_execution` steps on the device;
        callbacks and the progress bar run once per execution with the last
        step's logs. All data checks run before any weight changes.

        Returns:
            A `History` object, as `keras.Model.fit`.

        Raises:
            RuntimeError: When no IPU system is configured, the model is not
                compiled, or it was compiled with `run_eagerly=True`.
            ValueError: For data the IPU cannot run (partial batches, a
                `steps_per_execution` that does not divide the steps, ...).
            keras_ipu.errors.IPUOutOfMemoryError: When the program does not
                fit the IPU's memory.
        """
        return trainer.fit(
            self,
            x=x,
            y=y,
            batch_size=batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=callbacks,
            validation_split=validation_split,
            validation_data=validation_data,
            shuffle=shuffle,
            class_weight=class_weight,
            sample_weight=sample_weight,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        )

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
        **kwargs,
    ):
        """Evaluates the model on the IPU system; same arguments as `keras.Model.evaluate`.

        Returns:
            The loss and metrics, as `keras.Model.evaluate`.

        Raises:
            RuntimeError: As `fit`.
            ValueError: As `fit`.
        """
        return trainer.evaluate(
            self,
            x=x,
            y=y,
            batch_size=batch_size,
            verbose=verbose,
            sample_weight=sample_weight,
            steps=steps,
            callbacks=callbacks,
            return_dict=return_dict,
            **kwargs,
        )

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Predicts on the IPU system; same arguments as `keras.Model.predict`.

        Works without `compile()` (one step per execution then).

        Returns:
            NumPy array(s) of predictions, in input order.

        Raises:
            RuntimeError: When no IPU system is configured.
            ValueError: As `fit`.
        """
        return trainer.predict(
            self, x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
        )

    def __reduce__(self):
        # The dynamic class cannot be found by name: unpickle through a
        # loader that recreates the model inside an IPUStrategy scope.
        import keras.src.saving.saving_lib as saving_lib

        from keras_ipu.keras import injection

        buffer = io.BytesIO()
        saving_lib._save_model_to_fileobj(self, buffer, "h5")
        return (injection.unpickle_model, (buffer,))


class ModelExtension(ExtensionBase):
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
        from keras.src.models.functional import Functional

        if isinstance(self, Functional):
            from keras_ipu.keras import injection

            base = type(self)._ipu_base_class
            injection.set_class(self, injection.extension_class(base, True))


class FunctionalExtension(ExtensionBase):
    """The IPU extension of Functional models (`keras.Model(inputs, outputs)`).

    Example:

    >>> with keras_ipu.IPUStrategy().scope():
    ...     model = keras.Model(inputs, outputs)
    >>> isinstance(model, keras_ipu.keras.extensions.FunctionalExtension)
    True
    """


class SequentialExtension(ExtensionBase):
    """The IPU extension of `keras.Sequential` models.

    Example:

    >>> with keras_ipu.IPUStrategy().scope():
    ...     model = keras.Sequential([keras.layers.Dense(2)])
    >>> isinstance(model, keras_ipu.keras.extensions.SequentialExtension)
    True
    """


__all__ = ["FunctionalExtension", "ModelExtension", "SequentialExtension"]
