"""The IPUConfig schema, as data, and the IPUConfig class it defines.

Every option of the reference's `IPUConfig` (the seeds' SDK, and the options
SDK 3 added that ported code sets) is declared here with
its type, default and meaning, and with an `effect` note saying what it does
on keras_ipu's device model. Most options tune the Poplar compiler and have no
counterpart in JAX: they are accepted and validated so ported code runs, and
documented as having no effect.
"""

from __future__ import annotations

# typing.List / typing.Tuple / typing.Union on purpose: the type hint's
# string is what AttributeMetadata.type reports, and the reference reports it
# in this spelling.
from typing import List, Tuple, Union  # noqa: UP035

from keras_ipu.config import attributes
from keras_ipu.config.attributes import (
    Category,
    Option,
    at_least,
    between,
    distinct,
    each,
    mapping_entry,
    one_of,
)
from keras_ipu.config.enums import (
    DeviceConnectionType,
    SchedulingAlgorithm,
    SelectionOrder,
    StochasticRoundingBehaviour,
)
from keras_ipu.config.optimizations import OPTIMIZATIONS, ignored

IPU_VERSIONS = ("ipu1", "ipu2", "ipu21")

# The type the reference gives both IPU selection options.
IPUSelection = Union[int, List[int], Tuple[int, ...]]  # noqa: UP006, UP007


def _fraction(value: object) -> bool:
    # Poplar takes option values as strings ("0.6"), so accept those as well
    # as numbers; bools are neither.
    if isinstance(value, bool):
        return False
    try:
        return 0.0 <= float(value) <= 1.0
    except (TypeError, ValueError):
        return False


_AVAILABLE_MEMORY_PROPORTION = mapping_entry(
    "availableMemoryProportion",
    attributes.Check("must be a number in [0, 1] (a float or a string such as '0.6')", _fraction),
)


# The IPUs of all the devices together: the largest IPU system holds 1024.
_AT_MOST_A_POD1024 = attributes.Check(
    "must ask for at most 1024 IPUs in all (the largest IPU system, a Bow Pod1024)",
    lambda value: sum(value) <= 1024 if isinstance(value, (list, tuple)) else True)


# Poplar takes its options by name: a key that is not a string could not be one.
_NAMED = attributes.Check("must have option names (strings) as keys",
                          lambda options: all(isinstance(key, str) for key in options))


def _poplar_options(doc: str, checks=()) -> Option:
    return ignored("poplar_options", dict, {}, doc, (_NAMED, *checks))


_CONVOLUTIONS = Category(
    "convolutions",
    "Sub-category containing configuration options that affect convolutions.",
    (
        _poplar_options(
            "Set the PopLibs convolution options for the session. Must be a dictionary of "
            "valid PopLibs convolution options (see createWeights in the PopLibs API "
            "reference); they are applied to all convolution operations. Of note is "
            '"availableMemoryProportion", the proportion of tile memory made available as '
            "temporary memory for convolutions (a float between 0 and 1.0).",
            (_AVAILABLE_MEMORY_PROPORTION,),
        ),
    ),
)

_DEVICE_CONNECTION = Category(
    "device_connection",
    "Sub-category containing configuration options to control when to attach to IPU devices.",
    (
        Option(
            "type",
            DeviceConnectionType,
            DeviceConnectionType.ALWAYS,
            "Configure when to attach to the device. For example, you can use this to compile "
            "and cache a program without attaching to an IPU, and then later run on a real "
            "IPU device without recompiling. Setting the connection type doesn't impact the "
            "ability to profile a model. For possible values, see DeviceConnectionType.",
            effect="ALWAYS and ON_DEMAND run programs on the JAX devices; with NEVER and "
            "PRE_COMPILE programs are compiled and measured but not executed: PRE_COMPILE "
            "returns zeros for everything the device would return (logs, predictions) and "
            "leaves the weights as they were, NEVER raises IPUNotAttachedError.",
        ),
        Option(
            "version",
            str,
            "",
            'Version of the IPU hardware to use (string). Must be one of "ipu1", "ipu2", '
            '"ipu21" or "" (default). Only required if the connection type is '
            "DeviceConnectionType.PRE_COMPILE or DeviceConnectionType.NEVER.",
            effect="validated only; the device model models ipu_model.version, whatever "
            "the connection type.",
            checks=(one_of("", *IPU_VERSIONS),),
        ),
        ignored(
            "enable_remote_buffers",
            bool,
            False,
            "When the connection type is PRE_COMPILE, NEVER or ON_DEMAND, whether remote "
            "buffers are enabled and supported on the system which will eventually execute "
            "the compiled programs. Ignored with ALWAYS, where the device can be queried.",
        ),
    ),
)

