"""Strict, hierarchical configuration objects whose attributes are declared as data.

A schema is a tree of `Category` nodes whose leaves are `Option`s. A `Config`
subclass binds one schema; its instances then read and write options through
attribute access (`config.ipu_model.tiles_per_ipu = 8`), checking every write
against the option's type and value checks. Misspelt names, wrong types and
out-of-range values raise at once, naming the attribute and what it accepts,
and a rejected write leaves the stored value as it was.

All values of one config live in a single flat dict keyed by the option's full
dotted name; categories are views onto it. This makes equality, copying and
pickling a matter of that one dict.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import inspect
import json
import logging
import numbers
import textwrap
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Union

import numpy as np

_LOG = logging.getLogger("keras_ipu.config")

_DOC_WIDTH = 79


# ---------------------------------------------------------------------------
# Value checks


@dataclasses.dataclass(frozen=True)
class Check:
    """A constraint on an option's value, with the words that describe it.

    Args:
        description: What valid values look like, phrased to follow the
            option's name, e.g. `"must be >= 0"`. Used in errors and docs.
        predicate: Returns whether a value (already of the option's type) is
            valid.

    Example:

    >>> positive = Check("must be >= 1", lambda v: v >= 1)
    >>> positive(0)
    False
    """

    description: str
    predicate: Callable[[Any], bool]

    def __call__(self, value: Any) -> bool:
        return bool(self.predicate(value))


def at_least(minimum: float) -> Check:
    """A check that a number is `>= minimum`.

    Args:
        minimum: The smallest valid value.

    Returns:
        The `Check`.

    Example:

    >>> at_least(0)(-1)
    False
    """
    return Check(f"must be >= {minimum}", lambda v: v >= minimum)


def between(low: float, high: float) -> Check:
    """A check that a number lies in the closed interval `[low, high]`.

    NaN fails it, as every comparison with NaN is false.

    Args:
        low: The smallest valid value.
        high: The largest valid value.

    Returns:
        The `Check`.

    Example:

    >>> between(0, 1)(0.5)
    True
    """
    return Check(f"must be in [{low}, {high}]", lambda v: low <= v <= high)


def one_of(*values: Any) -> Check:
    """A check that a value is one of `values`.

    Args:
        *values: The valid values.

    Returns:
        The `Check`.

    Example:

    >>> one_of("ipu1", "ipu2")("ipu3")
    False
    """
    listed = ", ".join(repr(v) for v in values)
    return Check(f"must be one of {listed}", lambda v: v in values)


def each(check: Check) -> Check:
    """Applies `check` to a scalar, or to every entry of a list or tuple.

    Args:
        check: The check for one entry.

    Returns:
        The `Check`.

    Example:

    >>> each(at_least(1))([1, 0])
    False
    """
    return Check(
        f"{check.description} (every entry, when a list or tuple)",
        lambda v: all(check(x) for x in _entries(v)),
    )


def distinct() -> Check:
    """A check that a list or tuple holds no entry twice (scalars pass).

    Returns:
        The `Check`.

    Example:

    >>> distinct()([0, 0])
    False
    """
    return Check(
        "must not repeat an entry",
        lambda v: len(set(_entries(v))) == len(_entries(v)),
    )


def mapping_entry(key: str, check: Check) -> Check:
    """Applies `check` to `value[key]` of a mapping, when the key is present.

    Args:
        key: The entry to check.
        check: The check for the entry's value.

    Returns:
        The `Check`.

    Example:

    >>> mapping_entry("n", at_least(0))({"n": -1})
    False
    """
    return Check(
        f"entry {key!r}, when present, {check.description}",
        lambda v: key not in v or check(v[key]),
    )


def _entries(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


# ---------------------------------------------------------------------------
# Types

# Leaf types for which isinstance says too much or too little: bool is an int
# subclass, and a float option should take an int such as 1.
_SCALAR_TYPES: dict[type, Callable[[Any], bool]] = {
    bool: lambda v: isinstance(v, (bool, np.bool_)),
    int: lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    float: lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
}


def type_matches(hint: Any, value: Any) -> bool:
    """Whether `value` satisfies the type hint `hint`.

    Understands plain classes, unions (`typing.Union` or `X | Y`), lists
    (`list[X]`, `typing.List[X]`) and homogeneous tuples (`tuple[X, ...]`);
    `bool` values never count as `int` or `float`, and `int` values count as
    `float`.

    Args:
        hint: A class or a type hint.
        value: The value to test.

    Returns:
        True when the value matches.

    Example:

    >>> type_matches(int | list[int], [1, 2])
    True
    >>> type_matches(int, True)
    False
    """
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(type_matches(arg, value) for arg in typing.get_args(hint))
    if origin in (list, tuple):
        # List[X] and Tuple[X, ...] both name their entry type first.
        args = typing.get_args(hint)
        entry = args[0] if args else Any
        return isinstance(value, origin) and all(type_matches(entry, v) for v in value)
    if hint is Any:
        return True
    if hint in _SCALAR_TYPES:
        return _SCALAR_TYPES[hint](value)
    return isinstance(value, origin or hint)


def type_name(hint: Any) -> str:
    """The readable name of a type hint: `int`, `SelectionOrder`, `typing.Union[...]`.

    Args:
        hint: A class or a type hint.

    Returns:
        The name.

    Example:

    >>> type_name(bool)
    'bool'
    """
    return hint.__name__ if isinstance(hint, type) else repr(hint)


# ---------------------------------------------------------------------------
# Schema nodes


@dataclasses.dataclass(frozen=True)
class Option:
    """One configurable value.

    Args:
        name: The attribute name within its category.
        type: The class or type hint values must satisfy.
        default: The value a new config holds.
        doc: What the option means.
        effect: What the option does in this implementation.
        checks: Constraints on the value beyond its type.
        deprecated_msg: Why the option is deprecated and what to use
            instead, or None when it is not deprecated.

    Example:

    >>> Option("tiles_per_ipu", int, 0, "Tiles per IPU.", checks=(at_least(0),)).default
    0
    """

    name: str
    type: Any
    default: Any
    doc: str
    effect: str = ""
    checks: tuple[Check, ...] = ()
    deprecated_msg: str | None = None


@dataclasses.dataclass(frozen=True)
class Category:
    """A named group of options and sub-categories.

    Args:
        name: The attribute name within its parent (`""` for a root).
        doc: What the group is about.
        members: The options and sub-categories, in documentation order.
        deprecated_msg: Why the category is deprecated, or None.

    Raises:
        ValueError: When two members share a name.

    Example:

    >>> root = Category("", "Root.", (Option("x", int, 0, "An x."),))
    >>> root.member("x").default
    0
    """

    name: str
    doc: str
    members: tuple[Option | Category, ...]
    deprecated_msg: str | None = None
    _index: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        index = {member.name: member for member in self.members}
        if len(index) != len(self.members):
            raise ValueError(f"Category {self.name!r} declares a member name twice.")
        object.__setattr__(self, "_index", index)

    @property
    def names(self) -> list[str]:
        """The member names, in declaration order."""
        return list(self._index)

    def member(self, name: str) -> Option | Category | None:
        """The member called `name`, or None."""
        return self._index.get(name)


def walk(category: Category, prefix: str = "") -> Iterator[tuple[str, Option | Category]]:
    """Yields `(full_name, node)` for every node below `category`, depth first.

    Args:
        category: The category to walk.
        prefix: The full name of `category` (`""` for a root).

    Returns:
        An iterator of pairs, categories before their members.

    Example:

    >>> root = Category("", "", (Category("a", "", (Option("b", int, 0, ""),)),))
    >>> [name for name, _ in walk(root)]
    ['a', 'a.b']
    """
    for member in category.members:
        path = _join(prefix, member.name)
        yield path, member
        if isinstance(member, Category):
            yield from walk(member, path)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# ---------------------------------------------------------------------------
# Metadata


class AttributeMetadata:
    """What the schema says about one option or category.

    Args:
        name: The full name, relative to the config's root.
        node: The schema node.
        owner: The config class's name, used in messages.

    Example:

    ```python
    meta = IPUConfig().get_attribute_metadata("ipu_model.tiles_per_ipu")
    meta.default     # 0
    meta.type        # 'int'
    meta.check_type(True)  # raises TypeError: bool is not int
    ```
    """

    def __init__(self, name: str, node: Option | Category, owner: str = ""):
        self._name = name
        self._node = node
        self._shown_name = _join(owner, name)

    @property
    def name(self) -> str:
        """The full name of the option/category, relative to the config structure's root."""
        return self._name

    @property
    def type(self) -> str | None:
        """The type of this option, as a string. Categories themselves do not have types."""
        return None if self._is_category else type_name(self._node.type)

    @property
    def default(self) -> Any:
        """The default value for this option. Categories themselves do not have default values."""
        return None if self._is_category else copy.deepcopy(self._node.default)

    @property
    def deprecated(self) -> bool:
        """Whether or not this option/category is deprecated."""
        return self._node.deprecated_msg is not None

    @property
    def deprecated_msg(self) -> str | None:
        """The deprecation message for this attribute. None if it is not deprecated."""
        return self._node.deprecated_msg

    @property
    def doc(self) -> str:
        """What the option/category means."""
        return self._node.doc

    @property
    def effect(self) -> str:
        """What the option does in keras_ipu (`""` for categories)."""
        return getattr(self._node, "effect", "")

    @property
    def _is_category(self) -> bool:
        return isinstance(self._node, Category)

    def check_type(self, value: Any) -> bool:
        """Checks if `value` is one of the allowed types for this option.

        Args:
            value: The value to check against this attribute's type.

        Returns:
            True if `value` satisfies this attribute's type.

        Raises:
            TypeError: When it does not, or when this is a category.
        """
        if self._is_category:
            raise TypeError(f"{self._shown_name} is a category; categories hold no values.")
        _check_type(self._shown_name, self._node, value)
        return True

    def warn_if_deprecated(self) -> None:
        """Outputs a log warning if this option/category is deprecated."""
        if self.deprecated:
            _LOG.warning("%s is deprecated: %s", self._shown_name, self.deprecated_msg)

    def __repr__(self) -> str:
        if self._is_category:
            return f"AttributeMetadata(name={self._name!r}, category)"
        return (
            f"AttributeMetadata(name={self._name!r}, type={self.type!r}, "
            f"default={self._node.default!r})"
        )


# ---------------------------------------------------------------------------
# Validation


def _check_type(path: str, option: Option, value: Any) -> None:
    if not type_matches(option.type, value):
        raise TypeError(
            f"{path} must be of type {type_name(option.type)}, got {value!r} "
            f"of type {type(value).__name__}."
        )


def _check_value(path: str, option: Option, value: Any) -> None:
    for check in option.checks:
        if not check(value):
            raise ValueError(f"{path} {check.description}, got {value!r}.")


def validate(path: str, option: Option, value: Any) -> None:
    """Raises if `value` is not valid for `option`.

    Args:
        path: The option's full name as messages should show it.
        option: The option.
        value: The candidate value.

    Raises:
        TypeError: For a value of the wrong type, naming the expected type.
        ValueError: For a value its checks reject, naming the valid values.

    Example:

    >>> validate("tiles", Option("tiles", int, 0, "", checks=(at_least(0),)), -1)
    Traceback (most recent call last):
    ...
    ValueError: tiles must be >= 0, got -1.
    """
    _check_type(path, option, value)
    _check_value(path, option, value)


def _unknown_attribute(config: Config, node: Category, prefix: str, name: str) -> AttributeError:
    # Suggest the same name elsewhere in the tree first (a forgotten category),
    # then the closest spelling at this level, else list what this level has.
    owner = type(config).__name__
    elsewhere = [path for path, _ in walk(config._schema) if path.rsplit(".", 1)[-1] == name]
    close = difflib.get_close_matches(name, node.names, n=1)
    if elsewhere:
        hint = "Did you mean " + " or ".join(repr(path) for path in elsewhere) + "?"
    elif close:
        hint = f"Did you mean {_join(prefix, close[0])!r}?"
    else:
        where = f"in {prefix!r}" if prefix else "at the top level"
        hint = f"Valid names {where}: {', '.join(node.names)}."
    return AttributeError(f"{owner} has no attribute {_join(prefix, name)!r}. {hint}")


def _category_assignment(config: Config, node: Category, path: str) -> AttributeError:
    example = next(p for p, member in walk(node, path) if isinstance(member, Option))
    return AttributeError(
        f"{type(config).__name__}.{path} is a category, not an option, and cannot be "
        f"assigned. Set its options instead, e.g. config.{example} = ..."
    )


def _json_types(value: Any) -> Any:
    """A value as JSON holds it: tuples as lists, NumPy numbers as Python's (so that
    a config equals its JSON round trip)."""
    if isinstance(value, (list, tuple)):
        return [_json_types(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_types(v) for k, v in value.items()}
    item = getattr(value, "item", None)
    if isinstance(value, numbers.Number) and type(value) not in (int, float) and callable(item):
        return item()  # a NumPy number
    return copy.deepcopy(value)


def _plain(value: Any) -> Any:
    return value.name if isinstance(value, enum.Enum) else _json_types(value)


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


# ---------------------------------------------------------------------------
# Config objects


class _Scope:
    """Attribute access to one category of a config (the root or a sub-category)."""

    def _scope(self) -> tuple[Config, Category, str]:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        # Private and special names are never options; answering them quickly
        # also keeps copy and pickle from recursing before state is restored.
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        config, node, prefix = self._scope()
        member = node.member(name)
        if member is None:
            raise _unknown_attribute(config, node, prefix, name)
        path = _join(prefix, name)
        if isinstance(member, Category):
            if member.deprecated_msg is not None:
                AttributeMetadata(path, member, type(config).__name__).warn_if_deprecated()
            return CategoryView(config, member, path)
        return config._values[path]

    def __setattr__(self, name: str, value: Any) -> None:
        config, node, prefix = self._scope()
        member = node.member(name)
        path = _join(prefix, name)
        if member is None:
            raise _unknown_attribute(config, node, prefix, name)
        if isinstance(member, Category):
            raise _category_assignment(config, member, path)
        metadata = AttributeMetadata(path, member, type(config).__name__)
        validate(metadata._shown_name, member, value)
        metadata.warn_if_deprecated()
        # A copy, so later changes to the caller's list or dict cannot slip
        # past validation; NumPy numbers as Python's, which compare and print
        # as the config's own values do.
        config._values[path] = _python_numbers(copy.deepcopy(value))

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Config attributes cannot be deleted; assign a value to {name!r}.")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._scope()[1].names))

    def get_attribute_metadata(self, attr: str) -> AttributeMetadata:
        """Get the attribute metadata for `attr`.

        Args:
            attr: The attribute's full name relative to the category this
                method is called on, e.g. `"ipu_model.tiles_per_ipu"` on a
                config or `"tiles_per_ipu"` on `config.ipu_model`.

        Returns:
            An `AttributeMetadata` object containing the metadata for the
            attribute.

        Raises:
            AttributeError: When no such attribute exists, suggesting the
                closest one.

        Example:

        ```python
        config.get_attribute_metadata("ipu_model.tiles_per_ipu").default  # 0
        ```
        """
        config, node, prefix = self._scope()
        member: Option | Category = node
        path = prefix
        for name in attr.split("."):
            found = member.member(name) if isinstance(member, Category) else None
            if found is None:
                parent = member if isinstance(member, Category) else node
                raise _unknown_attribute(config, parent, path, name)
            member, path = found, _join(path, name)
        return AttributeMetadata(path, member, type(config).__name__)

    def to_dict(self) -> dict[str, Any]:
        """All values below this category as a nested dict of plain values.

        Enum members appear as their names, so the dict can be written as
        JSON when the option values allow it.

        Returns:
            A new nested dict, one key per option or sub-category.

        Example:

        ```python
        config.to_dict()["ipu_model"]["tiles_per_ipu"]  # 0
        ```
        """
        return _nested(*self._scope())

    def _options_below(self) -> Iterator[tuple[str, Any]]:
        config, node, prefix = self._scope()
        for path, member in walk(node, prefix):
            if isinstance(member, Option):
                yield path, config._values[path]

    def _update(self, values: Mapping[str, Any]) -> None:
        config, node, prefix = self._scope()
        if not isinstance(values, Mapping):
            raise TypeError(
                f"Values for {prefix or type(config).__name__!r} must be a mapping, got {values!r}."
            )
        for name, value in values.items():
            if not isinstance(name, str):  # no attribute's name: say what the names are
                where = f"in {prefix!r}" if prefix else "at the top level"
                raise TypeError(f"{type(config).__name__} attribute names are strings, got "
                                f"{name!r} {where}. Valid names: {', '.join(node.names)}.")
            if "." in name:  # the reference's flat form
                head, rest = name.split(".", 1)
                if isinstance(node.member(head), Category):
                    getattr(self, head)._update({rest: value})
                    continue
            member = node.member(name)
            if isinstance(member, Category) and isinstance(value, Mapping):
                getattr(self, name)._update(value)
                continue
            kind = _enum_of(member.type) if isinstance(member, Option) else None
            if kind is not None:
                shown = _join(type(config).__name__, _join(prefix, name))
                value = _from_name(shown, kind, value)
            setattr(self, name, value)


def _updated(cls: type, config: Config | None, update: Callable[[Config], None]) -> Config:
    """A new config updated, or `config` updated all at once: a value refused leaves it
    as it was."""
    if config is None:
        target = cls()
        update(target)
        return target
    trial = copy.deepcopy(config)
    update(trial)
    config._values.update(trial._values)
    return config


def _python_numbers(value: Any) -> Any:
    """`value` with NumPy scalars (in lists, tuples and dicts too) as Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    if type(value) in (list, tuple):
        return type(value)(_python_numbers(item) for item in value)
    if type(value) is dict:
        return {key: _python_numbers(item) for key, item in value.items()}
    return value


def _nested(config: Config, node: Category, prefix: str) -> dict[str, Any]:
    return {
        member.name: (
            _nested(config, member, path)
            if isinstance(member, Category)
            else _plain(config._values[path])
        )
        for member, path in ((m, _join(prefix, m.name)) for m in node.members)
    }


def _enum_of(hint: Any) -> type | None:
    """The enumeration an option's type is, or holds in a union (`bool | SomeEnum`)."""
    kinds = (hint,) if isinstance(hint, type) else typing.get_args(hint)
    return next((k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)), None)


def _from_name(path: str, kind: type, value: Any) -> Any:
    # Enum options are stored as members but written out as names (the
    # reference's `to_dict` wrote their values).
    if issubclass(kind, enum.Enum) and isinstance(value, int) and not isinstance(value, bool):
        values = {member.value: member for member in kind}
        if value not in values:
            raise ValueError(
                f"{path} must be a member of {kind.__name__}, its name or its value "
                f"({', '.join(f'{m.name}={m.value}' for m in kind)}), got {value!r}."
            )
        return values[value]
    if issubclass(kind, enum.Enum) and isinstance(value, str):
        if value not in kind.__members__:
            raise ValueError(
                f"{path} must name a member of {kind.__name__} "
                f"({', '.join(kind.__members__)}), got {value!r}."
            )
        return kind[value]
    return value


class CategoryView(_Scope):
    """A sub-category of a config: reads and writes go to the config itself.

    Args:
        config: The config the values live in.
        node: The category's schema node.
        path: The category's full name.

    Example:

    ```python
    model = config.ipu_model       # a CategoryView
    model.tiles_per_ipu = 8        # same as config.ipu_model.tiles_per_ipu = 8
    ```
    """

    def __init__(self, config: Config, node: Category, path: str):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_path", path)

    def _scope(self) -> tuple[Config, Category, str]:
        return self._config, self._node, self._path

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CategoryView):
            return NotImplemented
        return (
            type(self._config) is type(other._config)
            and self._path == other._path
            and _json_types(dict(self._options_below())) == _json_types(
                dict(other._options_below()))
        )

    __hash__ = None

    def __repr__(self) -> str:
        start = len(self._path) + 1
        values = ", ".join(f"{path[start:]}={_shown(v)}" for path, v in self._options_below())
        return f"{type(self._config).__name__}.{self._path}({values})"


