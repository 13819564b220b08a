"""The device configurations `select_ipus` picks from: `gc-info -l` of a 16-IPU system.

The seed lists them (`select_ipus`): IDs 0-15 are single IPUs (ID N is the
IPU with PCIe ID N), 16-23 pairs, 24-27 groups of four, 28-29 groups of
eight and 30 all sixteen. The multi-IPU configurations hold the IPUs the
listing gives them, in its (DNC) order: ID 24 is IPUs 5, 7, 4 and 6, "the
individual IPUs 4, 5, 6 and 7" of the tutorial. How many IPUs a device gets,
and which selections would share an IPU, is all the device model needs.
"""

from __future__ import annotations

from collections.abc import Sequence

# The seed's `gc-info -l`: each multi-IPU configuration's IPUs, by PCIe ID.
MULTI_IPU_CONFIGURATIONS: dict[int, tuple[int, ...]] = {
    16: (5, 7), 17: (4, 6), 18: (3, 1), 19: (2, 0),
    20: (13, 15), 21: (12, 14), 22: (9, 11), 23: (10, 8),
    24: (5, 7, 4, 6), 25: (3, 1, 2, 0), 26: (13, 15, 12, 14), 27: (9, 11, 10, 8),
    28: (5, 7, 4, 6, 3, 1, 2, 0), 29: (13, 15, 12, 14, 9, 11, 10, 8),
    30: (5, 7, 4, 6, 3, 1, 2, 0, 13, 15, 12, 14, 9, 11, 10, 8),
}
SINGLE_IPUS = 16
LAST_ID = max(MULTI_IPU_CONFIGURATIONS)


def ipus_of(config_id: int) -> tuple[int, ...]:
    """The IPUs (PCIe IDs 0-15) of one device configuration, in the listing's order.

    Args:
        config_id: A configuration ID, 0 to `LAST_ID`.

    Returns:
        Its IPUs.

    Raises:
        ValueError: For an ID the listing does not have.

    Example:

    >>> ipus_of(18)
    (3, 1)
    """
    if 0 <= config_id < SINGLE_IPUS:
        return (config_id,)
    if config_id in MULTI_IPU_CONFIGURATIONS:
        return MULTI_IPU_CONFIGURATIONS[config_id]
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


def _shown(ipus: tuple[int, ...]) -> str:
    return ", ".join(str(i) for i in ipus)
