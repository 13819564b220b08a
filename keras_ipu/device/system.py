"""The configured IPU system: virtual IPUs mapped onto JAX devices.

The configured system is the package's one piece of global state: the IPU
TensorFlow API configures a process-wide system with
`configure_ipu_system`, and keras_ipu keeps that model.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from keras_ipu.device.hardware import IPUHardware

# CPU devices the package asks JAX for when it starts the backends itself:
# enough for the largest usual configuration, so that reconfiguring to more
# IPUs later in the same process still works.
DEFAULT_CPU_DEVICES = 8

_SELECTION_ORDERS = ("AUTO", "ZIGZAG", "SNAKE", "HOOF")


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


_current: IPUSystem | None = None


def configure(
    device_sizes: Sequence[int],
    hardware: IPUHardware,
    *,
    selection_order: str = "AUTO",
    options: Mapping[str, Any] | None = None,
) -> IPUSystem:
    """Configures the process's IPU system, replacing any earlier one.

    Each virtual IPU gets one accelerator when enough exist, otherwise one
    CPU device. When JAX has not started its backends yet, the package asks
    it for enough CPU devices itself; no environment variable is needed.

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
        RuntimeError: When JAX already started with too few devices.

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
    devices = jax_devices_for(num_ipus)
    order = selection_permutation(selection_order, num_ipus)
    ipus = tuple(VirtualIPU(i, devices[order[i]]) for i in range(num_ipus))
    _current = IPUSystem(
        ipus=ipus,
        device_sizes=sizes,
        hardware=hardware,
        selection_order=selection_order,
        options=types.MappingProxyType(dict(options or {})),
    )
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


def jax_devices_for(num_ipus: int) -> list[jax.Device]:
    """JAX devices for `num_ipus` virtual IPUs: accelerators, else CPUs.

    Raises:
        RuntimeError: When JAX already started with fewer devices, naming
            what to do instead.
    """
    _request_cpu_devices(max(num_ipus, DEFAULT_CPU_DEVICES))
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if len(accelerators) >= num_ipus:
        return accelerators
    cpus = jax.devices("cpu")
    if len(cpus) < num_ipus:
        raise RuntimeError(
            f"{num_ipus} IPUs need {num_ipus} JAX devices, but JAX already "
            f"started with {len(cpus)} CPU device(s) and "
            f"{len(accelerators)} accelerator(s). Configure the IPU system "
            f"before any JAX computation runs (before creating Keras models "
            f"or arrays), or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_ipus}."
        )
    return cpus


def _request_cpu_devices(count: int) -> None:
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


def _device_index(device: int | str, names: Sequence[str]) -> int:
    if isinstance(device, str) and device in names:
        return names.index(device)
    if isinstance(device, int) and 0 <= device < len(names):
        return device
    raise ValueError(f"Unknown IPU device {device!r}; the system has {list(names)}.")
