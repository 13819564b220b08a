"""The IPU's floating point exceptions: `floating_point_behaviour.inv`, `div0`, `oflo`.

An IPU with one of these set stops an execution at the first operation that
raises that exception, and the host gets an error instead of the execution's
results. Here the program carries a check after each operation (JAX's
`checkify`) and returns the first failure with its results; the host looks
at it before the results are kept, so the state stays that of the last
execution that completed.

- `inv`: an operation's result holds a NaN (0/0, inf - inf, sqrt(-1), or a
  NaN carried in from its operands, the data's say, by an arithmetic
  operation; IEEE 754's comparisons of a quiet NaN raise nothing, so a max,
  a min, an absolute value or a select passes it on);
- `div0`: a floating point division of a finite, non-zero number by zero
  (IEEE 754: 0/0 is `inv`'s), a reciprocal (square root) of zero included;
- `oflo`: an operation of finite operands made an infinity (exp(100.0) in
  float32, or 1e5 cast to float16, say; a division by zero is `div0`'s).

checkify checks NaNs, not overflows, and its division check flags 0/0 too:
importing this module adds an overflow rule and an IEEE division-by-zero rule
to checkify's (process-wide) rule table. They check only when a checkified
function asks for this module's errors, so other uses of checkify are
unchanged.

Example:

```python
errors = system_checks()              # the configured system's; frozenset() for none
run = checked(execution, errors)      # (state, batches) -> (state, (outfeed, error))
state, (outfeed, error) = run(state, batches)
raise_first(error, "fit")             # IPUFloatingPointError, if an operation raised
```
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# checkify's rule table and error plumbing: it checks NaNs and divisions but
# not overflows, whose rule this module adds (contract-tested in
# tests/test_floating_point.py).
from jax._src import ad_util
from jax._src import checkify as checkify_rules
from jax.experimental import checkify

from keras_ipu.device import system
from keras_ipu.errors import IPUFloatingPointError


class _IPUException(checkify_rules.JaxException):
    """A floating point exception the IPU raises and checkify has no check for."""

    def __init__(self, traceback_info: Any, primitive_name: str):
        super().__init__(traceback_info)
        self.prim = primitive_name

    def tree_flatten(self):
        return ([], (self.traceback_info, self.prim))

    @classmethod
    def tree_unflatten(cls, metadata, payload):
        del payload
        return cls(*metadata)

    def get_effect_type(self):
        return checkify_rules.ErrorEffect(type(self), ())


class _OverflowError(_IPUException):
    """An operation of finite operands made an infinity."""

    def __str__(self) -> str:
        return f"overflow in primitive: {self.prim}."


class _DivisionByZeroError(_IPUException):
    """A finite, non-zero number divided by zero.

    IEEE 754's division by zero: 0/0 is an invalid operation (`inv`'s NaN),
    and integer division raises no floating point exception. checkify's own
    division check flags any zero divisor, so `div0` has this one instead.
    """

    def __str__(self) -> str:
        return f"division by zero in primitive: {self.prim}."


_OPTION_ERRORS = {"inv": checkify.nan_checks, "div0": frozenset({_DivisionByZeroError}),
                  "oflo": frozenset({_OverflowError})}

# The operations that can overflow finite operands. A narrowing cast among
# them: JAX adds 16-bit values up in float32 (a sum, a mean, a pooling window)
# and the infinity appears where it casts the result back. `add_any` adds a
# value's gradients where it fans out.
_OVERFLOWING = (lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.dot_general_p,
                lax.conv_general_dilated_p, lax.exp_p, lax.exp2_p, lax.expm1_p, lax.pow_p,
                lax.integer_pow_p, lax.cosh_p, lax.sinh_p, lax.reduce_sum_p, lax.reduce_prod_p,
                lax.cumsum_p, lax.cumprod_p, lax.square_p, lax.convert_element_type_p,
                lax.reduce_precision_p, lax.reduce_window_sum_p, lax.scatter_add_p,
                lax.scatter_mul_p, lax.select_and_scatter_add_p, lax.psum_p,
                lax.reduce_window_p, lax.reduce_p, ad_util.add_jaxvals_p)


def _library_folders() -> tuple[str, ...]:
    """The folders of the array libraries' own frames, left out of where an exception
    happened: JAX's, keras_ipu's, and Keras' backend and ops (a layer's `call` stays)."""
    folders = [os.path.dirname(jax.__file__), os.path.dirname(os.path.dirname(__file__))]
    for name in ("jaxlib", "keras"):
        spec = importlib.util.find_spec(name)  # located, not imported
        if spec is not None and spec.submodule_search_locations:
            root = spec.submodule_search_locations[0]
            folders += ([os.path.join(root, "src", "backend"), os.path.join(root, "src", "ops")]
                        if name == "keras" else [root])
    return tuple(os.path.join(folder, "") for folder in folders)


_LIBRARY_FOLDERS = _library_folders()


def system_checks() -> frozenset:
    """The checks of the exceptions the configured system traps (empty: none).

    Returns:
        `checks_for` of the system's `floating_point_exceptions` option.

    Example:

    >>> ExecutionProgram(step, ..., floating_point_checks=system_checks())
    """
    return checks_for(system.require().option("floating_point_exceptions", ()))


def checks_for(exceptions: Iterable[str]) -> frozenset:
    """The checks that trap these exceptions (empty: none).

    Args:
        exceptions: Names among `"inv"`, `"div0"` and `"oflo"` (the system's
            `floating_point_exceptions` option).

    Returns:
        The union of their checkify error sets.

    Raises:
        ValueError: For another name.

    Example:

    >>> checks_for(["inv"]) == checkify.nan_checks
    True
    """
    errors: frozenset = frozenset()
    for name in exceptions:
        if name not in _OPTION_ERRORS:
            raise ValueError(f"Unknown floating point exception {name!r}: expected some of "
                             f"{sorted(_OPTION_ERRORS)}.")
        errors |= _OPTION_ERRORS[name]
    return errors


def checked(execution: Callable, errors: frozenset) -> Callable:
    """`execution` with the checks: it returns `(state, (outfeed, error))`.

    Args:
        execution: `(state, batches) -> (state, outfeed)`.
        errors: From `checks_for`; not empty.

    Returns:
        The checked execution, to trace and compile in its place.

    Example:

    >>> run = checked(lambda state, x: (state, jnp.exp(x)), checks_for(["oflo"]))
    >>> state, (out, error) = jax.jit(run)(0.0, 100.0)  # error.get(): "overflow in ..."
    """
    run = checkify.checkify(execution, errors=errors)

    def checked_execution(state, batches):
        error, (state, outfeed) = run(state, batches)
        return state, (outfeed, error)

    return checked_execution


def raise_first(error: checkify.Error, program: str) -> None:
    """Raises the execution's first floating point exception, if any (waits for it).

    Args:
        error: The error an execution returned.
        program: The program's name for the message (`"fit"`, ...).

    Raises:
        IPUFloatingPointError: When an operation raised a floating point exception.
    """
    exception = error.get_exception()
    if exception is not None:
        exception = _origin(exception)
        raise IPUFloatingPointError(program, f"{str(exception).rstrip('.')}{_where(exception)}")


def _origin(exception: Any) -> Any:
    """The exception itself, or of several replicas' (or stages') the one that made it.

    The others saw it arrive through a collective (a gradient all-reduce, a
    stage's hand-over) or the padding: their frames are keras_ipu's own.
    """
    mapping = getattr(exception, "error_mapping", None)
    if not mapping:
        return exception
    made = [each for _, each in sorted(mapping.items()) if _where(each)]
    return made[0] if made else next(iter(mapping.values()))


def _where(exception: Any) -> str:
    """` at file:line (function)`: the innermost frame outside the array libraries."""
    frames = getattr(getattr(exception, "traceback_info", None), "frames", None) or ()
    for frame in frames:
        if not frame.file_name.startswith(_LIBRARY_FOLDERS):
            return f" at {frame.file_name}:{frame.line_num} ({frame.function_name})"
    return ""


def _add_rules() -> None:
    """Adds the overflow and division checks to the rules of their operations."""
    for primitive in _OVERFLOWING:
        _extend_rule(primitive, _OverflowError, _made_infinity)
    for primitive in _DIVIDING:
        _extend_rule(primitive, _DivisionByZeroError, _divided_by_zero)


def _bound(primitive, error, enabled_errors, *operands, **params):
    return error, primitive.bind(*operands, **params)


def _extend_rule(primitive, error_type: type, raised: Callable) -> None:
    """Makes `primitive`'s rule also check `raised(primitive, operands, params, out)` when
    asked; a reload of this module replaces the check its earlier version added."""
    rule = checkify_rules.error_checks.get(primitive, functools.partial(_bound, primitive))
    rule = _without(rule, error_type.__name__)
    checkify_rules.error_checks[primitive] = _checked_rule(rule, primitive, error_type, raised)


def _checked_rule(rule: Callable, primitive, error_type: type, raised: Callable) -> Callable:
    def checked_rule(error, enabled_errors, *operands, **params):
        error, out = rule(error, enabled_errors, *operands, **params)
        # Of constants only (a literal NaN that JAX casts, then selects away), the
        # result is folded when the program compiles: no operation runs to raise. A
        # JAX array the program captured (a Keras variable) is on the device: it counts.
        if error_type in enabled_errors and any(isinstance(x, jax.Array) for x in operands):
            error = checkify_rules.assert_func(
                error, raised(primitive, operands, params, out),
                error_type(checkify_rules.get_traceback(), primitive.name))
        return error, out

    checked_rule.keras_ipu_check = (rule, primitive, error_type, raised)
    return checked_rule


def _without(rule: Callable, error_name: str) -> Callable:
    """`rule` without this module's check of the error named so (an earlier version's)."""
    check = getattr(rule, "keras_ipu_check", None)
    if check is None:
        return rule
    inner, primitive, error_type, raised = check
    if error_type.__name__ == error_name:
        return inner
    return _checked_rule(_without(inner, error_name), primitive, error_type, raised)


# IEEE 754's division by zero: an exact infinity from finite operands, per
# operation. A function's pole (log(0) = -inf) is not a division: code computes
# it and selects it away (`where(x > 0, log(x), 0)`, `xlogy`), and it stays
# untrapped, as its infinity is no overflow either.
_DIVIDING = {
    lax.div_p: lambda operands, params: ((operands[1] == 0) & (operands[0] != 0)
                                         & jnp.isfinite(operands[0])),
    lax.integer_pow_p: lambda operands, params: (operands[0] == 0) & (params["y"] < 0),
    lax.pow_p: lambda operands, params: (operands[0] == 0) & (operands[1] < 0),
    lax.rsqrt_p: lambda operands, params: operands[0] == 0,
}


def _divided_by_zero(primitive, operands: tuple, params: dict, out: Any) -> jax.Array:
    """Whether a floating point operation divided a finite, non-zero number by zero."""
    if not _is_float(out):
        return jnp.bool_(False)
    return jnp.any(_DIVIDING[primitive](operands, params))


def _made_infinity(primitive, operands: tuple, params: dict, out: Any) -> jax.Array:
    """Whether `out` holds an infinity that finite operands made, not by dividing by zero."""
    results = [leaf for leaf in jax.tree_util.tree_leaves(out) if _is_float(leaf)]
    if not results:
        return jnp.bool_(False)
    infinite = jnp.any(jnp.stack([jnp.isinf(leaf).any() for leaf in results]))
    finite = [jnp.isfinite(x).all() for x in operands if _is_float(x)]
    if primitive in _DIVIDING:  # a division by zero is div0's
        finite.append(~jnp.any(_DIVIDING[primitive](operands, params)))
    return infinite & jnp.all(jnp.stack(finite)) if finite else infinite


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# At import, under Python's import lock: once per process.
_add_rules()
