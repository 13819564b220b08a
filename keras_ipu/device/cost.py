"""The cost of a program, counted over its StableHLO before any backend lowers it.

Why not XLA's cost analysis
---------------------------
`Compiled.cost_analysis()` analyses the program a backend has optimised: on
GPUs the matrix products have become cuBLAS custom calls that it does not
count (a 4 × Dense(4096) step came out about 1,000× too low on an H100), and
fusion decides the bytes. `Lowered.cost_analysis()` analyses the unoptimised
program but is not implemented for PJRT plugin backends (GPUs: it returns
`None`), and counts a loop body once whatever its trip count. So the device
model counts the program itself: the StableHLO text JAX lowers to, which is
the same module on every platform. The count is a function of that text
alone (`count_stablehlo`).

What is counted
---------------
* Matrix work: `dot_general` and `convolution` cost 2 flops per
  multiply-accumulate (2 × output elements × contraction size; for a
  convolution only the kernel taps that land on input elements, not on
  padding or the holes of a dilated input). When every operand is a 16-bit
  (or narrower) float the flops also count as `half_flops`: the IPU's AMP
  units run those at the fp16 rate.
* Elementwise arithmetic on floats (`add`, `multiply`, `maximum`,
  `compare`, `select`, ...): one flop per output element. Integer and
  boolean arithmetic (loop counters, index computations) is not counted.
* Transcendentals (`exponential`, `log`, `tanh`, `logistic`, `sqrt`,
  `rsqrt`, `power`, `erf`, ...): one per output element, separately, as
  XLA's cost analysis does.
* Reductions (`reduce`, `reduce_window`, `select_and_scatter`, `scatter`,
  `sort`): their region's float ops once per application. A window's taps
  on padding apply nothing; a window over a whole axis padded on one side
  (JAX's `cumsum`, `cummax`, ...) is a scan: one application per element.
* Bytes: each op that computes or copies reads its operands and writes its
  results (`bytes_accessed`). Poplar lays out tensors as views, so reshapes,
  transposes, broadcasts, slices, concatenations, reversals and pads move
  nothing and cost no bytes; `convert`, dynamic slicing, gathers and
  scatters are copies and cost bytes but no flops.
* Control flow: a function costs what its body costs wherever it is called;
  a `while` loop whose trip count is static (every `lax.scan`, and
  `fori_loop` with constant bounds) costs its trip count times its body and
  condition, other loops one pass (noted in `uncounted`); a `case`/`if`
  costs its most expensive branch.
* Per IPU: inside a `shard_map` (`sdy.manual_computation`) the shapes are
  one device's already; ops outside it work on global shapes, which the
  partitioner spreads over the module's `mhlo.num_partitions` devices.
* Not counted: collectives (the replication and pipeline models cost the
  exchange), `custom_call`s (platform-specific kernels: their targets are
  listed in `uncounted`), and other ops the count does not model (bytes
  only, their names listed in `uncounted`).

Example:

>>> lowered = jax.jit(lambda x, w: x @ w).lower(jnp.ones((8, 64)), jnp.ones((64, 32)))
>>> count_stablehlo(lowered.as_text()).flops
32768.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from keras_ipu.device import stablehlo
from keras_ipu.device.stablehlo import Op, Scope, TensorType

__all__ = ["Count", "count_lowered", "count_stablehlo", "convolution_flops", "dot_flops"]


@dataclasses.dataclass(frozen=True)
class Count:
    """What a program (or part of one) costs, per IPU.

    Args:
        flops: Floating point operations (multiply-accumulates count 2).
        half_flops: Of `flops`, matrix work (`dot_general`, `convolution`)
            whose operands are all 16-bit or narrower floats.
        transcendentals: Transcendental operations (not in `flops`).
        bytes_accessed: Bytes the ops read and write (see the module's
            docstring for which ops move data).
        uncounted: Names of ops whose cost the count does not model.

    Example:

    >>> Count(flops=2.0) + Count(flops=3.0, transcendentals=1.0)
    Count(flops=5.0, half_flops=0.0, transcendentals=1.0, bytes_accessed=0.0, uncounted=frozenset())
    """

    flops: float = 0.0
    half_flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    uncounted: frozenset[str] = frozenset()

    def __add__(self, other: Count) -> Count:
        return Count(
            flops=self.flops + other.flops,
            half_flops=self.half_flops + other.half_flops,
            transcendentals=self.transcendentals + other.transcendentals,
            bytes_accessed=self.bytes_accessed + other.bytes_accessed,
            uncounted=self.uncounted | other.uncounted,
        )

    def scaled(self, factor: float) -> Count:
        """This count `factor` times (a loop's trip count, a share of a program).

        Args:
            factor: The multiplier.

        Returns:
            A `Count` with every figure multiplied; `uncounted` unchanged.

        Example:

        >>> Count(flops=2.0).scaled(3).flops
        6.0
        """
        if factor == 1:
            return self
        return Count(self.flops * factor, self.half_flops * factor,
                     self.transcendentals * factor, self.bytes_accessed * factor,
                     self.uncounted)

    @property
    def work(self) -> float:
        """Flops and transcendentals together (what orders `case` branches)."""
        return self.flops + self.transcendentals


_ZERO = Count()


def count_stablehlo(text: str) -> Count:
    """Counts what one run of a StableHLO module costs on one of its devices.

    The count reads only the text, so a module lowered on any platform gives
    the same figures; see the module's docstring for what each op costs.

    Args:
        text: The module as `jax.stages.Lowered.as_text()` prints it (the
            pretty-printed StableHLO form, as MLIR prints it, indentation
            not required).

    Returns:
        The `Count` of the module's public `main` function (or, without one,
        its first function).

    Raises:
        ValueError: When the text holds no function.

    Example:

    >>> count_stablehlo(jax.jit(jnp.tanh).lower(jnp.ones(8)).as_text()).transcendentals
    8.0
    """
    module = stablehlo.parse(text)
    functions = {op.symbol: op for op in module.walk() if op.name == "func.func"}
    if not functions:
        raise ValueError("The StableHLO text holds no function (func.func).")
    partitions = stablehlo.int_attribute(text, "mhlo.num_partitions") or 1
    entry = "main" if "main" in functions else next(iter(functions))
    return _Counter(functions, partitions).function(entry, local=partitions == 1)


def count_lowered(lowered: Any) -> Count:
    """Counts a lowered JAX program (`jax.jit(f).lower(...)`, `traced.lower()`).

    Args:
        lowered: A `jax.stages.Lowered`.

    Returns:
        `count_stablehlo` of its StableHLO text.

    Example:

    >>> count_lowered(jax.jit(lambda x: x * 2).lower(jnp.ones(4))).flops
    4.0
    """
    return count_stablehlo(lowered.as_text())


def dot_flops(lhs_shape: Sequence[int], result_shape: Sequence[int],
              lhs_contracting: Iterable[int]) -> float:
    """Flops of a `dot_general`: 2 × output elements × contraction size.

    Args:
        lhs_shape: The left operand's shape.
        result_shape: The result's shape.
        lhs_contracting: The left operand's contracting dimensions.

    Returns:
        The flops.

    Example:

    >>> dot_flops((8, 64), (8, 32), [1])
    32768.0
    """
    contraction = math.prod(lhs_shape[d] for d in lhs_contracting)
    return 2.0 * math.prod(result_shape) * contraction


def convolution_flops(
    lhs_spatial: Sequence[int], rhs_spatial: Sequence[int], out_spatial: Sequence[int], *,
    out_batch: int, out_features: int, kernel_input_features: int,
    strides: Sequence[int] = (), padding: Sequence[tuple[int, int]] = (),
    lhs_dilation: Sequence[int] = (), rhs_dilation: Sequence[int] = (),
) -> float:
    """Flops of a convolution: 2 per multiply-accumulate on an input element.

    Kernel taps that fall on padding or on the holes of a dilated input
    (transposed convolutions) are not work, so only the others count: per
    spatial dimension, the (output position, kernel tap) pairs that land on
    an input element.

    Args:
        lhs_spatial: The input's spatial sizes.
        rhs_spatial: The kernel's spatial sizes.
        out_spatial: The output's spatial sizes.
        out_batch: The output's batch size.
        out_features: The output's feature count.
        kernel_input_features: The kernel's input feature count (input
            features per group).
        strides: Window strides (default 1).
        padding: `(low, high)` padding per spatial dimension (default 0;
            negative crops).
        lhs_dilation: Input dilation (default 1).
        rhs_dilation: Kernel dilation (default 1).

    Returns:
        The flops.

    Example:

    >>> convolution_flops((4,), (3,), (2,), out_batch=1, out_features=1,
    ...                   kernel_input_features=1)
    12.0
    """
    rank = len(out_spatial)
    strides = tuple(strides) or (1,) * rank
    padding = tuple(tuple(p) for p in padding) or ((0, 0),) * rank
    lhs_dilation = tuple(lhs_dilation) or (1,) * rank
    rhs_dilation = tuple(rhs_dilation) or (1,) * rank
    taps = 1
    for d in range(rank):
        taps *= _valid_taps(lhs_spatial[d], rhs_spatial[d], out_spatial[d], strides[d],
                            padding[d][0], lhs_dilation[d], rhs_dilation[d])
    return 2.0 * out_batch * out_features * kernel_input_features * taps


@functools.lru_cache(maxsize=4096)
def _valid_taps(size: int, kernel: int, out: int, stride: int, low: int,
                lhs_dilation: int, rhs_dilation: int) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that hit an input element."""
    position = (np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * rhs_dilation
                - low)
    valid = ((position >= 0) & (position <= (size - 1) * lhs_dilation)
             & (position % lhs_dilation == 0))
    return int(valid.sum())


def _window_applications(line: str, shape: tuple[int, ...], out: tuple[int, ...]) -> float:
    """How many times a `reduce_window` applies its region: per output, its window's taps
    on input elements (not padding) less one. A window over a whole axis padded on one
    side, stride 1, is a cumulative sum (`cumsum`, `cummax`, ...): each output combines
    the one before it with one element, as a scan computes it."""
    rank = len(shape)
    if not rank or len(out) != rank:
        return 0.0
    window = stablehlo.int_list(line, "window_dimensions") or [1] * rank
    strides = stablehlo.int_list(line, "window_strides") or [1] * rank
    base = stablehlo.int_list(line, "base_dilations") or [1] * rank
    dilations = stablehlo.int_list(line, "window_dilations") or [1] * rank
    pad = re.search(r"padding = dense<\[(.*?)\]>", line)
    edges = [tuple(map(int, p)) for p in re.findall(r"\[(-?\d+),\s*(-?\d+)\]",
                                                    f"[{pad.group(1)}]")] if pad else []
    edges = edges if len(edges) == rank else [(0, 0)] * rank
    taps = 1
    for d in range(rank):
        scan = (window[d] == shape[d] == out[d] > 1 and strides[d] == base[d] == dilations[d]
                == 1 and sorted(edges[d]) == [0, shape[d] - 1])
        taps *= (2 * shape[d] - 1 if scan else _valid_taps(
            shape[d], window[d], out[d], strides[d], edges[d][0], base[d], dilations[d]))
    return float(max(taps - math.prod(out), 0))


_ELEMENTWISE = frozenset("""
    add subtract multiply divide remainder maximum minimum negate abs sign floor ceil
    round_nearest_even round_nearest_afz compare select clamp and or xor not is_finite
    real imag complex shift_left shift_right_arithmetic shift_right_logical popcnt
    count_leading_zeros reduce_precision next_after square conj
""".split())
_TRANSCENDENTAL = frozenset("""
    exponential exponential_minus_one log log_plus_one logistic tanh sine cosine tan atan2
    power sqrt rsqrt cbrt erf erfc erf_inv lgamma digamma acos acosh asin asinh atan atanh
    cosh sinh bessel_i1e polygamma zeta igamma igammac
""".split())
# Poplar tensors are views: these rearrange no data on an IPU.
_VIEWS = frozenset("""
    reshape broadcast_in_dim broadcast dynamic_reshape transpose reverse slice concatenate pad
    bitcast_convert constant optimization_barrier tuple get_tuple_element return
    get_dimension_size after_all create_token partition_id replica_id
""".split())
# Copies: bytes, no flops.
_COPIES = frozenset("convert copy iota rng rng_bit_generator real_dynamic_slice".split())
# Exchange between IPUs, which the replication and pipeline models cost.
_COLLECTIVES = frozenset("""
    all_reduce all_gather reduce_scatter collective_permute all_to_all collective_broadcast
    send recv infeed outfeed
""".split())
_DIALECTS = ("stablehlo.", "chlo.", "mhlo.")


class _Counter:
    """Counts functions of one module, each once per kind of shapes (global or local)."""

    def __init__(self, functions: Mapping[str, Op], partitions: int):
        self.functions = functions
        self.partitions = partitions
        self._done: dict[tuple[str, bool], Count] = {}
        self._active: set[tuple[str, bool]] = set()
        # The values of the blocks being counted that are padded inputs (`_padded_values`).
        self._padded: dict[str, _Padding] = {}

    def function(self, name: str, local: bool) -> Count:
        """A function's cost; `local`: its shapes are one device's (else global)."""
        key = (name, local)
        if key in self._done:
            return self._done[key]
        if key in self._active or name not in self.functions:  # recursion; an external symbol
            return Count(uncounted=frozenset({f"call @{name}"}))
        self._active.add(key)
        op = self.functions[name]
        count = self.block(op.regions[0], local, ()) if op.regions else _ZERO
        self._active.discard(key)
        self._done[key] = count
        return count

    def block(self, ops: Sequence[Op], local: bool, scope: Scope) -> Count:
        """The cost of a block's ops; `scope`: the integer constants of enclosing blocks."""
        scope = (stablehlo.int_constants(ops), *scope)
        outer = self._padded
        self._padded = {**outer, **_padded_values(ops, outer)}
        total = _ZERO
        try:
            for op in ops:
                total = total + self.op(op, local, scope)
        finally:
            self._padded = outer
        return total

    def op(self, op: Op, local: bool, scope: Scope) -> Count:
        name = op.name
        if name in ("func.call", "call"):
            return self.function(op.symbol, local)
        if name == "sdy.manual_computation":
            return self.block(op.regions[0], True, scope) if op.regions else _ZERO
        if name in ("stablehlo.while", "mhlo.while"):
            return self._while(op, local, scope)
        if name in ("stablehlo.case", "stablehlo.if", "mhlo.case", "mhlo.if"):
            branches = [self.block(region, local, scope) for region in op.regions]
            return max(branches, key=lambda c: (c.work, c.bytes_accessed), default=_ZERO)
        if name == "stablehlo.composite":
            match = re.search(r"decomposition = @([\w$.\-]+)", op.line)
            return self.function(match.group(1), local) if match else _ZERO
        if name == "stablehlo.custom_call":
            return Count(uncounted=frozenset({f"custom_call @{op.symbol}"}))
        if not name.startswith(_DIALECTS):  # func.return, sdy.return, sdy.mesh, ...
            return _ZERO
        kind = name.split(".", 1)[1]
        if kind in _VIEWS or kind in _COLLECTIVES:
            return _ZERO
        count = self._leaf(op, kind, scope)
        if local or self.partitions == 1:
            return count
        # Global shapes, split over the partitions by XLA's partitioner.
        return count.scaled(1.0 / self.partitions)

    def _leaf(self, op: Op, kind: str, scope: Scope) -> Count:
        operands, results = op.signature
        moved = float(sum(t.bytes for t in operands) + sum(t.bytes for t in results))
        out = float(sum(t.elements for t in results))
        floating = any(t.is_float for t in (*operands, *results))
        if kind in _ELEMENTWISE:
            return Count(flops=out if floating else 0.0, bytes_accessed=moved)
        if kind in _TRANSCENDENTAL:
            return Count(transcendentals=out, bytes_accessed=moved)
        if kind in ("dot_general", "dot", "convolution"):
            flops = self._matrix_flops(op, kind, operands, results)
            half = flops if operands and all(t.is_half for t in operands[:2]) else 0.0
            return Count(flops=flops, half_flops=half, bytes_accessed=moved)
        if kind in _COPIES:
            return Count(bytes_accessed=moved)
        if kind in ("dynamic_slice", "gather"):  # reads what it writes, and the indices
            indices = sum(t.bytes for t in operands[1:])
            return Count(bytes_accessed=float(2 * sum(t.bytes for t in results) + indices))
        if kind == "dynamic_update_slice":  # in place: the update, read and written
            update = operands[1].bytes if len(operands) > 1 else 0
            return Count(bytes_accessed=float(2 * update))
        if kind in ("reduce", "reduce_window", "select_and_scatter", "scatter", "sort"):
            return self._with_region(op, kind, operands, results, scope)
        return Count(bytes_accessed=moved, uncounted=frozenset({op.name}))

    def _matrix_flops(self, op: Op, kind: str, operands: list[TensorType],
                      results: list[TensorType]) -> float:
        if len(operands) < 2 or not results:
            return 0.0
        lhs, rhs, out = operands[0], operands[1], results[0]
        if kind == "dot":
            return dot_flops(lhs.shape, out.shape, [len(lhs.shape) - 1] if lhs.shape else [])
        if kind == "dot_general":
            # Pretty (`contracting_dims = [1] x [0]`) or generic form.
            match = (re.search(r"contracting_dims = \[([\d, ]*)\]", op.line)
                     or re.search(r"lhs_contracting_dimensions = \[([\d, ]*)\]", op.line))
            dims = [int(d) for d in re.findall(r"\d+", match.group(1))] if match else []
            return dot_flops(lhs.shape, out.shape, dims)
        match = re.search(r"convolution\((%[\w#]+),", op.line)
        padding = self._padded.get(match.group(1)) if match else None
        return _convolution(op.line, lhs, rhs, out, padding)

    def _with_region(self, op: Op, kind: str, operands: list[TensorType],
                     results: list[TensorType], scope: Scope) -> Count:
        """Ops that apply a region (or, `applies stablehlo.add`, one op) per element."""
        if op.regions:
            per = self.block(op.regions[-1], True, scope)
        else:
            match = re.search(r"applies ([\w.]+)", op.line)
            applied = match.group(1).split(".", 1)[-1] if match else ""
            floating = any(t.is_float for t in operands)
            per = Count(flops=1.0 if applied in _ELEMENTWISE and floating else 0.0,
                        transcendentals=1.0 if applied in _TRANSCENDENTAL else 0.0)
        moved = float(sum(t.bytes for t in operands) + sum(t.bytes for t in results))
        first = operands[0].elements if operands else 0
        out = results[0].elements if results else 0
        window = math.prod(stablehlo.int_list(op.line, "window_dimensions") or [1])
        if kind == "reduce":
            applications = max(first - out, 0)
        elif kind == "reduce_window":
            applications = _window_applications(op.line, operands[0].shape if operands else (),
                                                results[0].shape if results else ())
        elif kind == "select_and_scatter":  # select over each window, then scatter-add
            source = operands[1].elements if len(operands) > 1 else 0
            select = self.block(op.regions[0], True, scope) if len(op.regions) > 1 else per
            return Count(
                flops=source * (max(window - 1, 0) * select.flops + per.flops),
                bytes_accessed=moved,
            )
        elif kind == "scatter":
            updates = operands[-1] if operands else None
            applications = updates.elements if updates else 0
            indices = operands[1].bytes if len(operands) > 2 else 0
            moved = float(indices + 2 * (updates.bytes if updates else 0))
        else:  # sort: about n log n comparisons along the sorted dimension
            dimension = stablehlo.int_attribute(op.line, "dimension")
            shape = operands[0].shape if operands else ()
            length = shape[dimension] if shape and dimension is not None else 1
            applications = first * max(math.log2(max(length, 1)), 1.0)
        return Count(
            flops=applications * per.flops,
            transcendentals=applications * per.transcendentals,
            bytes_accessed=moved,
        )

    def _while(self, op: Op, local: bool, scope: Scope) -> Count:
        if len(op.regions) < 2:
            return _ZERO
        cond, body = op.regions[0], op.regions[1]
        once = self.block(cond, local, scope) + self.block(body, local, scope)
        trips = stablehlo.trip_count(op, scope)
        if trips is None:
            return once + Count(uncounted=frozenset({f"{op.name} (trip count unknown: "
                                                     "counted once)"}))
        return once.scaled(trips)


class _Padding(NamedTuple):
    """A value that is a `stablehlo.pad` of another: the other's shape and the pad's edges."""

    shape: tuple[int, ...]
    low: tuple[int, ...]
    high: tuple[int, ...]
    interior: tuple[int, ...]


def _padded_values(ops: Sequence[Op], known: Mapping[str, _Padding]) -> dict[str, _Padding]:
    """The values of a block that pad another (also through an `optimization_barrier`).

    keras_ipu's convolutions on CPUs materialize their padding with a pad
    behind a barrier (`device.convolutions`); the convolution's taps on it
    are counted as on the unpadded input.
    """
    found: dict[str, _Padding] = {}
    for op in ops:
        if op.name == "stablehlo.pad" and op.results:
            operands, _ = op.signature
            edges = [tuple(stablehlo.int_list(op.line, key) or ()) for key in
                     ("low", "high", "interior")]
            if operands and all(len(e) == len(operands[0].shape) for e in edges):
                found[op.results] = _Padding(tuple(operands[0].shape), *edges)
        elif op.name == "stablehlo.optimization_barrier" and op.results:
            names = re.findall(r"%[\w#]+", op.line.split("optimization_barrier", 1)[1])
            results = ([op.results] if ":" not in op.results else
                       [f"{op.results.split(':')[0]}#{i}" for i in range(len(names))])
            for result, name in zip(results, names):
                padding = found.get(name) or known.get(name)
                if padding is not None:
                    found[result] = padding
    return found


