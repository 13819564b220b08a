"""Keras variable assignments inside a compiled computation, applied once it has run.

`strategy.run(fn)` and `ipu_compiler.compile(fn)` trace `fn` with `jax.jit`.
A Keras layer called there may assign its variables: BatchNormalization's
moving statistics in training mode, a seed generator's state for Dropout or
`rand_ops.dropout`. Assigned during a trace, a variable would keep the
trace's placeholder and the model would fail at its next use. As in IPU
TensorFlow, where such updates are ops of the program, `fn` is traced in a
Keras stateless scope: the new values leave the program with its outputs,
and the variables take them once it has run (replica 0's, as the result).

The assigned variables travel in the output's tree structure, so the values
of a program compiled for other input shapes reach the variables its own
trace assigned. The computation's loops (`ipu.loops.repeat`, `while_loop`)
carry the assigned variables through their iterations (`loop_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import keras
from keras.src.backend.common import global_state, stateless_scope, variables

from keras_ipu.device import (
    attachment,
    closures,
    collectives,
    compiled_calls,
    interrupts,
    loop_state,
    program_outfeeds,
)
from keras_ipu.device import system as ipu_system
from keras_ipu.keras import batch_norm_groups, steps


@contextlib.contextmanager
def outside_traces() -> Iterator[None]:
    """Makes the work inside eager and its variable assignments act on the variables:
    not on an enclosing stateless scope's record (Keras keeps the active scope in its
    global state), nor traced into the program being traced.

    For state the host hands back to the variables (a model's sync of the
    device's state) whatever program is being traced: a sync inside a trace
    would leave the trace's values in the variables, or be dropped with it.

    Example:

    >>> with outside_traces():
    ...     model.jax_state_sync()
    """
    scope = stateless_scope.get_stateless_scope()
    global_state.set_global_attribute("stateless_scope", None)
    try:
        with jax.ensure_compile_time_eval():
            yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


class _Held:
    """A variable in a tree's static data: equal only to itself (a Keras variable's `==`
    is elementwise)."""

    def __init__(self, variable: keras.Variable):
        self.variable = variable


def _values_of_variables(leaf: Any) -> Any:
    # A variable returned by the computation is returned as its value (the scope's).
    return leaf.value if isinstance(leaf, keras.Variable) else leaf


@jax.tree_util.register_pytree_node_class
class _Assigned:
    """A computation's result with the new values of the variables it assigned."""

    def __init__(self, result: Any, values: list, held: tuple):
        self.result, self.values, self.held = result, values, held

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (self.result, self.values), self.held

    @classmethod
    def tree_unflatten(cls, held: tuple, children: tuple) -> _Assigned:
        return cls(*children, held)


