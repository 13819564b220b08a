"""Layers called as IPU TensorFlow's are: their arguments by position."""

from __future__ import annotations


class PositionalArguments:
    """A layer mixin: the call's arguments named in `_POSITIONAL` may come by position.

    IPU TensorFlow's layers take them so (`layer(x, training)`), where Keras
    layers take only tensors by position, or others in that place.

    Example:

    >>> class Dropout(PositionalArguments, keras.layers.Dropout):
    ...     pass
    >>> Dropout(0.5)(x, True)  # training
    """

    _POSITIONAL: tuple[str, ...] = ("training",)

    def __call__(self, inputs, *args, **kwargs):
        names = self._POSITIONAL
        if len(args) > len(names):
            raise TypeError(f"{self.name}: called with {1 + len(args)} positional arguments; "
                            f"the IPU layer takes (inputs, {', '.join(names)}), the rest by "
                            f"name.")
        named = dict(zip(names, args))
        clash = sorted(named.keys() & kwargs.keys())
        if clash:
            raise TypeError(f"{self.name}: {clash[0]!r} given positionally and by name.")
        return super().__call__(inputs, **named, **kwargs)


__all__ = ["PositionalArguments"]
