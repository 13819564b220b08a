"""A reader of StableHLO text, as JAX prints a lowered program: ops, types, loops.

Just enough structure for the cost count (`keras_ipu.device.cost`): MLIR
prints one op a line, its regions indented between braces (`cond { ... } do
{ ... }`, `({ ... }, { ... })`), and its type signature after the last
` : ` of the op's line, or of the line that closes its regions. `parse`
turns the text into a tree of `Op`s; `trip_count` reads the trip count of
the `while` loops JAX lowers `lax.scan` and `fori_loop` to. Nothing here
depends on the platform the text was lowered for, nor on a JAX version's
Python bindings to MLIR: the input is text.

Example:

>>> module = parse(jax.jit(lambda x: x * x + x).lower(jnp.ones(4)).as_text())
>>> [op.name for op in module.walk() if op.name.startswith("stablehlo.")]
['stablehlo.multiply', 'stablehlo.add']
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Sequence

__all__ = ["REF", "Op", "Scope", "TensorType", "int_attribute", "int_constants", "int_list",
           "lookup", "parse", "tensor_types", "trailing_types", "trip_count"]

# Integer constants visible from a block: its own first, then its enclosing blocks'.
Scope = tuple[dict[str, int], ...]


@dataclasses.dataclass
class Op:
    """One op of a module.

    Args:
        line: The op's line (strings emptied, location dropped).
        name: The op's name (`"stablehlo.add"`, `"func.call"`, ...).
        results: The results it names (`"%3"`, `"%0:2"`), or `""`.
        tails: The lines that close its regions (`"}"`, `"}) : (...) -> ..."`).
        regions: Its regions, each a list of ops.

    Example:

    >>> op = parse("%0 = stablehlo.add %a, %b : tensor<4xf32>").regions[0][0]
    >>> op.name, op.signature
    ('stablehlo.add', ([TensorType(shape=(4,), dtype='f32'), ...], [...]))
    """

    line: str
    name: str
    results: str = ""
    tails: list[str] = dataclasses.field(default_factory=list)
    regions: list[list[Op]] = dataclasses.field(default_factory=list)

    @property
    def symbol(self) -> str:
        """The `@name` a `func.func` defines or a call names (`""` without one)."""
        match = _SYMBOL.search(self.line)
        return match.group(1) if match else ""

    def walk(self) -> Iterable[Op]:
        """This op and every op nested in its regions, in order."""
        yield self
        for region in self.regions:
            for op in region:
                yield from op.walk()

    @functools.cached_property
    def signature(self) -> tuple[list[TensorType], list[TensorType]]:
        """`(operand types, result types)`, from the op's trailing type signature.

        Pretty-printed ops abbreviate it: `add %a, %b : T` (every operand
        and the result `T`), `select %p, %a, %b : P, T`, and `while`'s
        `: T1, T2` (operands and results alike).
        """
        text = None
        for tail in reversed(self.tails):
            text = trailing_types(tail)
            if text is not None:
                break
        if text is None and not self.line.endswith("{"):
            text = trailing_types(self.line)
        if not text:
            return [], []
        if "->" in text:
            operands, results = text.split("->", 1)
            return list(tensor_types(operands)), list(tensor_types(results))
        types = list(tensor_types(text))
        if self.name in _SAME_TYPES:
            return types, list(types)
        refs = len(REF.findall(self.line.split(" : ")[0].split(self.name, 1)[-1]))
        operands = [types[0]] * refs if len(types) == 1 else types[:1] + [types[-1]] * (refs - 1)
        return operands, types[-1:]


@dataclasses.dataclass(frozen=True)
class TensorType:
    """A ranked tensor type (`tensor<8x64xf32>`).

    Args:
        shape: Its dimensions (a dynamic `?` reads as 1).
        dtype: Its element type as printed (`"f32"`, `"bf16"`, `"i1"`, ...).

    Example:

    >>> tensor_types("tensor<8x64xbf16>")[0].bytes
    1024
    """

    shape: tuple[int, ...]
    dtype: str

    @property
    def elements(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        """Size in bytes (booleans take a byte)."""
        return self.elements * _itemsize(self.dtype)

    @property
    def is_float(self) -> bool:
        """Whether its elements are floating point (real or complex)."""
        return self.dtype.startswith(("f", "bf", "tf", "complex"))

    @property
    def is_half(self) -> bool:
        """16-bit or narrower floats: what the IPU multiplies at its fp16 rate."""
        return self.dtype in ("f16", "bf16") or (
            self.dtype.startswith("f") and (_bits(self.dtype) or 32) <= 8)


# Quoted strings, but for generic op names (`"stablehlo.case"(...)`): what
# they hold (`" : "`, braces) must not count as syntax.
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"(?!\()')
_OP_START = re.compile(
    r'^(?:(%[^=]*?)\s*=\s*)?"?((?:[a-z_][\w]*\.)+[a-z_][\w]*|call|return)\b"?')
_SYMBOL = re.compile(r"@([\w$.\-]+)")
REF = re.compile(r"%[\w$.\-]+(?:#\d+)?")
_TYPE = re.compile(r"tensor<((?:[\d?]+x)*)((?:complex<\w+>)|[a-zA-Z]\w*)")
_CONSTANT_INT = re.compile(
    r"^(%[\w$.\-]+) = stablehlo\.constant dense<(-?\d+)> : tensor<[su]?i\d+>")
_LOC = re.compile(r"\s+loc\([^()]*(?:\([^()]*\)[^()]*)*\)$")
_SAME_TYPES = frozenset({"stablehlo.while", "stablehlo.optimization_barrier"})


def parse(text: str) -> Op:
    """A module's text as a tree of ops.

    Args:
        text: StableHLO as MLIR prints it (`Lowered.as_text()`,
            `jax.export`'s `mlir_module()`), one op a line; indentation and
            location annotations do not matter.

    Returns:
        A root `Op` (no name) whose regions hold the top-level ops (the
        module and, in it, its functions).

    Example:

    >>> root = parse(lowered.as_text())
    >>> [op.symbol for op in root.walk() if op.name == "func.func"]
    ['main']
    """
    root = Op("", "")
    block: list[Op] = []
    root.regions.append(block)
    blocks, owners = [block], [root]
    last = root
    for raw in text.splitlines():
        line = _LOC.sub("", _STRINGS.sub('""', raw).strip())
        if not line or line.startswith(("//", "^", "#")):
            continue
        if line.startswith("}"):  # closes a region: `}`, `} do {`, `}, {`, `}) : (...) -> ...`
            if len(blocks) > 1:
                blocks.pop()
                last = owners.pop()
                last.tails.append(line)
            if line.endswith("{"):
                _open(last, blocks, owners)
            continue
        match = _OP_START.match(line)
        if match:
            last = Op(line, match.group(2), match.group(1) or "")
            blocks[-1].append(last)
        if line.endswith("{"):  # the op's region, or (`cond {`, `reducer(...) {`) the last op's
            _open(last, blocks, owners)
    return root


def _open(op: Op, blocks: list, owners: list) -> None:
    region: list[Op] = []
    op.regions.append(region)
    blocks.append(region)
    owners.append(op)


def trailing_types(line: str) -> str | None:
    """The type signature after a line's last ` : ` (types hold no colons).

    Args:
        line: An op's line, or the line closing its regions.

    Returns:
        The signature text, `""` when empty, or `None` when the line has none.

    Example:

    >>> trailing_types("%3 = stablehlo.add %1, %2 : tensor<8xf32>")
    'tensor<8xf32>'
    """
    _, sep, tail = line.rpartition(" : ")
    if not sep:
        return None
    tail = tail.strip()
    if tail.endswith("{"):  # `... : T {`: a region follows
        tail = tail[:-1].strip()
    return tail if tail.startswith(("(", "tensor<", "!", "tuple<")) or not tail else None


@functools.lru_cache(maxsize=8192)
def tensor_types(text: str) -> tuple[TensorType, ...]:
    """The tensor types in a signature, in order (cached: programs repeat a few).

    Args:
        text: Signature text (`"(tensor<8x64xf32>, tensor<f32>) -> tensor<8xf32>"`).

    Returns:
        The `TensorType`s.

    Example:

    >>> [t.shape for t in tensor_types("(tensor<8x64xf32>, tensor<f32>)")]
    [(8, 64), ()]
    """
    return tuple(TensorType(tuple(int(d) if d != "?" else 1 for d in dims.split("x") if d), dtype)
                 for dims, dtype in _TYPE.findall(text))


@functools.lru_cache(maxsize=256)
def _bits(dtype: str) -> int | None:
    match = re.match(r"(?:bf|tf|ui|si|f|i)(\d+)", dtype)
    return int(match.group(1)) if match else None


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    if dtype.startswith("complex"):
        return 2 * _itemsize(dtype[len("complex<"):-1]) if "<" in dtype else 8
    bits = _bits(dtype)
    return max(1, bits // 8) if bits else 4


def int_attribute(text: str, name: str) -> int | None:
    """The integer attribute `name = N` in `text` (`None` without one).

    Example:

    >>> int_attribute("module @m attributes {mhlo.num_partitions = 2 : i32}",
    ...               "mhlo.num_partitions")
    2
    """
    match = re.search(re.escape(name) + r"\s*=\s*(-?\d+)", text)
    return int(match.group(1)) if match else None


def int_list(text: str, key: str) -> list[int] | None:
    """`key = [1, 2]` or `key = array<i64: 1, 2>` from an op's attributes (`None` without).

    Example:

    >>> int_list("window = {stride = [2, 2], pad = [[0, 1], [0, 1]]}", "stride")
    [2, 2]
    """
    match = re.search(re.escape(key) + r"\s*=\s*(?:\[|array<i64:?)([^\]>]*)[\]>]", text)
    if not match:
        return None
    return [int(v) for v in re.findall(r"-?\d+", match.group(1))]


def int_constants(ops: Sequence[Op]) -> dict[str, int]:
    """The scalar integer constants a block defines, by name (loop bounds and steps).

    Example:

    >>> int_constants(parse("%c = stablehlo.constant dense<5> : tensor<i32>").regions[0])
    {'%c': 5}
    """
    found = {}
    for op in ops:
        if op.name == "stablehlo.constant":
            match = _CONSTANT_INT.match(op.line)
            if match:
                found[match.group(1)] = int(match.group(2))
    return found


def lookup(name: str, scope: Scope) -> int | None:
    """The integer constant `name` from the innermost block of `scope` that defines it.

    Example:

    >>> lookup("%c", ({}, {"%c": 4}))
    4
    """
    for constants in scope:
        if name in constants:
            return constants[name]
    return None


def trip_count(op: Op, scope: Scope) -> int | None:
    """A `while` loop's trip count, when a variable counts from a constant to a constant.

    The form JAX lowers every `lax.scan` (and `fori_loop` with constant
    bounds) to: the condition compares a loop variable with a constant
    (`compare LT, %iterArg, %c`), the variable starts at a constant and the
    body adds a constant to it.

    Args:
        op: A `stablehlo.while` op.
        scope: The integer constants of the blocks around it (constants may
            be hoisted out of the loop, as `jax.export` prints them).

    Returns:
        The trip count, or `None` when the loop is not of that form.

    Example:

    >>> trip_count(while_op, (int_constants(function_body),))
    4
    """
    carried = re.findall(r"(%[\w$.\-]+) = (%[\w$.\-]+(?:#\d+)?)", op.line.split(" : ")[0])
    names = [variable for variable, _ in carried]
    if len(op.regions) < 2:
        return None
    cond, body = op.regions[0], op.regions[1]
    if not cond or not body or cond[-1].name != "stablehlo.return":
        return None
    cond_scope = (int_constants(cond), *scope)
    returned = REF.findall(cond[-1].line.split(" : ")[0])
    compare = next((o for o in cond if returned and o.results == returned[0]), None)
    if compare is None or compare.name != "stablehlo.compare":
        return None
    match = re.search(r"compare\s+(LT|LE|GT|GE|NE),\s*(%[\w$.\-]+),\s*(%[\w$.\-]+)", compare.line)
    if not match:
        return None
    direction, left, right = match.groups()
    if left in names and lookup(right, cond_scope) is not None:
        variable, limit = left, lookup(right, cond_scope)
    elif right in names and lookup(left, cond_scope) is not None:  # `c > i` is `i < c`
        variable, limit = right, lookup(left, cond_scope)
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    else:
        return None
    position = names.index(variable)
    start = lookup(carried[position][1], scope)
    step = _step(body, position, variable, scope)
    if start is None or not step:
        return None
    if direction == "LE":
        limit, direction = limit + 1, "LT"
    elif direction == "GE":
        limit, direction = limit - 1, "GT"
    if direction == "NE" and (limit - start) % step == 0:
        direction = "LT" if step > 0 else "GT"
    if direction == "LT" and step > 0:
        return max(0, -(-(limit - start) // step))
    if direction == "GT" and step < 0:
        return max(0, -(-(start - limit) // -step))
    return None


def _step(body: Sequence[Op], position: int, variable: str, scope: Scope) -> int | None:
    """What the body adds to the loop variable at `position` of its results."""
    if body[-1].name != "stablehlo.return":
        return None
    returned = REF.findall(body[-1].line.split(" : ")[0])
    if position >= len(returned):
        return None
    update = next((o for o in body if o.results == returned[position]), None)
    if update is None or update.name not in ("stablehlo.add", "stablehlo.subtract"):
        return None
    refs = REF.findall(update.line.split(" : ")[0].split(update.name, 1)[1])
    if len(refs) != 2 or variable not in refs:
        return None
    other = refs[1] if refs[0] == variable else refs[0]
    amount = lookup(other, (int_constants(body), *scope))
    if amount is None:
        return None
    return -amount if update.name == "stablehlo.subtract" else amount
