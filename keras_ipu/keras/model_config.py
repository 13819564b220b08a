"""The IPU options in a model's config, so that every way Keras saves a model keeps them.

A `.keras` file keeps a model's IPU options (gradient accumulation,
pipelining, replication, asynchronous callbacks, feed options) and its
pipeline stage assignment as an asset. The reference also put them in the
model's `get_config`, so `to_json` / `model_from_json`, `from_config` and
legacy `.h5` files keep them too: `ipu_config` is what both carry, at the
top level of a config as the reference laid them out (a config that holds
them under `CONFIG_KEY` loads too). Keras' own `from_config` of Functional and
Sequential models ignores keys it does not know, so a model whose config
carries them still loads without keras_ipu. A subclass's (a subclassed or
a Functional subclass model's) `from_config` may pass its config to
`__init__`: its options travel in the `.keras` file only. `install` wraps
Keras' `from_config` to take the key out and, for a model made inside a
strategy scope, restore what it holds.
"""

from __future__ import annotations

import functools
from typing import Any

from keras_ipu.keras import options, stages

CONFIG_KEY = "ipu_options"
# The stage assignment's keys next to the options' (see `ipu_config`), and the keys
# the reference took out of older configs.
_STAGE_KEYS = ("pipeline_stage_assignment", "pipeline_stage_assignment_valid")
_LEGACY_KEYS = ("experimental_gradient_accumulation_normalize_gradients",
                "experimental_pipelining_normalize_gradients")


def ipu_config(model: Any) -> dict[str, Any]:
    """A model's IPU options and stage assignment, as JSON-ready data.

    Args:
        model: A model made inside an `IPUStrategy` scope.

    Returns:
        The options' saved form and the assignment's.

    Example:

    >>> ipu_config(model)["gradient_accumulation_steps_per_replica"]
    4
    """
    return {**options.options_of(model).to_config(), **stages.assignment_to_config(model)}


def restore(model: Any, config: dict[str, Any]) -> None:
    """Sets the options and stage assignment `ipu_config` saved.

    Args:
        model: The loaded model, made inside an `IPUStrategy` scope.
        config: What `ipu_config` returned.

    Raises:
        ValueError: When the saved assignment does not match the model.

    Example:

    >>> restore(loaded, ipu_config(model))
    """
    options.set_options(model, options.IPUOptions.from_config(config))
    stages.assignment_from_config(model, config)


def carries_options(model: Any) -> bool:
    """Whether `model.get_config()` carries the IPU options (see the module docstring)."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    # Only Keras' own classes: a subclass's from_config may pass its config to its
    # __init__, which would get the key when keras_ipu is not there to take it out.
    base = getattr(type(model), "_ipu_base_class", type(model))
    return base in (Functional, Sequential)


def install() -> None:
    """Makes Keras' `from_config` of models restore the options a config carries.

    Idempotent. Outside a strategy scope the key is only taken out.

    Example:

    >>> install()
    """
    from keras.src.models.model import Model
    from keras.src.models.sequential import Sequential

    for cls in (Model, Sequential):
        original = cls.__dict__["from_config"]
        if not getattr(original.__func__, "_keras_ipu_restoring", False):
            cls.from_config = classmethod(_restoring(original.__func__))


def split_config(cls: type, config: Any) -> tuple[dict[str, Any] | None, Any]:
    """`(the IPU options and assignment a model config carries or None, Keras' config)`.

    Only the configs of Keras' own Functional and Sequential models carry them
    (see `carries_options`): a subclass's config is its own, whatever its keys.

    Args:
        cls: The class whose `from_config` takes the config.
        config: The model config.

    Returns:
        The saved IPU options and stage assignment (`None` when there are
        none), and the config without them.

    Example:

    >>> saved, keras_config = split_config(keras.Sequential, model.get_config())
    >>> saved["gradient_accumulation_steps_per_replica"]
    4
    """
    if not isinstance(config, dict) or not _carrying_class(cls, config):
        return None, config
    ipu_keys = {*options.IPUOptions().to_config(), *_STAGE_KEYS, *_LEGACY_KEYS, CONFIG_KEY}
    saved = {key: config[key] for key in ipu_keys & config.keys()}
    if not saved:
        return None, config
    nested = saved.pop(CONFIG_KEY, None) or {}  # an earlier layout
    saved = {**saved, **nested}
    return saved, {key: value for key, value in config.items() if key not in ipu_keys}


def _carrying_class(cls: type, config: dict) -> bool:
    from keras.src.models.functional import Functional
    from keras.src.models.model import Model
    from keras.src.models.sequential import Sequential

    base = getattr(cls, "_ipu_base_class", cls)
    # `keras.Model.from_config` of a functional config makes a Functional model.
    return base in (Functional, Sequential) or (base is Model and "input_layers" in config)


def _restoring(from_config: Any) -> Any:
    @functools.wraps(from_config)
    def restoring(cls, config, custom_objects=None):
        saved, config = split_config(cls, config)
        model = from_config(cls, config, custom_objects=custom_objects)
        # Made inside a strategy scope: an IPU model (its class an extension's).
        if saved is not None and hasattr(type(model), "_ipu_base_class"):
            restore(model, saved)
        return model

    restoring._keras_ipu_restoring = True
    return restoring


__all__ = ["CONFIG_KEY", "carries_options", "install", "ipu_config", "restore", "split_config"]