# The job's instances are its processes (`keras-ipu run --num-instances N`): a configuration
# describing another job would train with another global batch, so it is refused.
_JOB_CHECKED = ("checked against the job when a system that runs programs is configured: "
                "with process_count set, it must equal the job's instances (keras-ipu run "
                "--num-instances) and process_index this instance's index (PRE_COMPILE and "
                "NEVER accept any).")

_MULTI_REPLICA_DISTRIBUTION = Category(
    "multi_replica_distribution",
    "Sub-category containing configuration options controlling multi replica distribution. "
    "This uses the Poplar runtime replica subset feature to let multiple processes "
    "collaborate on executing the same Poplar program by executing a subset of the global "
    "replicas each. The total global replication factor will be equal to the local "
    "replication factor multiplied by the process_count.",
    (
        Option(
            "process_index",
            int,
            0,
            "The index of the current process being configured.",
            effect=_JOB_CHECKED,
            checks=(at_least(0),),
        ),
        Option(
            "process_count",
            int,
            0,
            "The total number of processes. When set to 0 (default), multi-replica "
            "distribution will not be used.",
            effect=_JOB_CHECKED,
            checks=(at_least(0),),
        ),
    ),
)

_EXPERIMENTAL = Category(
    "experimental",
    "Sub-category containing experimental configuration options that may be changed or "
    "removed with short or no notice.",
    (
        ignored(
            "always_rearrange_copies_on_the_host",
            bool,
            False,
            "Data streamed to/from the device might be stored in different layouts on the "
            "device and on the host; if so it is rearranged on the device by default. When "
            "enabled, the rearrangement is performed on the host at the expense of latency.",
        ),
        ignored(
            "enable_remote_buffer_embedding",
            bool,
            False,
            "When set to true, HostEmbedding will make use of Poplar remote buffers.",
        ),
        Option(
            "enable_prng_stability",
            bool,
            False,
            "Enable the management of random seeds that keeps the weights of replicas from "
            "diverging under stochastic rounding (SDK 3).",
            effect="no effect: the device model rounds to nearest, and replicas' weights stay "
            "bit-identical (their gradients are reduced across replicas).",
        ),
        _MULTI_REPLICA_DISTRIBUTION,
    ),
)

_FLOATING_POINT_NO_EFFECT = (
    "no effect on the device model: JAX follows the host device's IEEE 754 arithmetic "
    "(round to nearest, infinities on overflow)."
)
_FLOATING_POINT_TRAP = (
    "fit, evaluate and predict programs check every operation and stop at the first "
    "that raises it: IPUFloatingPointError, the execution's results dropped, the model "
    "keeping the last completed execution's weights (docs/semantics.md)."
)
_FLOATING_POINT_ALL = (
    "sets the three exception traps (inv, div0, oflo); esr and nanoo have no effect."
)


_FLOATING_POINT_EFFECTS = {"inv": _FLOATING_POINT_TRAP, "div0": _FLOATING_POINT_TRAP,
                           "oflo": _FLOATING_POINT_TRAP, "set_all": _FLOATING_POINT_ALL}


def _floating_point(name: str, doc: str) -> Option:
    effect = _FLOATING_POINT_EFFECTS.get(name, _FLOATING_POINT_NO_EFFECT)
    return Option(name, bool, False, doc, effect=effect)


_FLOATING_POINT_BEHAVIOUR = Category(
    "floating_point_behaviour",
    "Sub-category containing configuration options that affect the floating point "
    "behaviour of the IPU devices, including stochastic rounding and behaviour when an "
    "overflow is encountered during execution.",
    (
        _floating_point(
            "inv",
            "If True, a floating point invalid operation (defined by IEEE 754) will cause an "
            "exception.",
        ),
        _floating_point(
            "div0", "If True, a floating point divide by zero operation will cause an exception."
        ),
        _floating_point("oflo", "If True, a floating point overflow will cause an exception."),
        Option(
            "esr",
            Union[bool, StochasticRoundingBehaviour],  # noqa: UP007
            False,
            "If True, stochastic rounding will be enabled; SDK 3 also takes a "
            "StochasticRoundingBehaviour (OFF, ON, REPLICA_IDENTICAL_ONLY).",
            effect=_FLOATING_POINT_NO_EFFECT,
        ),
        _floating_point("nanoo", "If True, Not-a-Number (NaN) on overflow mode will be enabled."),
        _floating_point(
            "set_all",
            "If True, unconditionally enables all floating point behaviour options (inv, "
            "div0, oflo, esr, nanoo) when the IPUConfig is configured.",
        ),
    ),
)