class _Recording(stateless_scope.StatelessScope):
    """A stateless scope that also keeps the variables assigned in it, in order.

    It is the state the computation's loops carry (`loop_state.LoopState`):
    its entries are the assigned variables, by `id`.
    """

    def __init__(self, seed_mask: Any = None):
        # Losses are collected, so that `model.losses` read inside the computation has
        # the activity regularizers of its calls, as eagerly; variables made inside are
        # initialized once the program has run (`call_assigning`), not inside its trace.
        super().__init__(collect_losses=True, initialize_variables=False)
        self.assigned: dict[int, keras.Variable] = {}
        self.known: dict[int, keras.Variable] = {}  # kept when a trace is abandoned
        # This replica's seed word (`steps.replica_seed_mask`), or None: one stream.
        self.seed_mask = seed_mask
        self.trace = program_outfeeds.trace_state()  # the computation's

    def get_current_value(self, variable: Any) -> Any:
        value = super().get_current_value(variable)
        if value is None and self.seed_mask is not None and steps.is_seed_state(variable):
            # A seed generator first read here: this replica's stream from now on. (Its
            # own value: `variable.value` would ask this scope again.)
            outer = self.original_scope
            own = outer.get_current_value(variable) if outer is not None else None
            own = variable._value if own is None else own
            value = steps.xor_seed_words([own], [0], self.seed_mask)[0]
            self.known.setdefault(id(variable), variable)
            self.state_mapping[id(variable)] = value
        # One not assigned here is its own value, as `variable.value` reads it: Keras'
        # weight regularization asks every variable here (a `stateless_call` maps all).
        if value is None:
            value = variable._value
        if value is None and getattr(variable, "_initializer", None) is not None:
            value = self._initial_value(variable)
        return value

    def _initial_value(self, variable: Any) -> Any:
        """A variable made inside and not initialized yet: its initializer's value, drawn
        once. Every read inside gets that draw (its layer's call, `model.losses`; an
        initializer drawing from a `SeedGenerator` draws anew at each call), and the
        variable takes it once the computation has run, as an assignment."""
        # A host draw (an initializer of NumPy's random numbers) is kept on the variable:
        # the computation's other traces (its replicas' abstract trace) read it again.
        value = vars(variable).get(_INITIAL_DRAW)
        if value is None:
            # Drawn from the seed generators' own streams, not this replica's: every
            # replica computes with the one value the variable takes (replica 0's).
            mask, self.seed_mask = self.seed_mask, None
            try:
                value = variable._initializer(variable._shape, dtype=variable._dtype)
            finally:
                self.seed_mask = mask
            if not isinstance(value, jax.core.Tracer):
                setattr(variable, _INITIAL_DRAW, value)
        if loop_state.carried_here(self.trace, value):  # not an inner transformation's
            self.assigned.setdefault(id(variable), variable)
            self.known.setdefault(id(variable), variable)
            self.state_mapping[id(variable)] = value
        return value

    def unmasked(self, variable: Any, value: Any) -> Any:
        """A value to give `variable` after the computation: a seed state's own word back."""
        if self.seed_mask is None or not steps.is_seed_state(variable):
            return value
        return steps.xor_seed_words([value], [0], self.seed_mask)[0]

    def add_update(self, update: tuple) -> None:
        variable, value = update
        if not loop_state.carried_here(self.trace, value):
            # Its value would leak that transformation's tracer; and an inner `jax.jit`
            # traced again (a loop carrying more) replays its trace, assigning nothing.
            raise RuntimeError(_INNER_ASSIGNMENT.format(path=variable.path))
        self.assigned.setdefault(id(variable), variable)
        self.known.setdefault(id(variable), variable)
        super().add_update(update)

    def keys(self) -> tuple[int, ...]:
        """The assigned variables, by `id`, in the order of their first assignment."""
        return tuple(self.assigned)

    def snapshot(self) -> tuple[dict, dict, list]:
        """What an abandoned loop trace must not change: the assignments and the losses."""
        return dict(self.assigned), dict(self.state_mapping), list(self.losses)

    def restore(self, snapshot: tuple[dict, dict, list]) -> None:
        """Puts back a `snapshot`."""
        self.assigned, self.state_mapping = dict(snapshot[0]), dict(snapshot[1])
        self.losses[:] = snapshot[2]

    def read(self, keys: Sequence[int]) -> list[Any]:
        """The variables' values in the scope (a variable not assigned yet: its own)."""
        return [self.state_mapping[key] if key in self.state_mapping
                else self.known[key].value for key in keys]

    def write(self, keys: Sequence[int], values: Sequence[Any]) -> None:
        """Assigns the variables in the scope."""
        for key, value in zip(keys, values, strict=True):
            self.assigned.setdefault(key, self.known[key])
            self.state_mapping[key] = value


# Where a variable made inside a computation keeps its initializer's host draw until the
# computation has run and given it that value.
_INITIAL_DRAW = "_keras_ipu_initial_draw"

_INNER_ASSIGNMENT = (
    "The Keras variable {path!r} was assigned a value made by a JAX transformation within the "
    "computation (jax.grad, jax.vmap, an inner jax.jit): it exists only inside "
    "that transformation and cannot leave it. Call the function that assigns it directly "
    "(the computation is compiled as a whole: an inner jax.jit adds nothing), or return the "
    "new values from it (`model.stateless_call` gives the non-trainable variables' values, "
    "with has_aux=True under jax.grad) and assign them outside the transformation."
)


# What holds Keras state a computation may assign: a kept program is the same only for the
# same ones (a function assigning to a global variable rebound since is another program).
_STATEFUL = (keras.Variable, keras.layers.Layer, keras.random.SeedGenerator,
             keras.optimizers.Optimizer)


