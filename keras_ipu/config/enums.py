"""The enumerations and small value holders the configuration API takes.

Only member *names* are stable: `IPUConfig.to_dict()` writes names and
`IPUConfig.from_dict()` reads them. The integer values merely order the members
as the reference documents them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum


class DeviceConnectionType(enum.Enum):
    """Enumeration to describe the mechanism used to attach to the Poplar device.

    * `ALWAYS` indicates that the system will attach when configuring the
      device.
    * `ON_DEMAND` will defer connection to when the IPU is needed.
    * `PRE_COMPILE` will never try to attach to a device and anything which is
      meant to be executed on the device will return all zeros. Used to
      pre-compile Poplar programs on machines without IPUs.
    * `NEVER` will never try to attach to a device.

    On the device model `ALWAYS` and `ON_DEMAND` both run programs on the JAX
    devices; with `PRE_COMPILE` and `NEVER` programs are compiled and measured
    (memory checked, execution reports made, the executable cache filled) but
    not executed. With `PRE_COMPILE`, `fit`, `evaluate` and `predict` (and
    the `*_on_batch` methods, `strategy.run` and `ipu_compiler.compile`)
    return zeros for everything the device would return and the weights stay
    as they were; with `NEVER` they raise `keras_ipu.errors.IPUNotAttachedError`.

    Example:

    ```python
    config = IPUConfig()
    config.device_connection.type = DeviceConnectionType.ON_DEMAND
    ```
    """

    ALWAYS = 0
    ON_DEMAND = 1
    PRE_COMPILE = 2
    NEVER = 3


class SyntheticDataCategory(enum.Enum):
    """The kinds of data that `--use_synthetic_data` replaces (`utils.use_synthetic_data_for`).

    * `Seed`: the random seed.
    * `Infeed`: the data fed to the device.
    * `Outfeed`: the data the device returns.
    * `HostEmbedding`: host embedding lookups.
    * `Parameters`: the program's parameters (weights).

    Example:

    ```python
    keras_ipu.utils.use_synthetic_data_for(SyntheticDataCategory.Infeed)
    ```
    """

    Seed = 0
    Infeed = 1
    Outfeed = 2
    HostEmbedding = 3
    Parameters = 4


class ExecutionProfileType(enum.Enum):
    """The execution profile type indicates the desired information in the execution profile.

    * `NO_PROFILE` indicates that there should be no execution profiling.
    * `DEVICE_PROFILE` indicates that the execution profile should contain only
      device wide events.
    * `IPU_PROFILE` indicates that the profile should contain IPU level
      execution events.
    * `TILE_PROFILE` indicates that the profile should contain Tile level
      execution events.

    Accepted for porting; the device model's execution report is always the
    same (see `keras_ipu.utils.execution_report`).
    """

    NO_PROFILE = 0
    DEVICE_PROFILE = 1
    IPU_PROFILE = 2
    TILE_PROFILE = 3


class MergeRemoteBuffersBehaviour(enum.Enum):
    """When or if compatible remote buffers should be merged.

    * `NO_MERGING` indicates that there should be no merging.
    * `MERGE` indicates that all compatible remote buffers will be merged.
    * `IF_BENEFICIAL` indicates that compatible remote buffers will only be
      merged when it is considered beneficial for code re-use.

    No effect on the device model, which has no remote buffers.
    """

    NO_MERGING = 0
    MERGE = 1
    IF_BENEFICIAL = 2


class StochasticRoundingBehaviour(enum.Enum):
    """How stochastic rounding is done (`floating_point_behaviour.esr`, SDK 3).

    * `OFF` disables stochastic rounding.
    * `ON` enables it.
    * `REPLICA_IDENTICAL_ONLY` enables it where the computation is the same on
      every replica.

    `esr` takes a member or a bool (`True` is `ON`). No effect on the device
    model: JAX rounds to nearest.

    Example:

    ```python
    config.floating_point_behaviour.esr = StochasticRoundingBehaviour.ON
    assert StochasticRoundingBehaviour.from_bool(False) is StochasticRoundingBehaviour.OFF
    ```
    """

    OFF = 0
    ON = 1
    REPLICA_IDENTICAL_ONLY = 2

    @staticmethod
    def from_bool(value: bool) -> StochasticRoundingBehaviour:
        """`ON` for a true value, else `OFF`."""
        return StochasticRoundingBehaviour.ON if value else StochasticRoundingBehaviour.OFF


class SchedulingAlgorithm(enum.Enum):
    """Controls the algorithm that the scheduler uses.

    * `CHOOSE_BEST` compares several of the scheduling algorithms below and
      selects the one that leads to the lowest predicted overall peak liveness.
    * `CLUSTERING` groups clusters of operations together in order to look
      through stretches of instructions with potentially high liveness.
    * `POST_ORDER` schedules the instructions in the order which is obtained by
      walking the graph in 'post order'.
    * `LOOK_AHEAD` looks ahead a number of operations from any schedulable one,
      as given by the maximum scheduler lookahead depth and maximum scheduler
      search space size options.
    * `SHORTEST_PATH` gives priority to the shortest path to the root.

    No effect on the device model: XLA schedules the JAX programs.
    """

    CHOOSE_BEST = 0
    CLUSTERING = 1
    POST_ORDER = 2
    LOOK_AHEAD = 3
    SHORTEST_PATH = 4


class SelectionOrder(enum.Enum):
    """The order in which IPUs are selected and mapped to shards.

    On a machine of 8 C2 cards, IPUs `2k` and `2k + 1` share a card and IPU
    `i` is linked to IPU `i + 2`:

    * `AUTO`: automatically try and select the best selection given the
      network.
    * `ZIGZAG`: follow the natural ordering of IPUs: 0, 1, 2, ..., 15.
    * `SNAKE`: select IPUs such that each consecutive shard is directly
      connected via IPU-Links to the shard before and after:
      0, 1, 3, 2, 4, 5, 7, 6, 8, 9, 11, 10, 12, 13, 15, 14.
    * `HOOF`: select IPUs such that each consecutive shard is directly
      connected via IPU-Links to the shard before and after and the last and
      first shard are on the same C2 card:
      0, 2, 4, 6, 8, 10, 12, 14, 15, 13, 11, 9, 7, 5, 3, 1.

    The SNAKE and HOOF orders are particularly beneficial for pipelined models.
    On the device model the order maps virtual IPUs onto JAX devices: `AUTO`
    and `ZIGZAG` keep the natural order; `SNAKE` and `HOOF` follow the
    patterns above for any number of IPUs.

    Example:

    ```python
    config = IPUConfig()
    config.selection_order = SelectionOrder.SNAKE
    ```
    """

    AUTO = 0
    ZIGZAG = 1
    SNAKE = 2
    HOOF = 3


@dataclasses.dataclass
class KeyId:
    """A key / id pair used to verify one kind of transferred data.

    Args:
        key: The verification key.
        id: The verification id.
    """

    key: int = 0
    id: int = 0


def _key_ids() -> collections.defaultdict:
    return collections.defaultdict(KeyId)


@dataclasses.dataclass
class VerificationOptions:
    """Store pairs of key / id to use for each type of data used in the graph.

    The reference used these only when verified transfers were enabled with
    `set_transfer_options(opts, use_verified_transfers=True)`. keras_ipu
    accepts and keeps them so ported code runs; they have no meaning on the
    device model, whose transfers are ordinary JAX transfers.

    Args:
        inputs: Key / id for the inputs.
        input_parameters: Key / id for the input parameters.
        outputs: Key / id for the outputs.
        output_parameters: Key / id for the output parameters.
        infeeds: Key / id per infeed name (created on first access).
        outfeeds: Key / id per outfeed name (created on first access).
        checkpoint_in: Key / id for the checkpoint inputs.
        checkpoint_out: Key / id for the checkpoint outputs.

    Example:

    >>> o = VerificationOptions()
    >>> o.inputs.key = 1
    >>> o.infeeds["infeed"].key = 3
    """

    inputs: KeyId = dataclasses.field(default_factory=KeyId)
    input_parameters: KeyId = dataclasses.field(default_factory=KeyId)
    outputs: KeyId = dataclasses.field(default_factory=KeyId)
    output_parameters: KeyId = dataclasses.field(default_factory=KeyId)
    infeeds: collections.defaultdict = dataclasses.field(default_factory=_key_ids)
    outfeeds: collections.defaultdict = dataclasses.field(default_factory=_key_ids)
    checkpoint_in: KeyId = dataclasses.field(default_factory=KeyId)
    checkpoint_out: KeyId = dataclasses.field(default_factory=KeyId)
