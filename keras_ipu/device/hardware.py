"""Hardware descriptions of IPU versions, the numbers the device model accounts with."""

from __future__ import annotations

import dataclasses
import numbers

KIB = 1024


@dataclasses.dataclass(frozen=True)
class IPUHardware:
    """One IPU version's numbers.

    Args:
        version: The IPU version name (`"ipu1"`, `"ipu2"`, `"ipu21"`).
        name: The product name, for reports.
        tiles: Tiles per IPU.
        bytes_per_tile: In-processor memory per tile, in bytes.
        clock_hz: Tile clock frequency.
        fp32_flops_per_cycle_per_tile: Peak float32 flops per cycle and tile.
        fp16_flops_per_cycle_per_tile: Peak float16 flops per cycle and tile.
        memory_bytes_per_cycle_per_tile: Tile memory bandwidth per cycle.
        link_bytes_per_second: IPU-Link bandwidth between two IPUs.
        sync_cycles: Cycles one bulk-synchronous step costs at least
            (sync, exchange set-up and control code).
        io_tiles: Tiles reserved for I/O (`IPUConfig.io_tiles.num_io_tiles`):
            they stream data in and out, and the program's memory and compute
            are those of the other tiles.

    Example:

    >>> hw = hardware_for("ipu2")
    >>> hw.memory_capacity_bytes
    940572672
    """

    version: str
    name: str
    tiles: int
    bytes_per_tile: int
    clock_hz: float
    fp32_flops_per_cycle_per_tile: float
    fp16_flops_per_cycle_per_tile: float
    memory_bytes_per_cycle_per_tile: float
    link_bytes_per_second: float
    sync_cycles: int = 2000
    io_tiles: int = 0

    @property
    def compute_tiles(self) -> int:
        """The tiles that hold and run the program: all but the I/O tiles."""
        return self.tiles - self.io_tiles

    @property
    def memory_capacity_bytes(self) -> int:
        """In-processor memory for the program: compute tiles × bytes per tile."""
        return self.compute_tiles * self.bytes_per_tile

    def flops_per_cycle(self, half_precision: bool = False) -> float:
        """Peak flops per cycle of the whole IPU."""
        per_tile = (
            self.fp16_flops_per_cycle_per_tile
            if half_precision
            else self.fp32_flops_per_cycle_per_tile
        )
        return per_tile * self.compute_tiles

    def seconds(self, cycles: float) -> float:
        """Converts cycles to seconds at this IPU's clock."""
        return cycles / self.clock_hz


# Mk2 figures: 1,472 tiles of 624 KiB; 250 TFLOPS fp16 -> 128 flops/cycle/tile
# at ~1.33 GHz; 32 fp32 flops/cycle/tile (gc-flops on Bow); 47.5 TB/s memory
# bandwidth -> ~24 bytes/cycle/tile; 10 IPU-Links, 320 GB/s.
_GC200 = IPUHardware(
    version="ipu2",
    name="Mk2 GC200",
    tiles=1472,
    bytes_per_tile=624 * KIB,
    clock_hz=1.33e9,
    fp32_flops_per_cycle_per_tile=32.0,
    fp16_flops_per_cycle_per_tile=128.0,
    memory_bytes_per_cycle_per_tile=24.0,
    link_bytes_per_second=320e9,
)

HARDWARE: dict[str, IPUHardware] = {
    "ipu1": IPUHardware(
        version="ipu1",
        name="Mk1 GC2",
        tiles=1216,
        bytes_per_tile=256 * KIB,
        clock_hz=1.6e9,
        fp32_flops_per_cycle_per_tile=16.0,
        fp16_flops_per_cycle_per_tile=64.0,
        memory_bytes_per_cycle_per_tile=24.0,
        link_bytes_per_second=320e9,
    ),
    "ipu2": _GC200,
    # Bow is the GC200 die at 1.85 GHz (wafer-on-wafer power delivery).
    "ipu21": dataclasses.replace(_GC200, version="ipu21", name="Bow", clock_hz=1.85e9),
}


def hardware_for(version: str, tiles_per_ipu: int = 0, io_tiles: int = 0) -> IPUHardware:
    """Returns the hardware description of an IPU version.

    Args:
        version: `"ipu1"`, `"ipu2"` (Mk2 GC200, the default of
            `IPUConfig.ipu_model.version`) or `"ipu21"` (Bow).
        tiles_per_ipu: Overrides the tile count when positive; `0` keeps
            the version's standard count. Memory capacity scales with it.
        io_tiles: Tiles reserved for I/O, fewer than the tiles: the
            program's memory and flops are those of the rest.

    Returns:
        An `IPUHardware`.

    Raises:
        ValueError: For an unknown version, a negative tile count, or I/O
            tiles that leave no tile for the program.

    Example:

    >>> hardware_for("ipu2", tiles_per_ipu=8).memory_capacity_bytes
    5111808
    """
    if version not in HARDWARE:
        raise ValueError(
            f"Unknown IPU version {version!r}; valid versions are "
            f"{sorted(HARDWARE)}."
        )
    if not isinstance(tiles_per_ipu, int) or tiles_per_ipu < 0:
        raise ValueError(
            f"tiles_per_ipu must be a non-negative integer (0 = the version's "
            f"standard count), got {tiles_per_ipu!r}."
        )
    hardware = HARDWARE[version]
    if tiles_per_ipu:
        hardware = dataclasses.replace(hardware, tiles=tiles_per_ipu)
    if isinstance(io_tiles, numbers.Integral) and not isinstance(io_tiles, bool):
        io_tiles = int(io_tiles)  # NumPy integers too, as the configuration takes them
    if not isinstance(io_tiles, int) or not 0 <= io_tiles < hardware.tiles:
        raise ValueError(
            f"io_tiles.num_io_tiles must leave tiles for the program: between 0 and "
            f"{hardware.tiles - 1} on an IPU of {hardware.tiles} tiles, got {io_tiles!r}.")
    return dataclasses.replace(hardware, io_tiles=io_tiles) if io_tiles else hardware
