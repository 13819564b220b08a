"""The device configurations `select_ipus` picks from: `gc-info -l` of a 16-IPU system.

The seed lists them (`select_ipus`): IDs 0-15 are single IPUs, 16-23 pairs,
24-27 groups of four, 28-29 groups of eight and 30 all sixteen. A
configuration's IPUs are numbered here by their place in the system (ID
16 + k holds IPUs 2k and 2k + 1, ID 24 + k IPUs 4k to 4k + 3, ...), which is
all the device model needs: how many IPUs a device gets, and which
selections would share an IPU.
"""

from __future__ import annotations

from collections.abc import Sequence

# (first ID, IPUs per configuration, configurations of that size).
CONFIGURATIONS = ((0, 1, 16), (16, 2, 8), (24, 4, 4), (28, 8, 2), (30, 16, 1))
LAST_ID = 30


def ipus_of(config_id: int) -> range:
    """The IPUs (numbered 0-15) of one device configuration.

    Args:
        config_id: A configuration ID, 0 to `LAST_ID`.

    Returns:
        Its IPUs, as a range.

    Raises:
        ValueError: For an ID the listing does not have.

    Example:

    >>> ipus_of(25)
    range(4, 8)
    """
    for first, size, count in CONFIGURATIONS:
        if first <= config_id < first + count:
            start = (config_id - first) * size
            return range(start, start + size)
    raise ValueError(
        f"select_ipus: no device configuration {config_id}; the modelled 16-IPU system "
        f"(`gc-info -l`) has IDs 0-{LAST_ID}: 0-15 one IPU each, 16-23 two, 24-27 four, "
        f"28-29 eight, 30 sixteen.")


def device_sizes(config_ids: Sequence[int]) -> tuple[int, ...]:
    """The IPUs of each selected configuration, checking that no two share an IPU.

    Args:
        config_ids: The selected configuration IDs, one per TensorFlow-style
            device.

    Returns:
        The number of IPUs of each device.

    Raises:
        ValueError: For an unknown ID, or two selections sharing IPUs.

    Example:

    >>> device_sizes([24, 25])
    (4, 4)
    """
    taken: dict[int, int] = {}
    for config_id in config_ids:
        for ipu in ipus_of(config_id):
            if ipu in taken:
                raise ValueError(
                    f"select_ipus: configurations {taken[ipu]} and {config_id} share IPU {ipu} "
                    f"(ID {taken[ipu]} holds IPUs {_shown(ipus_of(taken[ipu]))}, ID {config_id} "
                    f"IPUs {_shown(ipus_of(config_id))}); select configurations without "
                    f"common IPUs.")
            taken[ipu] = config_id
    return tuple(len(ipus_of(config_id)) for config_id in config_ids)


def _shown(ipus: range) -> str:
    return str(ipus.start) if len(ipus) == 1 else f"{ipus.start}-{ipus.stop - 1}"
