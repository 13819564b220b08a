"""The IPUs of a multi-process job: every process's virtual IPUs, in one global order.

Each process configures the same IPU system on its own devices (its
`jax.local_devices()`); the job's IPUs are process 0's, then process 1's,
and so on, each process's IPUs on its devices as its own system places
them. Replicas over these IPUs span the job: global replica
`process × local replicas + local replica`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from keras_ipu.device.system import VirtualIPU


def process_devices(process: int) -> list[jax.Device]:
    """A process's devices, in the order its `jax.local_devices()` lists them."""
    return sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


def global_ipus(local_ipus: Sequence[VirtualIPU]) -> tuple[VirtualIPU, ...]:
    """The job's IPUs for this process's `local_ipus`, the same IPUs in every process.

    Args:
        local_ipus: IPUs of this process's system (on its local devices).

    Returns:
        `local_ipus` as every process has them, process by process,
        numbered `0 .. processes × len(local_ipus) - 1`; in a single process,
        `local_ipus` unchanged.

    Example:

    >>> [ipu.device.process_index for ipu in global_ipus(system.ipus)]   # 2 processes
    [0, 0, 1, 1]
    """
    local_ipus = tuple(local_ipus)
    if jax.process_count() == 1:
        return local_ipus
    mine = process_devices(jax.process_index())
    positions = [mine.index(ipu.device) for ipu in local_ipus]
    ipus: list[VirtualIPU] = []
    for process in range(jax.process_count()):
        devices = process_devices(process)
        for position in positions:  # numbered one by one, not one number per process
            ipus.append(VirtualIPU(len(ipus), devices[position]))
    return tuple(ipus)


__all__: Sequence[str] = ["global_ipus", "process_devices"]
