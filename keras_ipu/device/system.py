"""The configured IPU system: virtual IPUs mapped onto JAX devices.

The configured system is the package's one piece of global state: the IPU
TensorFlow API configures a process-wide system with
`configure_ipu_system`, and keras_ipu keeps that model.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from keras_ipu.device.hardware import IPUHardware

# CPU devices the package asks JAX for when it starts the backends itself:
# enough for the largest usual configuration, so that reconfiguring to more
# IPUs later in the same process still works.
DEFAULT_CPU_DEVICES = 8
# The most CPU devices the package asks for: XLA:CPU's collectives over many
# hundreds of devices time out (a pipeline on 512 aborted the process), so
# more IPUs than this share devices, as on a machine with fewer.
MAX_CPU_DEVICES = 64

_SELECTION_ORDERS = ("AUTO", "ZIGZAG", "SNAKE", "HOOF")

_LOG = logging.getLogger("keras_ipu.device")


@dataclasses.dataclass(frozen=True)
class VirtualIPU:
    """One virtual IPU.

    Args:
        index: The IPU's index in the system (`IPU 0`, `IPU 1`, ...).
        device: The JAX device that runs its programs and holds its memory.
    """

    index: int
    device: jax.Device


@dataclasses.dataclass(frozen=True)
class IPUSystem:
    """A configured system of virtual IPUs.

    Args:
        ipus: The virtual IPUs, in index order.
        device_sizes: IPUs per logical device (`/device:IPU:0` gets the
            first `device_sizes[0]` IPUs, and so on).
        hardware: The hardware every IPU models.
        selection_order: How IPU indices were mapped to JAX devices.
        options: Runtime options from the configuration (read-only).
        programs: Compiled graph-style programs (`compile`, `strategy.run`),
            most recently used last.
        shard_counts: The shards each graph-style function was found to use
            (its functions held weakly).

    Example:

    >>> system = configure((2,), hardware_for("ipu2"))
    >>> [ipu.index for ipu in system.ipus_of_device(0)]
    [0, 1]
    """

    ipus: tuple[VirtualIPU, ...]
    device_sizes: tuple[int, ...]
    hardware: IPUHardware
    selection_order: str = "AUTO"
    options: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )
    # The graph-style programs compiled for this system (`compiled_calls.call_compiled`),
    # kept so that calling one again does not retrace; a new configuration starts afresh.
    programs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # Per graph-style function (held weakly: not kept alive), per (IPUs, shard), the shards
    # its computation uses: a program that is not kept learns them once, not at each call.
    shard_counts: weakref.WeakKeyDictionary = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary, compare=False, repr=False)
    # The host ends of the host embeddings registered with this system, by name
    # (`keras_ipu.ops.host_embedding`), as IPU TensorFlow registers them with its session.
    host_embeddings: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def num_ipus(self) -> int:
        """The total number of IPUs in the system."""
        return len(self.ipus)

    @property
    def device_names(self) -> tuple[str, ...]:
        """The logical device names: `/device:IPU:0`, `/device:IPU:1`, ..."""
        return tuple(f"/device:IPU:{i}" for i in range(len(self.device_sizes)))

    def ipus_of_device(self, device: int | str = 0) -> tuple[VirtualIPU, ...]:
        """The IPUs of one logical device, by index or name.

        Raises:
            ValueError: When the device does not exist.
        """
        index = _device_index(device, self.device_names)
        start = sum(self.device_sizes[:index])
        return self.ipus[start : start + self.device_sizes[index]]

    def option(self, name: str, default: Any = None) -> Any:
        """One runtime option, or `default` when it was not given."""
        return self.options.get(name, default)

    @property
    def recomputes(self) -> bool:
        """Whether pipelines recompute activations in their backward pass
        (`IPUConfig.allow_recompute`)."""
        return bool(self.option("allow_recompute", False))

    @property
    def shared_devices(self) -> dict[jax.Device, tuple[int, ...]]:
        """The IPUs of each JAX device that runs more than one IPU (empty when none share).

        Example:

        >>> configure((8,), hardware_for("ipu2")).shared_devices   # JAX has 2 devices
        {CpuDevice(id=0): (0, 1, 2, 3), CpuDevice(id=1): (4, 5, 6, 7)}
        """
        by_device: dict[jax.Device, tuple[int, ...]] = {}
        for ipu in self.ipus:
            by_device[ipu.device] = (*by_device.get(ipu.device, ()), ipu.index)
        return {device: ipus for device, ipus in by_device.items() if len(ipus) > 1}

    def describe(self) -> str:
        """One line per JAX device: the IPUs it runs.

        Example:

        >>> print(configure((4,), hardware_for("ipu2")).describe())  # JAX has 2 devices
        4 IPUs on 2 JAX devices: IPUs 0-1 share TFRT_CPU_0; IPUs 2-3 share TFRT_CPU_1
        """
        devices = list(dict.fromkeys(ipu.device for ipu in self.ipus))
        if len(devices) == self.num_ipus:
            return f"{self.num_ipus} IPU(s), each on its own JAX device"
        parts = []
        for device in devices:
            ipus = [ipu.index for ipu in self.ipus if ipu.device == device]
            parts.append(f"IPU {ipus[0]} runs on {device}" if len(ipus) == 1 else
                         f"IPUs {ipu_ranges(ipus)} share {device}")
        plural = "s" if len(devices) > 1 else ""
        return f"{self.num_ipus} IPUs on {len(devices)} JAX device{plural}: " + "; ".join(parts)


_current: IPUSystem | None = None


def configure(
    device_sizes: Sequence[int],
    hardware: IPUHardware,
    *,
    selection_order: str = "AUTO",
    options: Mapping[str, Any] | None = None,
) -> IPUSystem:
    """Configures the process's IPU system, replacing any earlier one.

    The IPUs run on the accelerators when JAX has any, otherwise on CPU
    devices; when JAX has not started its backends yet, the package asks it
    for enough CPU devices itself (no environment variable is needed). Each
    IPU gets its own device when enough exist. Otherwise (one GPU; JAX
    already started with fewer CPU devices; more IPUs than that) the IPUs
    share devices in contiguous blocks of equal size, as many devices as
    divide the IPU count: replicas that share a device run batched, pipeline
    stages that share a device run there, and the execution report still
    accounts each IPU. The selection order then orders the blocks.

    Args:
        device_sizes: IPUs per logical device, e.g. `(1,)` or `(2, 2)`.
        hardware: The hardware description every IPU models.
        selection_order: `"AUTO"`, `"ZIGZAG"`, `"SNAKE"` or `"HOOF"`.
        options: Runtime options kept on the system (read-only).

    Returns:
        The configured `IPUSystem`.

    Raises:
        ValueError: For empty or non-positive `device_sizes` or an unknown
            selection order.

    Example:

    >>> system = configure((4,), hardware_for("ipu2"))
    >>> system.num_ipus
    4
    """
    global _current
    sizes = tuple(device_sizes)
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(
            f"device_sizes must be a non-empty sequence of positive integers, "
            f"got {device_sizes!r}."
        )
    if selection_order not in _SELECTION_ORDERS:
        raise ValueError(
            f"Unknown selection order {selection_order!r}; valid orders are "
            f"{list(_SELECTION_ORDERS)}."
        )
    num_ipus = sum(sizes)
    devices = jax_devices_for(num_ipus, sizes)
    block = num_ipus // len(devices)
    order = selection_permutation(selection_order, len(devices))
    ipus = tuple(VirtualIPU(i, devices[order[i // block]]) for i in range(num_ipus))
    _current = IPUSystem(
        ipus=ipus,
        device_sizes=sizes,
        hardware=hardware,
        selection_order=selection_order,
        options=types.MappingProxyType(dict(options or {})),
    )
    if block > 1:
        _LOG.info("%s", _current.describe())
    return _current


def update_options(**changes: Any) -> IPUSystem:
    """Replaces the configured system by one with `changes` to its runtime options.

    Args:
        **changes: Option names and their new values.

    Returns:
        The new configured system (its kept graph-style programs start afresh).

    Raises:
        RuntimeError: When no IPU system is configured.

    Example:

    >>> update_options(identical_replicas=True).option("identical_replicas")
    True
    """
    global _current
    current = require()
    _current = dataclasses.replace(
        current, options=types.MappingProxyType({**current.options, **changes}))
    return _current


def reset() -> None:
    """Forgets the configured system (the next `fit` needs a new one)."""
    global _current
    _current = None


def current() -> IPUSystem | None:
    """The configured system, or `None`."""
    return _current


def require() -> IPUSystem:
    """The configured system.

    Raises:
        RuntimeError: When no system is configured, saying what to call.
    """
    if _current is None:
        raise RuntimeError(
            "No IPU system is configured. Configure one before running a "
            "model, e.g.:\n\n"
            "    config = keras_ipu.config.IPUConfig()\n"
            "    config.auto_select_ipus = 1\n"
            "    config.configure_ipu_system()\n"
        )
    return _current


def jax_devices_for(num_ipus: int, device_sizes: Sequence[int] = ()) -> list[jax.Device]:
    """The distinct JAX devices `num_ipus` virtual IPUs run on.

    Accelerators when JAX has any (all IPUs on one GPU rather than on CPU
    devices), else CPU devices: one per IPU when enough exist, otherwise the
    most devices that divide `num_ipus` such that each runs an equal,
    contiguous block of IPUs and no logical device's IPUs straddle two
    blocks unevenly (each logical device is whole blocks, or inside one).

    Args:
        num_ipus: The number of IPUs to place.
        device_sizes: IPUs per logical device, in order (one device of all
            when empty).

    Returns:
        The devices, `num_ipus // len(devices)` IPUs each.

    Example:

    >>> len(jax_devices_for(8))   # JAX started with 3 CPU devices
    2
    """
    request_cpu_devices(min(max(num_ipus, DEFAULT_CPU_DEVICES), MAX_CPU_DEVICES))
    # This process's devices: in a multi-process job the others' devices run
    # their own IPUs (see `processes.global_ipus`).
    accelerators = [d for d in jax.local_devices() if d.platform != "cpu"]
    pool = accelerators or jax.local_devices(backend="cpu")
    sizes = tuple(device_sizes) or (num_ipus,)
    count = max(n for n in range(1, min(num_ipus, len(pool)) + 1)
                if num_ipus % n == 0 and _blocks_fit(sizes, num_ipus // n))
    return pool[:count]


def _blocks_fit(device_sizes: Sequence[int], block: int) -> bool:
    """Whether each logical device is whole blocks of `block` IPUs, or lies inside one."""
    offsets = itertools.accumulate(device_sizes, initial=0)
    return all((start % block == 0 and size % block == 0)
               or start // block == (start + size - 1) // block
               for start, size in zip(offsets, device_sizes))


def request_cpu_devices(count: int) -> None:
    """Asks JAX for at least `count` CPU devices, if its backends have not started."""
    # jax_num_cpu_devices can only be set before the backends start; once
    # they run, the devices that exist are the ones we have.
    count = max(count, _forced_host_device_count())
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass


def _forced_host_device_count() -> int:
    match = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    return int(match.group(1)) if match else 0


def selection_permutation(order: str, count: int) -> list[int]:
    """The JAX-device index for each IPU index under a selection order.

    SNAKE walks pairs of IPUs so consecutive IPUs are link neighbours
    (0, 1, 3, 2, 4, 5, 7, 6, ...); HOOF goes up the even IPUs and back down
    the odd ones (0, 2, 4, ..., 5, 3, 1), so the last and first are
    neighbours. AUTO and ZIGZAG keep the natural order.

    Example:

    >>> selection_permutation("SNAKE", 8)
    [0, 1, 3, 2, 4, 5, 7, 6]
    """
    natural = list(range(count))
    if order == "SNAKE":
        return [
            i if (i // 2) % 2 == 0 or i + 1 - 2 * (i % 2) >= count else i + 1 - 2 * (i % 2)
            for i in natural
        ]
    if order == "HOOF":
        return natural[0::2] + natural[1::2][::-1]
    return natural


def ipu_ranges(indices: Sequence[int]) -> str:
    """IPU indices as ranges, for messages.

    Example:

    >>> ipu_ranges([0, 1, 2, 5])
    '0-2, 5'
    """
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _device_index(device: int | str, names: Sequence[str]) -> int:
    if isinstance(device, str) and device in names:
        return names.index(device)
    # NumPy integers index like ints; a bool is no device number.
    if isinstance(device, (int, np.integer)) and not isinstance(device, (bool, np.bool_)):
        if 0 <= device < len(names):
            return int(device)
    raise ValueError(f"Unknown IPU device {device!r}; the system has {list(names)}.")