_IO_TILES = Category(
    "io_tiles",
    "Sub-category containing configuration options that affect parallel I/O on a subset of tiles.",
    (
        Option("num_io_tiles", int, 0, "Number of tiles to reserve for I/O.",
               effect="the tiles are reserved: an IPU's program has the memory and the "
                      "flops of the other tiles (the memory check and the estimated cycles "
                      "count those); it must leave at least one tile",
               checks=(at_least(0),)),
        ignored(
            "place_ops_on_io_tiles",
            bool,
            False,
            "Whether to place TensorFlow I/O operations on the I/O tiles.",
        ),
        ignored(
            "available_memory_proportion",
            float,
            0.9,
            "Proportion of I/O tiles' memory which can be used to store data in, with the "
            "remaining memory assumed to be used by code. If the data to be stored on I/O "
            "tiles exceeds the I/O tiles' memory times this proportion, a warning is given "
            "and the operations are not placed on I/O tiles.",
            (between(0, 1),),
        ),
    ),
)

_IPU_MODEL = Category(
    "ipu_model",
    "Sub-category containing configuration options related to the IPU model. In the "
    "reference these only had an effect when running with the IPU model enabled "
    "(TF_POPLAR_FLAGS=--use_ipu_model); keras_ipu always runs its device model, so they "
    "always apply.",
    (
        ignored(
            "compile_ipu_code", bool, True, "Whether or not to compile IPU code for modelling."
        ),
        Option(
            "tiles_per_ipu",
            int,
            0,
            "The number of tiles per IPU Model device. When set to 0 (the default), the "
            "standard number of tiles for the chosen version is used.",
            effect="tiles of every virtual IPU, which scales its memory and compute; 0 uses "
            "--ipu_model_tiles from the flags if given, else the version's standard count.",
            checks=(at_least(0),),
        ),
        Option(
            "version",
            str,
            "ipu2",
            'Specify the IPU version to be used by the IPU Model. Options are "ipu1", "ipu2" '
            '(default) or "ipu21".',
            effect="the IPU hardware every virtual IPU models (tiles, memory per tile, clock, "
            "flops) for memory and cycle accounting.",
            checks=(one_of(*IPU_VERSIONS),),
        ),
    ),
)

_MATMULS = Category(
    "matmuls",
    "Sub-category containing configuration options that affect matmuls.",
    (
        ignored(
            "clear_pass_type",
            bool,
            False,
            'Controls whether or not the "Pass" type of the MatMul is passed to PopLibs. When '
            "set to True, PopLibs will not be told about the type of the MatMuls in the "
            "graph. This can save memory in some circumstances.",
        ),
        _poplar_options(
            "Set the PopLibs matrix multiplication options for the session. Must be a "
            "dictionary of valid PopLibs matrix multiplication options (see matMul in the "
            "PopLibs API reference); they are applied to all matmul operations. Of note is "
            '"availableMemoryProportion", the proportion of tile memory made available as '
            "temporary memory for matrix multiplications (a float between 0 and 1.0).",
            (_AVAILABLE_MEMORY_PROPORTION,),
        ),
    ),
)