class _class_or_instance_method:
    """A method that gets its class, and the instance it was called on (None on the class)."""

    def __init__(self, function: Callable) -> None:
        self.__func__ = function
        functools.update_wrapper(self, function)

    def __get__(self, instance: Any, owner: type) -> Callable:
        function = self.__func__

        @functools.wraps(function)
        def bound(*args: Any, **kwargs: Any) -> Any:
            return function(owner, instance, *args, **kwargs)

        signature = inspect.signature(function)
        bound.__signature__ = signature.replace(
            parameters=list(signature.parameters.values())[2:])
        return bound


class Config(_Scope):
    """Base of strict, hierarchical configs; a subclass sets `_schema`.

    Subclasses get, from their schema: attribute access to every option and
    category, type and value checking on assignment, `get_attribute_metadata`,
    `to_dict` / `from_dict`, equality, `repr`, copying and pickling.

    Raises:
        TypeError: At class creation, when a schema name would hide a method.

    Example:

    >>> class Small(Config):
    ...     _schema = Category("", "", (Option("x", int, 0, "An x.", checks=(at_least(0),)),))
    >>> small = Small()
    >>> small.x = 3
    >>> small
    Small(x=3)
    """

    _schema: ClassVar[Category]
    _options: ClassVar[dict[str, Option]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        schema = cls.__dict__.get("_schema")
        if schema is None:
            return
        cls._options = {p: m for p, m in walk(schema) if isinstance(m, Option)}
        clashes = [m.name for m in schema.members if hasattr(cls, m.name)]
        clashes += [
            m.name
            for _, c in walk(schema)
            if isinstance(c, Category)
            for m in c.members
            if hasattr(CategoryView, m.name)
        ]
        if clashes:
            raise TypeError(f"Schema names {clashes} of {cls.__name__} hide its methods.")

    def __init__(self):
        object.__setattr__(self, "_values", self._defaults())

    @classmethod
    def _defaults(cls) -> dict[str, Any]:
        return {path: copy.deepcopy(o.default) for path, o in cls._options.items()}

    def _scope(self) -> tuple[Config, Category, str]:
        return self, self._schema, ""

    @_class_or_instance_method
    def from_dict(cls, config: Config | None, values: Mapping[str, Any]) -> Config:
        """Builds a config from a dict such as `to_dict()` returns, or updates one.

        Called on the class (`IPUConfig.from_dict(d)`) it returns a new
        config; called on a config (`config.from_dict(d)`, the reference's
        form) it sets the values on that config and returns it. Options left
        out keep their values. Keys are nested, or the reference's flat
        dotted names (`"ipu_model.tiles_per_ipu"`); enum options take a
        member, its name or its value.

        Args:
            values: A mapping of option values.

        Returns:
            The new or updated config.

        Raises:
            AttributeError: For an unknown name, or a value given for a
                category.
            TypeError: For a value of the wrong type.
            ValueError: For a value out of range, or an unknown enum name.

        Example:

        ```python
        config = IPUConfig.from_dict({"auto_select_ipus": 2})
        assert IPUConfig.from_dict(config.to_dict()) == config
        config.from_dict({"ipu_model.tiles_per_ipu": 16})   # in place
        ```
        """
        return _updated(cls, config, lambda target: target._update(values))

    @_class_or_instance_method
    def from_json(cls, config: Config | None, text: str) -> Config:
        """`from_dict` of a JSON string, such as `to_json()` writes.

        Args:
            text: The JSON text of a mapping of option values.

        Returns:
            The new or updated config.

        Raises:
            ValueError: For text that is not JSON, or what `from_dict` raises.

        Example:

        ```python
        assert IPUConfig.from_json(config.to_json()) == config
        ```
        """
        values = json.loads(text)
        return _updated(cls, config, lambda target: target._update(values))

    def to_json(self) -> str:
        """`to_dict()` as a JSON string (when the option values allow it).

        Returns:
            The JSON text.

        Example:

        ```python
        text = config.to_json()
        ```
        """
        return json.dumps(self.to_dict())

    def _validate(self) -> None:
        # Values are checked on assignment, but a list or dict read back from
        # the config can still be changed in place.
        for path, option in self._options.items():
            validate(_join(type(self).__name__, path), option, self._values[path])

    def _changed(self) -> list[tuple[str, Any]]:
        return [
            (path, value)
            for path, value in self._values.items()
            if value != self._options[path].default
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return type(self) is type(other) and _json_types(self._values) == _json_types(
            other._values)

    __hash__ = None

    def __repr__(self) -> str:
        changed = ", ".join(f"{path}={_shown(value)}" for path, value in self._changed())
        return f"{type(self).__name__}({changed})"

    def __str__(self) -> str:
        changed = self._changed()
        if not changed:
            return f"{type(self).__name__} with all default values"
        lines = [f"{type(self).__name__} with {len(changed)} non-default value(s):"]
        lines += [f"  {path} = {_shown(value)}" for path, value in changed]
        return "\n".join(lines)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._values)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Start from the defaults so that a pickle written before an option
        # existed still loads.
        values = self._defaults()
        values.update(state)
        object.__setattr__(self, "_values", values)


# ---------------------------------------------------------------------------
# Documentation


def describe(schema: Category, indent: str = "    ", width: int = _DOC_WIDTH) -> str:
    """Google-style `Attributes:` documentation of every node in `schema`.

    Args:
        schema: The root category.
        indent: The indentation of one level.
        width: The longest line, in characters.

    Returns:
        The text, starting with the line `Attributes:`.

    Example:

    >>> print(describe(Category("", "", (Option("x", int, 0, "An x."),))))
    Attributes:
        x (int, default 0): An x.
    """
    lines = ["Attributes:"]
    for path, node in walk(schema):
        if isinstance(node, Category):
            head = f"{path} (category): {node.doc}"
            notes = []
        else:
            head = f"{path} ({type_name(node.type)}, default {_shown(node.default)}): {node.doc}"
            notes = [f"Valid values: {check.description}." for check in node.checks]
            notes += [f"keras_ipu: {node.effect}"] if node.effect else []
        if node.deprecated_msg:
            notes.append(f"Deprecated: {node.deprecated_msg}")
        lines.append(_wrap(head, indent, indent * 2, width))
        lines += [_wrap(note, indent * 2, indent * 3, width) for note in notes]
    return "\n".join(lines)


def _wrap(text: str, first: str, rest: str, width: int) -> str:
    return textwrap.fill(
        " ".join(text.split()),
        width=width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )
