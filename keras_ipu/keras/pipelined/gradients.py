"""How a pipelined program holds each IPU's weight gradients while they accumulate.

Every IPU runs the same program, so every IPU's accumulator has the same
structure. Two layouts:

- **slots**: a tuple of arrays, one per slot; a slot is a (shape, dtype)
  that each IPU may fill with one of its variables. Stages of equal layers
  share all their slots, so nothing is padded and a backward op's gradients
  are the slots as they are.
- **flat**: per dtype one vector holding an IPU's variables back to back,
  padded to the longest IPU (as the weights themselves are held). Gradients
  must be concatenated into it.

`GradientLayout.of` takes the slots unless they would hold notably more
values than the flat vectors (IPUs with unlike variables).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Slots may hold this much more than the flat vectors and still be chosen.
SLOT_OVERHEAD = 1.1


@dataclasses.dataclass(frozen=True)
class GradientLayout:
    """The accumulator structure shared by the IPUs of a pipeline.

    Args:
        variables: Per IPU, `(variable index, shape, dtype)` of its trainable
            variables, in the order of its flat layout.
        slots: `(shape, dtype)` of each slot, or `None` for the flat layout.
        slot_of: Per IPU, variable index -> slot (slots layout only).
        lengths: Per dtype, the flat vectors' length (flat layout only).
    """

    variables: tuple[tuple[tuple[int, tuple[int, ...], str], ...], ...]
    slots: tuple[tuple[tuple[int, ...], str], ...] | None
    slot_of: tuple[dict[int, int], ...]
    lengths: dict[str, int]

    @classmethod
    def of(cls, variables: Sequence[Sequence[tuple[int, tuple[int, ...], str]]],
           lengths: dict[str, int]) -> GradientLayout:
        """The layout for these IPUs' variables (`lengths`: the flat vectors')."""
        variables = tuple(tuple(v) for v in variables)
        slots: list[tuple[tuple[int, ...], str]] = []
        slot_of = []
        for ipu_variables in variables:
            taken: dict[int, int] = {}
            for index, shape, dtype in ipu_variables:
                free = next((k for k, slot in enumerate(slots)
                             if slot == (shape, dtype) and k not in taken.values()), None)
                if free is None:
                    slots.append((shape, dtype))
                    free = len(slots) - 1
                taken[index] = free
            slot_of.append(taken)
        slot_values = sum(int(np.prod(shape)) for shape, _ in slots)
        if slot_values > SLOT_OVERHEAD * sum(lengths.values()):
            return cls(variables, None, (), dict(lengths))
        return cls(variables, tuple(slots), tuple(slot_of), dict(lengths))

    def zeros(self, accumulators: Mapping[str, str]) -> Any:
        """An empty accumulator; `accumulators` maps a variable dtype to its accumulator's."""
        if self.slots is None:
            return {d: jnp.zeros((n,), accumulators[d]) for d, n in self.lengths.items()}
        return tuple(jnp.zeros(shape, accumulators[kind]) for shape, kind in self.slots)

    def pack(self, ipu: int, grads: dict[int, Any], accumulators: Mapping[str, str]) -> Any:
        """Gradients of some of `ipu`'s variables (by index) as an accumulator."""
        if self.slots is None:
            parts: dict[str, list] = {d: [] for d in self.lengths}
            for index, shape, kind in self.variables[ipu]:
                grad, dtype = grads.get(index), accumulators[kind]
                parts[kind].append(jnp.zeros(int(np.prod(shape)), dtype) if grad is None
                                   else grad.astype(dtype).ravel())
            return {d: _padded(parts[d], n, accumulators[d]) for d, n in self.lengths.items()}
        by_slot = {self.slot_of[ipu][index]: grad for index, grad in grads.items()}
        return tuple(by_slot[k].astype(accumulators[kind]) if k in by_slot
                     else jnp.zeros(shape, accumulators[kind])
                     for k, (shape, kind) in enumerate(self.slots))

    def update(self, ipu: int, acc: Any, grads: dict[int, Any],
               rule: Callable[[Any, Any], Any]) -> Any:
        """`acc` with `rule(old, grad)` applied to each given variable's part only."""
        if self.slots is not None:
            acc = list(acc)
            for index, grad in grads.items():
                k = self.slot_of[ipu][index]
                acc[k] = rule(acc[k], grad.astype(acc[k].dtype))
            return tuple(acc)
        # One update per run of variables that lie back to back: an update
        # per variable rewrote the whole vector each time on XLA:CPU (109
        # variables of ResNet50's first half: 25 s per backward op).
        acc = dict(acc)
        for kind, offset, parts in self._runs(ipu, grads):
            flat = acc[kind]
            grad = jnp.concatenate([part.ravel().astype(flat.dtype) for part in parts])
            if offset == 0 and grad.size == flat.size:
                acc[kind] = rule(flat, grad)
                continue
            new = rule(jax.lax.slice_in_dim(flat, offset, offset + grad.size), grad)
            acc[kind] = jax.lax.dynamic_update_slice_in_dim(flat, new, offset, 0)
        return acc

    def _runs(self, ipu: int, grads: dict[int, Any]) -> list[tuple[str, int, list[Any]]]:
        """`(dtype, offset, gradients)` of each run of given variables held back to back."""
        runs: list[tuple[str, int, list[Any]]] = []
        last: dict[str, tuple[int, list[Any]]] = {}  # per dtype: (end, parts) of its last run
        for index, (offset, kind) in self._offsets(ipu).items():
            if index not in grads:
                continue
            end, parts = last.get(kind, (None, None))
            if end != offset:
                parts = []
                runs.append((kind, offset, parts))
            parts.append(grads[index])
            last[kind] = (offset + grads[index].size, parts)
        return runs

    def unpack(self, ipu: int, acc: Any) -> list[Any]:
        """`ipu`'s gradients, one array per variable in its flat layout's order."""
        if self.slots is not None:
            return [acc[self.slot_of[ipu][index]] for index, _, _ in self.variables[ipu]]
        offsets = self._offsets(ipu)
        return [acc[kind][offsets[index][0]:offsets[index][0] + int(np.prod(shape))]
                .reshape(shape) for index, shape, kind in self.variables[ipu]]

    def flat(self, ipu: int, acc: Any, dtype: str) -> Any:
        """`ipu`'s gradients of its `dtype` variables back to back (then padding, if any)."""
        if self.slots is None:
            return acc[dtype]
        return jnp.concatenate([grad.ravel() for grad, (_, _, kind)
                                in zip(self.unpack(ipu, acc), self.variables[ipu])
                                if kind == dtype])

    def _offsets(self, ipu: int) -> dict[int, tuple[int, str]]:
        offsets, used = {}, dict.fromkeys(self.lengths, 0)
        for index, shape, kind in self.variables[ipu]:
            offsets[index] = (used[kind], kind)
            used[kind] += int(np.prod(shape))
        return offsets


def _padded(parts: list, length: int, dtype: str) -> Any:
    used = sum(int(p.shape[0]) for p in parts)
    return jnp.concatenate(parts + [jnp.zeros((length - used,), dtype)])


__all__ = ["GradientLayout"]