_NORMS = Category(
    "norms",
    "Sub-category containing configuration options that affect normalizations. They apply "
    "to all normalisation operations (Fused Batch Norm, IPU Specific Group Norm, IPU "
    "Specific Layer Norm and IPU Specific Instance Norm).",
    (
        ignored(
            "use_stable_statistics",
            bool,
            False,
            "If True, computes the mean minus the activations first before computing the "
            "variance. The implementation with this flag set to True is slower than when set "
            "to False.",
        ),
        Category(
            "experimental",
            "Sub-category containing experimental configuration options for normalizations "
            "that may be changed or removed with short or no notice.",
            (
                Option(
                    "distributed_batch_norm_replica_group_size",
                    int,
                    1,
                    "When executing fused batch-norms for training, how many replicas to "
                    "aggregate the batch statistics across: with four replicas and a value "
                    "of two, replicas 0 and 1 form one group and replicas 2 and 3 another, "
                    "and the batch norm statistics are synchronously all-reduced across the "
                    "replicas within a group every time the layer is executed. Should not be "
                    "used with model parallelism (pipelining) and is not supported with I/O "
                    "tiles.",
                    effect="in a replicated fit, every training keras.layers."
                    "BatchNormalization computes its batch mean and variance over its group "
                    "of this many consecutive replicas (the statistics of the group's "
                    "batches together), both to normalise and for the moving statistics, "
                    "and its gradients reach every replica of the group; 1 changes nothing. "
                    "The replication factor must be a multiple of it and the model not "
                    "pipelined, or fit raises before training (models without "
                    "BatchNormalization are not checked). Layer, group and instance "
                    "normalisation have no batch statistics and are unaffected.",
                    checks=(at_least(1),),
                ),
            ),
        ),
    ),
)


_SLICES = Category(
    "slices",
    "Sub-category containing configuration options that affect slices of embeddings (SDK 3).",
    (
        _poplar_options(
            "Set the PopLibs slice options for the session: a dictionary of valid PopLibs "
            "slice options (see embedding::plan in the PopLibs API reference), applied to "
            "the multi-slices and multi-updates embeddings make.",
            (_AVAILABLE_MEMORY_PROPORTION,),
        ),
    ),
)

_POOLING = Category(
    "pooling",
    "Sub-category containing configuration options that affect pooling operations.",
    (
        _poplar_options(
            "Set the PopLibs pooling compilation options for the session. Must be a "
            "dictionary of valid PopLibs pooling options (see pool in the PopLibs API "
            "reference); they are applied to all pooling operations.",
        ),
    ),
)

_SCHEDULING = Category(
    "scheduling",
    "Sub-category containing configuration options that affect the scheduling of "
    "operations in the graph during compilation.",
    (
        ignored(
            "algorithm",
            SchedulingAlgorithm,
            SchedulingAlgorithm.CHOOSE_BEST,
            "A SchedulingAlgorithm. If SchedulingAlgorithm.CHOOSE_BEST (default), several "
            "schedules will be created and the one with the lowest predicted liveness chosen. "
            "Setting this to a specific scheduling algorithm forces the compiler to use it.",
        ),
        # A depth or search space of 0 would leave LOOK_AHEAD nothing to
        # search, so both must be at least 1.
        ignored(
            "maximum_scheduler_lookahead_depth",
            int,
            5,
            "Controls how far the LOOK_AHEAD scheduling algorithm can look beyond a given "
            "scheduling decision to understand the max-liveness implications. Only for "
            "SchedulingAlgorithm.LOOK_AHEAD.",
            (at_least(1),),
        ),
        ignored(
            "maximum_scheduler_search_space_size",
            int,
            64,
            "The upper-limit to the size of the LOOK_AHEAD scheduling algorithm's search space "
            "to guarantee that it will terminate in a reasonable amount of time. Only for "
            "SchedulingAlgorithm.LOOK_AHEAD.",
            (at_least(1),),
        ),
    ),
)

