"""Tiny models and data for the tests, built identically inside and outside a strategy."""

from __future__ import annotations

import keras
import numpy as np


class SubclassedMLP(keras.Model):
    """A subclassed model with two Dense layers and a BatchNormalization."""

    def __init__(self, units: int = 8, outputs: int = 3, norm: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.outputs_ = outputs
        self.use_norm = norm
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.norm = keras.layers.BatchNormalization() if norm else None
        self.head = keras.layers.Dense(outputs)

    def call(self, inputs, training=False):
        hidden = self.hidden(inputs)
        if self.norm is not None:
            hidden = self.norm(hidden, training=training)
        return self.head(hidden)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "outputs": self.outputs_,
                "norm": self.use_norm}


def sequential(features: int = 6, units: int = 8, outputs: int = 3) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(outputs),
        ]
    )


def functional_two_in_two_out() -> keras.Model:
    a = keras.Input((5,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(8, activation="tanh")(h)
    out_a = keras.layers.Dense(2, name="out_a")(h)
    out_b = keras.layers.Dense(1, name="out_b")(h)
    return keras.Model({"a": a, "b": b}, {"out_a": out_a, "out_b": out_b})


def subclassed(features: int = 6, norm: bool = True) -> keras.Model:
    model = SubclassedMLP(norm=norm)
    model(np.zeros((1, features), "float32"))  # creates the weights
    return model


def four_layer_mlp() -> keras.Model:
    """6 features -> three Dense(8) (relu, tanh, relu) -> Dense(3): one layer per stage of 4."""
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(3),
    ])


def two_stage_mlp() -> keras.Model:
    """Dense(8, relu) then Dense(3), one layer per pipeline stage (create it in a scope)."""
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(3),
    ])
    model.set_pipeline_stage_assignment([0, 1])
    return model


BUILDERS = {
    "sequential": sequential,
    "functional": functional_two_in_two_out,
    "subclassed": subclassed,
    # Batch statistics depend on the batch size: no big-batch equivalence.
    "subclassed_no_norm": lambda: subclassed(norm=False),
}


class ArrayBatches(keras.utils.PyDataset):
    """Array data as a `PyDataset` of `batch_size` batches, in order."""

    def __init__(self, x, y, batch_size: int, **kwargs):
        super().__init__(**kwargs)  # workers, use_multiprocessing, max_queue_size
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def data_for(kind: str, samples: int = 64, seed: int = 0):
    """(x, y) for a model kind: dicts for the two-input, two-output model."""
    rng = np.random.default_rng(seed)
    if kind == "functional":
        x = {"a": rng.normal(size=(samples, 5)), "b": rng.normal(size=(samples, 3))}
        y = {"out_a": rng.normal(size=(samples, 2)), "out_b": rng.normal(size=(samples, 1))}
        return (
            {k: v.astype("float32") for k, v in x.items()},
            {k: v.astype("float32") for k, v in y.items()},
        )
    x = rng.normal(size=(samples, 6)).astype("float32")  # every single-input kind
    y = rng.normal(size=(samples, 3)).astype("float32")
    return x, y


def compile_args(
    kind: str, steps_per_execution: int = 1, optimizer: str = "adam", learning_rate=None
) -> dict:
    optimizers = {
        "adam": lambda: keras.optimizers.Adam(learning_rate or 0.01),
        "sgd": lambda: keras.optimizers.SGD(learning_rate or 0.05, momentum=0.9),
    }
    loss = {"out_a": "mse", "out_b": "mae"} if kind == "functional" else "mse"
    metrics = {"out_a": ["mae"], "out_b": ["mse"]} if kind == "functional" else ["mae"]
    return dict(
        optimizer=optimizers[optimizer](),
        loss=loss,
        metrics=metrics,
        steps_per_execution=steps_per_execution,
    )


def pair(kind: str, strategy):
    """A plain Keras model and an IPU model with the same initial weights (not compiled)."""
    keras.utils.set_random_seed(0)
    plain = BUILDERS[kind]()
    with strategy.scope():
        on_ipu = BUILDERS[kind]()
    on_ipu.set_weights(plain.get_weights())
    return plain, on_ipu


def twin(kind: str, strategy, steps_per_execution: int = 1, optimizer: str = "adam",
         **compile_overrides):
    """A plain Keras model and an IPU model with the same initial weights, both compiled."""
    plain, on_ipu = pair(kind, strategy)
    for model in (plain, on_ipu):
        model.compile(**{**compile_args(kind, steps_per_execution, optimizer),
                         **compile_overrides})
    return plain, on_ipu


def run_stage(plan, stage: int, values, training=None) -> dict:
    """Evaluates one pipeline stage's layer calls on concrete tensors (the reference semantics).

    Args:
        plan: A `PipelinePlan`.
        stage: The stage to run.
        values: Values for (at least) `plan.stage_inputs[stage]`.
        training: The training flag for layers that take one, or `None`.

    Returns:
        The values of every key the stage produces.
    """
    from keras_ipu.keras import stages

    env = dict(values)
    produced = {}
    for call in plan.stages[stage]:
        args, kwargs = stages.call_arguments(call, env, training)
        outputs = keras.tree.flatten(call.operation(*args, **kwargs))
        for key, value in zip(call.output_keys, outputs):
            env[key] = produced[key] = value
    return produced


def run_plan(plan, inputs, training=None):
    """Runs every stage of a plan in order: what the pipelined model computes.

    Returns:
        The outputs, packed into `plan.outputs_struct`.
    """
    flat = keras.tree.flatten(inputs)
    if len(flat) != len(plan.inputs):
        raise ValueError(f"Model {plan.model_name} takes {len(plan.inputs)} input(s).")
    values = {key: keras.ops.convert_to_tensor(x, dtype=spec.dtype)
              for key, x, spec in zip(plan.input_keys, flat, plan.inputs)}
    for stage in range(plan.num_stages):
        values.update(run_stage(plan, stage, values, training))
    return keras.tree.pack_sequence_as(plan.outputs_struct,
                                       [values[key] for key in plan.output_keys])