class _KeepingAssignments:
    """`fn` traced in a `_Recording` scope: its result carries the assigned values.

    Equal to another for the same `fn`, outputs and the Keras objects `fn`
    reads from its closure and globals (by identity), so that a kept program
    is found again, and only for the variables it assigns.
    """

    def __init__(self, fn: Callable, outputs: Callable):
        self.__wrapped__ = compiled_calls.unwrapped(fn)
        self.computation = self.__wrapped__  # what the shards it uses are remembered for
        self.outputs = outputs
        self.stateful = tuple(value for value in closures.referenced_values(fn)
                              if isinstance(value, _STATEFUL))

    def __call__(self, *args: Any, **kwargs: Any) -> _Assigned:
        if isinstance(stateless_scope.get_stateless_scope(), _Recording):
            # Part of an enclosing computation's trace: its scope takes the assignments.
            return _Assigned(self._result(*args, **kwargs), [], ())
        with (_Recording(_replica_seed_mask()) as scope, loop_state.carrying(scope),
              batch_norm_groups.system_groups()):
            result = self._result(*args, **kwargs)
        held = tuple(_Held(variable) for variable in scope.assigned.values())
        return _Assigned(result, [scope.unmasked(h.variable, scope.get_current_value(h.variable))
                                  for h in held], held)

    def _result(self, *args: Any, **kwargs: Any) -> Any:
        result = self.outputs(self.__wrapped__(*args, **kwargs))
        return jax.tree_util.tree_map(_values_of_variables, result)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _KeepingAssignments) and other.__wrapped__ == self.__wrapped__
                and other.outputs == self.outputs
                and len(other.stateful) == len(self.stateful)
                and all(a is b for a, b in zip(other.stateful, self.stateful)))

    def __hash__(self) -> int:
        return hash((self.__wrapped__, self.outputs, tuple(map(id, self.stateful))))


def _replica_seed_mask() -> Any:
    """This replica's seed word where the computation is replicated, as IPU replicas draw
    their own random numbers (unless `experimental_identical_replicas`); else None."""
    if (collectives.replica_count() == 1
            or ipu_system.require().option("identical_replicas", False)):
        return None
    return steps.replica_seed_mask(collectives.replica_index())


def call_assigning(run: Callable[[Callable], Any], fn: Callable,
                   outputs: Callable = lambda result: result) -> Any:
    """Runs `fn` through `run`, then assigns the Keras variables `fn` assigned.

    Args:
        run: Runs a function as a compiled computation and returns its
            result (`lambda f: call_compiled(f, ipus, args)`).
        fn: The user's computation.
        outputs: Applied to `fn`'s result inside the computation.

    Returns:
        `outputs(fn(...))`, as `run` gives it.

    Example:

    >>> call_assigning(lambda f: call_compiled(f, ipus, (x,)),
    ...                lambda a: model(a, training=True))
    """
    assigned = run(_KeepingAssignments(fn, outputs))
    with interrupts.deferred():  # a Ctrl-C waits: the run took its infeed elements
        if attachment.runs_programs():
            _assign([held.variable for held in assigned.held], assigned.values)
        else:  # nothing ran (`PRE_COMPILE`): the variables keep their values
            _assign([], [])
    return assigned.result


def _assign(assigned: Sequence[keras.Variable], values: Sequence[Any]) -> None:
    """Gives the variables a computation assigned their new values, once it has run."""
    if stateless_scope.get_stateless_scope() is None:
        # Variables made inside (an optimizer's slots, in a training step) wait for their
        # values; initialized now, eagerly, they take the computation's below. Left
        # waiting, the next stateless scope to close (any fit) would initialize them again.
        # Those the computation read take its values, not another call of their
        # initializer (an `np.random` one would move the global stream).
        made = [(variable, value) for variable, value in zip(assigned, values, strict=True)
                if variable._value is None]
        taken = {id(variable) for variable, _ in made}
        waiting = global_state.get_global_attribute("uninitialized_variables") or []
        global_state.set_global_attribute(
            "uninitialized_variables", [v for v in waiting if id(v) not in taken])
        for variable, value in made:
            variable._initialize(value)
            vars(variable).pop(_INITIAL_DRAW, None)
        variables.initialize_all_variables()
    for variable, value in zip(assigned, values, strict=True):
        variable.assign(value)


def assigning(run: Callable[[], Any]) -> Any:
    """Runs `run()` (an eager loop) keeping the Keras variables it assigns, then assigns them.

    A loop run outside any compiled computation (`ipu.loops.repeat` called
    eagerly) is traced by `lax.scan` all the same: the variables its body
    assigns are carried through its iterations (`loop_state`) and take their
    final values once it has run. Inside a stateless scope (a compiled
    computation's, or the caller's own) that scope takes them instead.

    Args:
        run: Runs the loop and returns its result.

    Returns:
        What `run` returns.

    Example:

    >>> assigning(lambda: feeds.repeat(3, body, [], infeed))
    """
    if stateless_scope.get_stateless_scope() is not None:
        return run()
    with _Recording() as scope, loop_state.carrying(scope):
        result = run()
    assigned = list(scope.assigned.values())
    _assign(assigned, [scope.get_current_value(variable) for variable in assigned])
    return result