IPU_CONFIG_SCHEMA = Category(
    "",
    "Configuration of an IPU system.",
    (
        Option(
            "allow_recompute",
            bool,
            False,
            "Whether or not to recompute instructions during training. If enabled, "
            "instructions/pipeline stages of the forward pass are recomputed in the backward "
            "pass instead of preserving their activations, reducing memory at the expense of "
            "extra computation. Stateful operations cannot be recomputed.",
            effect="recomputes pipeline stage activations in the backward pass (pipelining).",
        ),
        Option(
            "selection_order",
            SelectionOrder,
            SelectionOrder.AUTO,
            "The order in which IPUs are selected and mapped to physical IPU devices when "
            "using multi-IPU devices. Must be one of SelectionOrder.",
            effect="the order in which virtual IPUs are mapped onto JAX devices: AUTO and "
            "ZIGZAG keep the natural order; SNAKE (0, 1, 3, 2, 4, 5, 7, 6, ...) and HOOF "
            "(0, 2, 4, ..., 5, 3, 1) generalise the reference's 16-IPU orders to any count.",
        ),
        ignored(
            "serialization_output_folder",
            str,
            "",
            "Specifies the directory in which serialized Poplar executables will be saved. The "
            'default ("") disables executable serialization.',
        ),
        ignored(
            "compilation_poplar_options",
            dict,
            {},
            "Set the Poplar compilation options for the session. Must be a dictionary of valid "
            "Poplar compilation flags (see the Engine class in the Poplar API reference).",
            checks=(_NAMED,),
        ),
        ignored(
            "gcl_poplar_options",
            dict,
            {},
            "Set the IPU options for the Graphcore Communication Library. Must be a dictionary "
            "of valid GCL options (see allReduce in the GCL API reference); they are applied "
            "to all applicable GCL collective operations.",
            checks=(_NAMED,),
        ),
        Option(
            "auto_select_ipus",
            IPUSelection,
            [],
            "Configure the IPUs to be used by the session: a system of TensorFlow devices "
            "labeled /device:IPU:0, /device:IPU:1 and so on, each controlling the given "
            "number of IPUs. `1` creates one device with one IPU; `[2, 2]` two devices with "
            "two IPUs each; `[1, 2]` one device with one IPU and one with two. The empty "
            "default means not set.",
            effect="the number of virtual IPUs of each device; every virtual IPU is mapped "
            "onto one JAX device. At most 1024 a device, the largest IPU system (a Bow Pod1024).",
            checks=(each(between(1, 1024)), _AT_MOST_A_POD1024),
        ),
        Option(
            "select_ipus",
            IPUSelection,
            [],
            "Configure the IPUs to be used by the session by device configuration index (as "
            "listed by `gc-info -l`): a system of TensorFlow devices labeled /device:IPU:0, "
            "/device:IPU:1 and so on, one per index. `0` creates one device using "
            "configuration 0; `[0, 1]` two devices. The empty default means not set.",
            effect="each ID is one device with the IPUs of that configuration in the "
            "gc-info listing of a 16-IPU system: 0-15 one IPU, 16-23 two, 24-27 four, 28-29 "
            "eight, 30 sixteen; selections that share IPUs are refused when configuring.",
            checks=(each(between(0, 30)), distinct()),
        ),
        _CONVOLUTIONS,
        _DEVICE_CONNECTION,
        _EXPERIMENTAL,
        _FLOATING_POINT_BEHAVIOUR,
        _IO_TILES,
        _IPU_MODEL,
        _MATMULS,
        _NORMS,
        OPTIMIZATIONS,
        _POOLING,
        _SCHEDULING,
        _SLICES,
    ),
)


class IPUConfig(attributes.Config):
    """Configuration of an IPU system, set attribute by attribute.

    Every attribute below exists with the type and default the reference
    documents. Assignments are checked at once: an unknown name raises
    `AttributeError` naming the closest valid one, a value of the wrong type
    raises `TypeError`, a value out of range raises `ValueError`, and the
    stored value is then unchanged. Sub-categories are reached by attribute
    access (`config.ipu_model.tiles_per_ipu = 8`) and cannot be assigned.

    Each attribute's "keras_ipu" note says what it does on the device model;
    most options tune Poplar and have no effect there.

    Example:

    ```python
    config = IPUConfig()
    config.auto_select_ipus = 2
    config.ipu_model.tiles_per_ipu = 8
    config.configure_ipu_system()
    ```
    """

    _schema = IPU_CONFIG_SCHEMA

    def configure_ipu_system(self, device: str = "cpu") -> None:
        """Configure the IPU system with this config.

        Same as `keras_ipu.config.configure_ipu_system(self, device)`.

        Args:
            device: The CPU device which is local to the IPU hardware: a
                string such as `"cpu"` or `"/device:CPU:0"`. No other effect.

        Raises:
            ValueError: When neither or both of `auto_select_ipus` and
                `select_ipus` are set, or `device` is not a CPU device.
            RuntimeError: When the JAX devices cannot hold the IPUs.
        """
        # Imported here: the system module imports this one.
        from keras_ipu.config import system

        system.configure_ipu_system(self, device)


# Generated from the schema so the documentation cannot drift from it
# (skipped under `python -OO`, which strips docstrings).
if IPUConfig.__doc__:
    IPUConfig.__doc__ = (
        IPUConfig.__doc__.rstrip()
        + "\n\n    "
        + attributes.describe(IPU_CONFIG_SCHEMA, width=75).replace("\n", "\n    ")
        + "\n    "
    )
