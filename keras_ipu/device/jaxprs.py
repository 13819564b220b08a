"""Walking a traced program: its equations, those of the jaxprs inside it included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a jaxpr (or closed jaxpr) and of the jaxprs in its equations' params.

    Args:
        jaxpr: A `Jaxpr` or `ClosedJaxpr` (`jax.make_jaxpr(f)(x)`, `traced.jaxpr`).

    Yields:
        The equations, each one before those of the jaxprs it holds.

    Example:

    >>> [e.primitive.name for e in equations(jax.make_jaxpr(jnp.sin)(1.0))]
    ['sin']
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from equations(sub)


__all__ = ["equations"]
