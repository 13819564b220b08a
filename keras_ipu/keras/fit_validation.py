"""A `fit`'s validation: its feed and run, made before training or at the first validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_ipu.keras.data import FeedPlan


class FitValidation:
    """The feed and the prepared run of a `fit`'s validation data.

    Made before training, so that the data is checked and the program
    compiled before any weight changes; but a Python generator's are made at
    the first validation, as plain Keras makes its validation iterator: Keras'
    adapter takes a generator's first batches as it is made, and their draws
    from the global random state would come before the training's shuffle
    (another order than plain Keras'). Its plan is known before (it needs
    `validation_steps`), so every check that needs only the plan still runs
    first.

    Args:
        make_feed: Makes the feed (`data.make_feed` of the validation data).
        prepare: `prepare(feed) -> Run`, the evaluate program for it.
        deferred_plan: The plan of a generator's data (`data.plan_before_reading`):
            the feed and run are made when first asked for; `None` makes the
            feed now.

    Example:

    >>> validation = FitValidation(lambda: data.make_feed(x, y, role="validation"),
    ...                            lambda feed: programs.prepare(model, "evaluate", ...))
    >>> run, feed = validation.prepared()
    """

    def __init__(self, make_feed: Callable[[], Any], prepare: Callable[[Any], Any],
                 deferred_plan: FeedPlan | None = None):
        self._make_feed, self._prepare = make_feed, prepare
        self.feed: Any = None
        self.run: Any = None
        self.plan = deferred_plan
        if deferred_plan is None:
            self._make()

    @property
    def deferred(self) -> bool:
        """Whether the feed and run wait for the first validation."""
        return self.feed is None

    def prepared(self) -> tuple[Any, Any]:
        """`(run, feed)`, made now where they were not yet.

        Raises:
            ValueError: As `data.make_feed` and `programs.prepare`.
        """
        if self.feed is None:
            self._make()
        if self.run is None:
            self.run = self._prepare(self.feed)
        return self.run, self.feed

    def close(self) -> None:
        """Closes the feed, if it was made."""
        if self.feed is not None:
            self.feed.close()

    def _make(self) -> None:
        self.feed = self._make_feed()
        self.plan = self.feed.plan


def validation_split(x: Any, y: Any, sample_weight: Any, split: float) -> tuple:
    """Splits array data into training and validation parts, as Keras does.

    Args:
        x, y, sample_weight: The arrays `fit` was given.
        split: The fraction of the data kept for validation (the last rows).

    Returns:
        `((x, y, sample_weight), (x, y, sample_weight))`: training, validation.

    Raises:
        ValueError: For a `split` outside [0, 1] (Keras would make an empty part
            and train on without saying so), or too little data (Keras' error).

    Example:

    >>> (train, validation) = validation_split(x, y, None, 0.25)
    """
    from keras.src.trainers.data_adapters import array_slicing

    if not 0 <= split <= 1:
        raise ValueError(f"`validation_split` is the fraction of the data kept for validation, "
                         f"between 0 and 1: received {split}.")

    return array_slicing.train_validation_split((x, y, sample_weight), validation_split=split)


__all__ = ["FitValidation", "validation_split"]