def _convolution(line: str, lhs: TensorType, rhs: TensorType, out: TensorType,
                 lhs_padding: _Padding | None = None) -> float:
    """A convolution's flops from its printed dimension numbers and window.

    `lhs_padding`: the input is a pad of another value; its taps on the pad's
    edges and holes are not work either.
    """
    labels = re.search(r"dim_numbers = \[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]", line)
    if not labels or not rhs.shape:
        # The kernel's elements per output feature, for every output element.
        per_output = rhs.elements / max(rhs.shape[-1] if rhs.shape else 1, 1)
        return 2.0 * out.elements * per_output
    lhs_dims, rhs_dims, out_dims = (
        [d.strip() for d in group.split(",")] for group in labels.groups())

    def spatial(dims: list[str], shape: tuple[int, ...]) -> list[int]:
        positions = sorted((int(d), i) for i, d in enumerate(dims) if d.isdigit())
        return [shape[i] for _, i in positions]

    pad = re.search(r"pad = \[((?:\s*\[-?\d+,\s*-?\d+\],?)*)\s*\]", line)
    padding = [tuple(map(int, p)) for p in re.findall(r"\[(-?\d+),\s*(-?\d+)\]",
                                                       pad.group(1))] if pad else []
    lhs_shape, dilation = lhs.shape, stablehlo.int_list(line, "lhs_dilate") or ()
    plain = (all(d == 1 for d in dilation) and all(p == (0, 0) for p in padding))
    if lhs_padding is not None and plain:  # the window sees the pad's input, padded
        lhs_shape = lhs_padding.shape
        padding = list(zip(spatial(lhs_dims, lhs_padding.low),
                           spatial(lhs_dims, lhs_padding.high), strict=True))
        dilation = [i + 1 for i in spatial(lhs_dims, lhs_padding.interior)]
    return convolution_flops(
        spatial(lhs_dims, lhs_shape), spatial(rhs_dims, rhs.shape), spatial(out_dims, out.shape),
        out_batch=out.shape[out_dims.index("b")],
        out_features=out.shape[out_dims.index("f")],
        kernel_input_features=rhs.shape[rhs_dims.index("i")],
        strides=stablehlo.int_list(line, "stride") or (),
        padding=padding,
        lhs_dilation=dilation,
        rhs_dilation=stablehlo.int_list(line, "rhs_dilate") or (),
    )
