"""Tests of keras_ipu.config: the IPUConfig schema and machinery, flags, configure_ipu_system.

The device layer is replaced by fakes that record their arguments, so these
tests need neither Keras nor JAX devices.
"""

import copy
import enum
import logging
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from keras_ipu import config as ipu_config
from keras_ipu.config import (
    AttributeMetadata,
    DeviceConnectionType,
    ExecutionProfileType,
    IPUConfig,
    MergeRemoteBuffersBehaviour,
    SchedulingAlgorithm,
    SelectionOrder,
    StochasticRoundingBehaviour,
    VerificationOptions,
    attributes,
    flags,
)
from keras_ipu.config import system as config_system

# Every attribute of the reference's IPUConfig (doc section 18.7), with the
# type it documents and its default.
UNION = "typing.Union[int, typing.List[int], typing.Tuple[int, ...]]"
SPEC = {
    "allow_recompute": ("bool", False),
    "selection_order": ("SelectionOrder", SelectionOrder.AUTO),
    "serialization_output_folder": ("str", ""),
    "compilation_poplar_options": ("dict", {}),
    "gcl_poplar_options": ("dict", {}),
    "auto_select_ipus": (UNION, []),
    "select_ipus": (UNION, []),
    "convolutions.poplar_options": ("dict", {}),
    "device_connection.type": ("DeviceConnectionType", DeviceConnectionType.ALWAYS),
    "device_connection.version": ("str", ""),
    "device_connection.enable_remote_buffers": ("bool", False),
    "experimental.always_rearrange_copies_on_the_host": ("bool", False),
    "experimental.enable_remote_buffer_embedding": ("bool", False),
    "experimental.multi_replica_distribution.process_index": ("int", 0),
    "experimental.multi_replica_distribution.process_count": ("int", 0),
    "floating_point_behaviour.inv": ("bool", False),
    "floating_point_behaviour.div0": ("bool", False),
    "floating_point_behaviour.oflo": ("bool", False),
    # SDK 3 also takes a StochasticRoundingBehaviour.
    "floating_point_behaviour.esr": (
        "typing.Union[bool, keras_ipu.config.enums.StochasticRoundingBehaviour]", False),
    "floating_point_behaviour.nanoo": ("bool", False),
    "floating_point_behaviour.set_all": ("bool", False),
    "io_tiles.num_io_tiles": ("int", 0),
    "io_tiles.place_ops_on_io_tiles": ("bool", False),
    "io_tiles.available_memory_proportion": ("float", 0.9),
    "ipu_model.compile_ipu_code": ("bool", True),
    "ipu_model.tiles_per_ipu": ("int", 0),
    "ipu_model.version": ("str", "ipu2"),
    "matmuls.clear_pass_type": ("bool", False),
    "matmuls.poplar_options": ("dict", {}),
    "norms.use_stable_statistics": ("bool", False),
    "norms.experimental.distributed_batch_norm_replica_group_size": ("int", 1),
    "optimizations.prefetch_data_streams": ("bool", True),
    "optimizations.combine_embedding_lookups": ("bool", False),
    "optimizations.combine_matmuls": ("bool", False),
    "optimizations.enable_graph_outlining": ("bool", True),
    "optimizations.merge_infeed_io_copies": ("bool", False),
    "optimizations.maximum_cross_replica_sum_buffer_size": ("int", 0),
    "optimizations.maximum_reduce_scatter_buffer_size": ("int", 0),
    "optimizations.maximum_inter_ipu_copies_buffer_size": ("int", 0),
    "optimizations.maximum_send_recv_cluster_size": ("int", 0),
    "optimizations.minimum_remote_tensor_size": ("int", 128),
    "optimizations.merge_remote_buffers": (
        "MergeRemoteBuffersBehaviour",
        MergeRemoteBuffersBehaviour.IF_BENEFICIAL,
    ),
    "optimizations.enable_gather_simplifier": ("bool", True),
    "optimizations.triangular_solve_expander_block_size": ("int", 0),
    "optimizations.cholesky_block_size": ("int", 0),
    "optimizations.enable_fast_math": ("bool", False),
    "pooling.poplar_options": ("dict", {}),
    "scheduling.algorithm": ("SchedulingAlgorithm", SchedulingAlgorithm.CHOOSE_BEST),
    "scheduling.maximum_scheduler_lookahead_depth": ("int", 5),
    "scheduling.maximum_scheduler_search_space_size": ("int", 64),
    # SDK 3's additions, which ported code sets (before: AttributeError).
    "experimental.enable_prng_stability": ("bool", False),
    "optimizations.maximum_reduce_many_buffer_size": ("int", 0),
    "optimizations.maximum_all_gather_buffer_size": ("int", 0),
    "optimizations.enable_dynamic_slice_replacement": ("bool", True),
    "optimizations.math.fast": ("bool", False),
    "optimizations.math.dot_strength": ("bool", True),
    "slices.poplar_options": ("dict", {}),
}
CATEGORIES = {
    "convolutions",
    "device_connection",
    "experimental",
    "experimental.multi_replica_distribution",
    "floating_point_behaviour",
    "io_tiles",
    "ipu_model",
    "matmuls",
    "norms",
    "norms.experimental",
    "optimizations",
    "optimizations.math",
    "pooling",
    "scheduling",
    "slices",
}


def get(config, path):
    for name in path.split("."):
        config = getattr(config, name)
    return config


def put(config, path, value):
    *parents, name = path.split(".")
    setattr(get(config, ".".join(parents)) if parents else config, name, value)


# --------------------------------------------------------------------------
# Schema: every attribute of the specification


@pytest.mark.parametrize("path", sorted(SPEC))
def test_attribute_exists_with_documented_type_and_default(path):
    expected_type, expected_default = SPEC[path]
    config = IPUConfig()
    value = get(config, path)
    assert value == expected_default and type(value) is type(expected_default)
    meta = config.get_attribute_metadata(path)
    assert meta.name == path
    assert meta.type == expected_type
    assert meta.default == expected_default
    assert meta.doc and meta.effect


def test_schema_has_exactly_the_specified_attributes():
    options = {p for p, n in attributes.walk(IPUConfig._schema) if isinstance(n, attributes.Option)}
    categories = {
        p for p, n in attributes.walk(IPUConfig._schema) if isinstance(n, attributes.Category)
    }
    assert options == set(SPEC)
    assert categories == CATEGORIES


def test_class_docstring_documents_every_attribute():
    for path in [*SPEC, *CATEGORIES]:
        assert f"    {path} (" in IPUConfig.__doc__


def test_device_model_effects_are_documented():
    config = IPUConfig()
    assert "no effect" in config.get_attribute_metadata("optimizations.combine_matmuls").effect
    assert "no effect" in config.get_attribute_metadata("floating_point_behaviour.esr").effect
    assert "recomputes" in config.get_attribute_metadata("allow_recompute").effect
    assert "JAX devices" in config.get_attribute_metadata("selection_order").effect
    assert "not executed" in config.get_attribute_metadata("device_connection.type").effect


def test_enums_have_the_specified_members():
    members = {
        DeviceConnectionType: ["ALWAYS", "ON_DEMAND", "PRE_COMPILE", "NEVER"],
        ExecutionProfileType: ["NO_PROFILE", "DEVICE_PROFILE", "IPU_PROFILE", "TILE_PROFILE"],
        MergeRemoteBuffersBehaviour: ["NO_MERGING", "MERGE", "IF_BENEFICIAL"],
        SchedulingAlgorithm: [
            "CHOOSE_BEST",
            "CLUSTERING",
            "POST_ORDER",
            "LOOK_AHEAD",
            "SHORTEST_PATH",
        ],
        SelectionOrder: ["AUTO", "ZIGZAG", "SNAKE", "HOOF"],
        StochasticRoundingBehaviour: ["OFF", "ON", "REPLICA_IDENTICAL_ONLY"],
    }
    for kind, names in members.items():
        assert issubclass(kind, enum.Enum)
        assert list(kind.__members__) == names


def test_verification_options_hold_keys_and_ids():
    options = VerificationOptions()
    options.inputs.key = 1
    options.infeeds["infeed"].key = 3
    assert options.inputs.key == 1 and options.infeeds["infeed"].key == 3
    assert options.outfeeds["x"].id == 0


def test_public_names():
    for name in [
        "IPUConfig",
        "configure_ipu_system",
        "reset_ipu_configuration",
        "get_ipu_config",
        "AttributeMetadata",
        "DeviceConnectionType",
        "ExecutionProfileType",
        "MergeRemoteBuffersBehaviour",
        "SchedulingAlgorithm",
        "SelectionOrder",
        "VerificationOptions",
    ]:
        assert name in ipu_config.__all__ and hasattr(ipu_config, name)


def test_import_is_light():
    code = (
        "import sys, keras_ipu.config; "
        "assert 'keras' not in sys.modules and 'jax' not in sys.modules, "
        "[m for m in ('keras', 'jax') if m in sys.modules]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------
# Setting and getting


def test_hierarchical_set_and_get():
    config = IPUConfig()
    config.ipu_model.tiles_per_ipu = 8
    config.floating_point_behaviour.esr = True
    config.norms.experimental.distributed_batch_norm_replica_group_size = 2
    config.experimental.multi_replica_distribution.process_count = 4
    category = config.ipu_model
    category.version = "ipu21"
    assert config.ipu_model.tiles_per_ipu == 8
    assert config.floating_point_behaviour.esr is True
    assert config.norms.experimental.distributed_batch_norm_replica_group_size == 2
    assert config.experimental.multi_replica_distribution.process_count == 4
    assert config.ipu_model.version == "ipu21"


@pytest.mark.parametrize(
    "path, suggestion",
    [
        ("auto_selct_ipus", "'auto_select_ipus'"),
        ("ipu_model.tile_per_ipu", "'ipu_model.tiles_per_ipu'"),
        ("floating_point_behaviour.esrr", "'floating_point_behaviour.esr'"),
        (
            "norms.experimental.distributed_batch_norm_replica_group",
            "'norms.experimental.distributed_batch_norm_replica_group_size'",
        ),
        (
            "experimental.multi_replica_distribution.proces_count",
            "'experimental.multi_replica_distribution.process_count'",
        ),
        # The right name in the wrong category.
        ("tiles_per_ipu", "'ipu_model.tiles_per_ipu'"),
    ],
)
def test_unknown_attribute_names_path_and_closest_name(path, suggestion):
    config = IPUConfig()
    with pytest.raises(AttributeError, match=f"'{path}'") as error:
        put(config, path, 1)
    assert f"Did you mean {suggestion}?" in str(error.value)
    with pytest.raises(AttributeError, match=f"Did you mean {suggestion}"):
        get(config, path)
    assert config == IPUConfig()


def test_unknown_attribute_without_close_name_lists_valid_names():
    config = IPUConfig()
    with pytest.raises(AttributeError, match="'ipu_model.xyzzy'.*tiles_per_ipu, version"):
        config.ipu_model.xyzzy = 1
    with pytest.raises(AttributeError, match="top level: allow_recompute"):
        config.xyzzy  # noqa: B018
    assert not hasattr(config, "xyzzy") and hasattr(config, "ipu_model")


def test_private_names_cannot_be_set():
    with pytest.raises(AttributeError):
        IPUConfig()._values_ = {}


@pytest.mark.parametrize("path", ["ipu_model", "norms.experimental", "experimental"])
def test_assigning_a_category_raises(path):
    config = IPUConfig()
    with pytest.raises(AttributeError, match=f"{path} is a category"):
        put(config, path, 3)
    assert config == IPUConfig()


TYPE_ERRORS = [
    ("allow_recompute", 1, "bool"),
    ("allow_recompute", "yes", "bool"),
    ("ipu_model.tiles_per_ipu", True, "int"),
    ("ipu_model.tiles_per_ipu", 1.5, "int"),
    ("ipu_model.tiles_per_ipu", "8", "int"),
    ("io_tiles.available_memory_proportion", True, "float"),
    ("io_tiles.available_memory_proportion", "0.5", "float"),
    ("ipu_model.version", 2, "str"),
    ("compilation_poplar_options", [("a", "b")], "dict"),
    ("selection_order", "SNAKE", "SelectionOrder"),
    ("selection_order", DeviceConnectionType.ALWAYS, "SelectionOrder"),
    ("device_connection.type", 0, "DeviceConnectionType"),
    ("auto_select_ipus", True, "typing.Union"),
    ("auto_select_ipus", [True], "typing.Union"),
    ("auto_select_ipus", [1.0], "typing.Union"),
    ("auto_select_ipus", "1", "typing.Union"),
    ("select_ipus", {0: 1}, "typing.Union"),
]


@pytest.mark.parametrize("path, value, expected", TYPE_ERRORS)
def test_wrong_type_raises_type_error_and_keeps_value(path, value, expected):
    config = IPUConfig()
    with pytest.raises(TypeError) as error:
        put(config, path, value)
    message = str(error.value)
    assert f"IPUConfig.{path} " in message
    assert f"of type {expected}" in message
    assert repr(value) in message and type(value).__name__ in message
    assert get(config, path) == SPEC[path][1]


@pytest.mark.parametrize(
    "path, value",
    [
        ("io_tiles.available_memory_proportion", 1),
        ("io_tiles.available_memory_proportion", 0),
        ("auto_select_ipus", 2),
        ("auto_select_ipus", [1, 2]),
        ("auto_select_ipus", (2, 2)),
        ("auto_select_ipus", 1024),
        ("auto_select_ipus", []),
        ("select_ipus", 0),
        ("select_ipus", [0, 1]),
        ("select_ipus", (24, 25)),
        ("device_connection.version", "ipu21"),
        ("ipu_model.version", "ipu1"),
    ],
)
def test_values_of_the_right_type_are_stored(path, value):
    config = IPUConfig()
    put(config, path, value)
    assert get(config, path) == value


VALUE_ERRORS = [
    ("auto_select_ipus", 0, r"\[1, 1024\]"),
    ("auto_select_ipus", [2, 0], r"\[1, 1024\]"),
    # Configuring it built a billion virtual IPUs in Python (minutes, gigabytes).
    ("auto_select_ipus", 10**9, r"\[1, 1024\]"),
    ("select_ipus", -1, r"\[0, 30\]"),
    ("select_ipus", [0, -1], r"\[0, 30\]"),
    ("select_ipus", [0, 31], r"\[0, 30\]"),
    ("select_ipus", [1, 1], "repeat"),
    ("ipu_model.tiles_per_ipu", -8, ">= 0"),
    ("ipu_model.version", "ipu3", "'ipu1', 'ipu2', 'ipu21'"),
    ("ipu_model.version", "", "'ipu1', 'ipu2', 'ipu21'"),
    ("device_connection.version", "ipu3", "'', 'ipu1', 'ipu2', 'ipu21'"),
    ("io_tiles.available_memory_proportion", 1.5, r"\[0, 1\]"),
    ("io_tiles.available_memory_proportion", -0.1, r"\[0, 1\]"),
    ("io_tiles.available_memory_proportion", float("nan"), r"\[0, 1\]"),
    ("io_tiles.num_io_tiles", -1, ">= 0"),
    ("optimizations.maximum_cross_replica_sum_buffer_size", -1, ">= 0"),
    ("optimizations.maximum_reduce_scatter_buffer_size", -1, ">= 0"),
    ("optimizations.maximum_inter_ipu_copies_buffer_size", -1, ">= 0"),
    ("optimizations.maximum_send_recv_cluster_size", -1, ">= 0"),
    ("optimizations.minimum_remote_tensor_size", -1, ">= 0"),
    ("optimizations.triangular_solve_expander_block_size", -1, ">= 0"),
    ("optimizations.cholesky_block_size", -1, ">= 0"),
    ("scheduling.maximum_scheduler_lookahead_depth", 0, ">= 1"),
    ("scheduling.maximum_scheduler_search_space_size", 0, ">= 1"),
    ("norms.experimental.distributed_batch_norm_replica_group_size", 0, ">= 1"),
    ("experimental.multi_replica_distribution.process_index", -1, ">= 0"),
    ("experimental.multi_replica_distribution.process_count", -1, ">= 0"),
    ("matmuls.poplar_options", {"availableMemoryProportion": 1.5}, r"\[0, 1\]"),
    ("matmuls.poplar_options", {"availableMemoryProportion": "abc"}, r"\[0, 1\]"),
    ("convolutions.poplar_options", {"availableMemoryProportion": "1.2"}, r"\[0, 1\]"),
    ("convolutions.poplar_options", {"availableMemoryProportion": True}, r"\[0, 1\]"),
]


@pytest.mark.parametrize("path, value, valid", VALUE_ERRORS)
def test_wrong_value_raises_value_error_and_keeps_value(path, value, valid):
    config = IPUConfig()
    with pytest.raises(ValueError, match=valid) as error:
        put(config, path, value)
    assert f"IPUConfig.{path} " in str(error.value)
    assert get(config, path) == SPEC[path][1]


def test_failed_set_keeps_a_non_default_value():
    config = IPUConfig()
    config.ipu_model.tiles_per_ipu = 8
    config.auto_select_ipus = [1, 2]
    with pytest.raises(ValueError):
        config.ipu_model.tiles_per_ipu = -1
    with pytest.raises(TypeError):
        config.ipu_model.tiles_per_ipu = "16"
    with pytest.raises(ValueError):
        config.auto_select_ipus = [4, 0]
    assert config.ipu_model.tiles_per_ipu == 8
    assert config.auto_select_ipus == [1, 2]


@pytest.mark.parametrize("proportion", [0.6, "0.6", 0, "1", 1.0])
def test_poplar_options_accept_available_memory_proportion(proportion):
    config = IPUConfig()
    options = {"availableMemoryProportion": proportion, "partialsType": "half"}
    config.matmuls.poplar_options = options
    config.convolutions.poplar_options = options
    assert config.matmuls.poplar_options == options


def test_assigned_containers_are_copied():
    config = IPUConfig()
    options = {"availableMemoryProportion": "0.5"}
    sizes = [1, 2]
    config.matmuls.poplar_options = options
    config.auto_select_ipus = sizes
    options["availableMemoryProportion"] = "7"
    sizes.append(0)
    assert config.matmuls.poplar_options == {"availableMemoryProportion": "0.5"}
    assert config.auto_select_ipus == [1, 2]


def test_defaults_are_not_shared_between_configs():
    first, second = IPUConfig(), IPUConfig()
    first.compilation_poplar_options["x"] = "1"
    first.auto_select_ipus.append(3)
    assert second.compilation_poplar_options == {} and second.auto_select_ipus == []
    assert IPUConfig().get_attribute_metadata("auto_select_ipus").default == []


def test_attributes_cannot_be_deleted():
    with pytest.raises(AttributeError):
        del IPUConfig().allow_recompute


# --------------------------------------------------------------------------
# Metadata


def test_attribute_metadata():
    config = IPUConfig()
    meta = config.get_attribute_metadata("ipu_model.tiles_per_ipu")
    assert isinstance(meta, AttributeMetadata)
    assert (meta.name, meta.type, meta.default) == ("ipu_model.tiles_per_ipu", "int", 0)
    assert meta.deprecated is False and meta.deprecated_msg is None
    assert "tiles" in meta.doc and "tiles" in meta.effect
    assert meta.check_type(8) is True
    with pytest.raises(TypeError, match="ipu_model.tiles_per_ipu.*int"):
        meta.check_type(True)
    meta.warn_if_deprecated()


def test_attribute_metadata_relative_to_a_category():
    config = IPUConfig()
    meta = config.norms.get_attribute_metadata(
        "experimental.distributed_batch_norm_replica_group_size"
    )
    assert meta.name == "norms.experimental.distributed_batch_norm_replica_group_size"
    assert config.ipu_model.get_attribute_metadata("version").name == "ipu_model.version"
    union = config.get_attribute_metadata("select_ipus")
    assert union.check_type([0, 1]) and union.check_type(3) and union.check_type((1,))
    with pytest.raises(TypeError):
        union.check_type([0, False])


def test_category_metadata():
    meta = IPUConfig().get_attribute_metadata("norms.experimental")
    assert meta.name == "norms.experimental"
    assert meta.type is None and meta.default is None and not meta.deprecated
    with pytest.raises(TypeError, match="category"):
        meta.check_type(1)


def test_metadata_of_unknown_attribute():
    config = IPUConfig()
    with pytest.raises(AttributeError, match="Did you mean 'ipu_model.version'"):
        config.get_attribute_metadata("ipu_model.verison")
    with pytest.raises(AttributeError, match="'ipu_model.tiles_per_ipu.x'"):
        config.get_attribute_metadata("ipu_model.tiles_per_ipu.x")
    with pytest.raises(AttributeError, match="'ipu_model.xyzzy'"):
        config.ipu_model.get_attribute_metadata("xyzzy")


class _Legacy(attributes.Config):
    _schema = attributes.Category(
        "",
        "A schema with a deprecated option.",
        (
            attributes.Option("fresh", int, 0, "A current option."),
            attributes.Option("stale", bool, False, "An old option.", deprecated_msg="Use fresh."),
        ),
    )


def test_deprecated_option_logs_a_warning(caplog):
    config = _Legacy()
    meta = config.get_attribute_metadata("stale")
    assert meta.deprecated and meta.deprecated_msg == "Use fresh."
    with caplog.at_level(logging.WARNING, logger="keras_ipu.config"):
        config.stale = True
    assert "_Legacy.stale is deprecated: Use fresh." in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="keras_ipu.config"):
        config.fresh = 1
    assert caplog.text == ""


def test_schema_names_may_not_hide_methods():
    with pytest.raises(TypeError, match="to_dict"):

        class _Clash(attributes.Config):
            _schema = attributes.Category(
                "", "", (attributes.Option("to_dict", int, 0, "Clashes."),)
            )


# --------------------------------------------------------------------------
# Whole configs


def _changed_config():
    config = IPUConfig()
    config.auto_select_ipus = [1, 2]
    config.selection_order = SelectionOrder.SNAKE
    config.ipu_model.tiles_per_ipu = 8
    config.matmuls.poplar_options = {"availableMemoryProportion": "0.3"}
    config.optimizations.merge_remote_buffers = MergeRemoteBuffersBehaviour.MERGE
    config.norms.experimental.distributed_batch_norm_replica_group_size = 2
    return config


def test_to_dict_is_nested_plain_data():
    data = _changed_config().to_dict()
    assert data["auto_select_ipus"] == [1, 2]
    assert data["selection_order"] == "SNAKE"
    assert data["ipu_model"] == {"compile_ipu_code": True, "tiles_per_ipu": 8, "version": "ipu2"}
    assert data["optimizations"]["merge_remote_buffers"] == "MERGE"
    assert data["norms"]["experimental"] == {"distributed_batch_norm_replica_group_size": 2}
    assert data["experimental"]["multi_replica_distribution"]["process_count"] == 0
    assert IPUConfig().ipu_model.to_dict() == {
        "compile_ipu_code": True,
        "tiles_per_ipu": 0,
        "version": "ipu2",
    }


def test_to_dict_from_dict_round_trip():
    config = _changed_config()
    assert IPUConfig.from_dict(config.to_dict()) == config
    assert IPUConfig.from_dict(IPUConfig().to_dict()) == IPUConfig()
    assert IPUConfig.from_dict({"selection_order": SelectionOrder.HOOF}).selection_order is (
        SelectionOrder.HOOF
    )
    partial = IPUConfig.from_dict({"ipu_model": {"version": "ipu21"}})
    assert partial.ipu_model.version == "ipu21" and partial.ipu_model.tiles_per_ipu == 0


def test_from_dict_on_a_config_updates_it_and_takes_the_references_flat_form():
    # The reference: `config.from_dict(d)` sets the values on `config`; its `to_dict` wrote
    # flat dotted names and enum values.
    config = IPUConfig()
    config.auto_select_ipus = 2
    same = config.from_dict({"ipu_model.tiles_per_ipu": 16, "selection_order": 3,
                             "device_connection.type": "ON_DEMAND"})
    assert same is config and config.auto_select_ipus == 2  # left out: kept
    assert config.ipu_model.tiles_per_ipu == 16
    assert config.selection_order is SelectionOrder.HOOF
    assert config.device_connection.type is DeviceConnectionType.ON_DEMAND
    assert IPUConfig.from_json(config.to_json()) == config
    other = IPUConfig()
    assert other.from_json(config.to_json()) is other and other == config
    with pytest.raises(ValueError, match="SelectionOrder"):
        IPUConfig.from_dict({"selection_order": 9})
    with pytest.raises(AttributeError, match="tiles"):
        config.from_dict({"ipu_model.tiles": 4})
    with pytest.raises(AttributeError, match="no attribute 'auto_select_ipus.x'"):
        config.from_dict({"auto_select_ipus.x": 1})  # an option is not a category


def test_the_json_round_trip_holds_for_tuples_and_numpy_numbers():
    import numpy as np

    config = IPUConfig()
    config.auto_select_ipus = (1, 2)  # the reference's Union[int, List[int], Tuple[int, ...]]
    config.ipu_model.tiles_per_ipu = np.int64(8)
    back = IPUConfig.from_json(config.to_json())  # np.int64 failed to_json
    assert back == config and back.ipu_model == config.ipu_model  # the tuple was unequal
    assert back.auto_select_ipus == [1, 2] and config.auto_select_ipus == (1, 2)


@pytest.mark.parametrize(
    "data, error, match",
    [
        ({"ipu_modle": {}}, AttributeError, "Did you mean 'ipu_model'"),
        ({"ipu_model": {"tiles": 8}}, AttributeError, "'ipu_model.tiles'"),
        ({"ipu_model": 8}, AttributeError, "category"),
        ({"selection_order": "SPIRAL"}, ValueError, "AUTO, ZIGZAG, SNAKE, HOOF"),
        ({"ipu_model": {"tiles_per_ipu": "8"}}, TypeError, "int"),
        ({"auto_select_ipus": [0]}, ValueError, r"\[1, 1024\]"),
        ([("auto_select_ipus", 1)], TypeError, "mapping"),
    ],
)
def test_from_dict_errors(data, error, match):
    with pytest.raises(error, match=match):
        IPUConfig.from_dict(data)


def test_equality():
    assert IPUConfig() == IPUConfig()
    assert _changed_config() == _changed_config()
    assert IPUConfig() != _changed_config()
    assert IPUConfig() != object()
    assert _changed_config().ipu_model == _changed_config().ipu_model
    assert IPUConfig().ipu_model != _changed_config().ipu_model


def test_deepcopy_is_independent():
    config = _changed_config()
    clone = copy.deepcopy(config)
    assert clone == config and clone is not config
    clone.ipu_model.tiles_per_ipu = 16
    clone.matmuls.poplar_options["x"] = "y"
    assert config.ipu_model.tiles_per_ipu == 8
    assert "x" not in config.matmuls.poplar_options
    with pytest.raises(AttributeError, match="Did you mean"):
        clone.ipu_model.tile_per_ipu = 1


def test_pickle_round_trip():
    config = _changed_config()
    restored = pickle.loads(pickle.dumps(config))
    assert restored == config
    restored.allow_recompute = True
    with pytest.raises(TypeError):
        restored.allow_recompute = 1


def test_repr_and_str_list_non_default_values():
    assert repr(IPUConfig()) == "IPUConfig()"
    assert "all default" in str(IPUConfig())
    config = IPUConfig()
    config.auto_select_ipus = 2
    config.selection_order = SelectionOrder.SNAKE
    config.ipu_model.tiles_per_ipu = 8
    assert repr(config) == (
        "IPUConfig(selection_order=SelectionOrder.SNAKE, auto_select_ipus=2, "
        "ipu_model.tiles_per_ipu=8)"
    )
    text = str(config)
    assert "3 non-default" in text and "  ipu_model.tiles_per_ipu = 8" in text
    assert repr(config.ipu_model) == (
        "IPUConfig.ipu_model(compile_ipu_code=True, tiles_per_ipu=8, version='ipu2')"
    )


def test_dir_lists_attributes():
    assert {"auto_select_ipus", "ipu_model", "to_dict"} <= set(dir(IPUConfig()))
    assert {"tiles_per_ipu", "version"} <= set(dir(IPUConfig().ipu_model))


def test_type_matches():
    union = int | list[int] | tuple[int, ...]
    assert attributes.type_matches(union, (1, 2))
    assert not attributes.type_matches(union, (1, "2"))
    assert attributes.type_matches(float, 3) and not attributes.type_matches(float, False)
    schema_type = IPUConfig._schema.member("auto_select_ipus").type
    assert attributes.type_matches(schema_type, [1]) and not attributes.type_matches(
        schema_type, 1.0
    )
    assert attributes.type_name(schema_type) == UNION


# --------------------------------------------------------------------------
# Flags


def test_flags_default_when_unset():
    assert flags.read_flags({}) == flags.PoplarFlags()


def test_flags_parse_every_known_flag():
    environ = {
        "TF_POPLAR_FLAGS": (
            "--use_ipu_model --ipu_model_tiles=8 --use_synthetic_data "
            "--synthetic_data_initializer=random '--executable_cache_path=/tmp/my cache'"
        )
    }
    assert flags.read_flags(environ) == flags.PoplarFlags(
        use_ipu_model=True,
        ipu_model_tiles=8,
        use_synthetic_data=True,
        synthetic_data_initializer="random",
        executable_cache_path="/tmp/my cache",
    )


def test_keras_ipu_flags_win_over_tf_poplar_flags():
    environ = {
        "TF_POPLAR_FLAGS": "--ipu_model_tiles=8 --use_synthetic_data",
        "KERAS_IPU_FLAGS": "--ipu_model_tiles=4 --use_synthetic_data=false",
    }
    parsed = flags.read_flags(environ)
    assert parsed.ipu_model_tiles == 4 and parsed.use_synthetic_data is False


def test_unknown_flags_warn_once():
    environ = {
        "TF_POPLAR_FLAGS": "--max_compilation_threads=4 --use_ipu_model",
        "KERAS_IPU_FLAGS": "--show_progress_bar=true stray",
    }
    with pytest.warns(UserWarning) as record:
        parsed = flags.read_flags(environ)
    assert len(record) == 1
    message = str(record[0].message)
    assert "--max_compilation_threads=4" in message and "--show_progress_bar=true" in message
    assert parsed.unknown == ("--max_compilation_threads=4", "--show_progress_bar=true", "stray")
    assert parsed.use_ipu_model is True


@pytest.mark.parametrize(
    "variable, text, flag",
    [
        ("TF_POPLAR_FLAGS", "--ipu_model_tiles=abc", "--ipu_model_tiles=abc"),
        ("TF_POPLAR_FLAGS", "--ipu_model_tiles=-4", "--ipu_model_tiles=-4"),
        ("KERAS_IPU_FLAGS", "--ipu_model_tiles", "--ipu_model_tiles"),
        ("KERAS_IPU_FLAGS", "--use_ipu_model=maybe", "--use_ipu_model=maybe"),
        ("TF_POPLAR_FLAGS", "--executable_cache_path=", "--executable_cache_path="),
        ("TF_POPLAR_FLAGS", "--executable_cache_path", "--executable_cache_path"),
    ],
)
def test_bad_flag_values_name_variable_and_flag(variable, text, flag):
    with pytest.raises(ValueError, match=f"{variable}: flag '{flag}'"):
        flags.read_flags({variable: text})


def test_unbalanced_quotes_name_the_variable():
    with pytest.raises(ValueError, match="KERAS_IPU_FLAGS"):
        flags.read_flags({"KERAS_IPU_FLAGS": "--executable_cache_path='/tmp"})


def test_flags_read_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("TF_POPLAR_FLAGS", "--ipu_model_tiles=32")
    monkeypatch.delenv("KERAS_IPU_FLAGS", raising=False)
    assert flags.read_flags().ipu_model_tiles == 32


# --------------------------------------------------------------------------
# configure_ipu_system, with a fake device layer


class FakeDevice:
    """Records what configure_ipu_system asks of the device layer."""

    def __init__(self):
        self.configured = []
        self.hardware = []
        self.resets = 0
        self.system = None
        self.error = None

    def hardware_for(self, version, tiles_per_ipu=0, io_tiles=0):
        self.hardware.append((version, tiles_per_ipu))
        return ("hardware", version, tiles_per_ipu)

    def configure(self, device_sizes, hardware, *, selection_order="AUTO", options=None):
        if self.error is not None:
            raise self.error
        self.configured.append(
            dict(
                device_sizes=device_sizes,
                hardware=hardware,
                selection_order=selection_order,
                options=dict(options),
            )
        )
        self.system = object()
        return self.system

    def reset(self):
        self.resets += 1
        self.system = None

    def current(self):
        return self.system


@pytest.fixture
def device(monkeypatch):
    from keras_ipu.device import hardware, system

    fake = FakeDevice()
    monkeypatch.setattr(hardware, "hardware_for", fake.hardware_for)
    for name in ("configure", "reset", "current"):
        monkeypatch.setattr(system, name, getattr(fake, name))
    monkeypatch.setattr(config_system, "_configured", None)
    monkeypatch.delenv("TF_POPLAR_FLAGS", raising=False)
    monkeypatch.delenv("KERAS_IPU_FLAGS", raising=False)
    return fake


def _config(**values):
    return IPUConfig.from_dict(values)


@pytest.mark.parametrize(
    "values, sizes",
    [
        ({"auto_select_ipus": 1}, (1,)),
        ({"auto_select_ipus": 2}, (2,)),
        ({"auto_select_ipus": [1, 2]}, (1, 2)),
        ({"auto_select_ipus": (2, 2)}, (2, 2)),
        ({"select_ipus": 3}, (1,)),
        ({"select_ipus": 0}, (1,)),
        ({"select_ipus": [0, 1]}, (1, 1)),
        # The seed's gc-info listing: 24 and 25 are groups of four, 16 a pair, 30 all 16.
        ({"select_ipus": [24, 25]}, (4, 4)),
        ({"select_ipus": [16, 2, 29]}, (2, 1, 8)),
        ({"select_ipus": 30}, (16,)),
        # Its multi-IPU IDs hold the IPUs it lists: 16 is IPUs 5 and 7, 24 IPUs 4-7.
        ({"select_ipus": [16, 0]}, (2, 1)),
        ({"select_ipus": [24, 0, 1, 2, 3]}, (4, 1, 1, 1, 1)),
        ({"select_ipus": [16, 17, 25]}, (2, 2, 4)),
    ],
)
def test_configure_passes_device_sizes(device, values, sizes):
    ipu_config.configure_ipu_system(_config(**values))
    (call,) = device.configured
    assert call["device_sizes"] == sizes
    assert all(type(n) is int for n in call["device_sizes"])


@pytest.mark.parametrize("selection, message", [
    ([24, 16], "configurations 24 and 16 share IPU 5 (ID 24 holds IPUs 5, 7, 4, 6, ID 16 IPUs "
               "5, 7)"),
    ([30, 15], "configurations 30 and 15 share IPU 15"),
    # The tutorial: ID 24 "corresponds to the individual IPUs 4, 5, 6 and 7".
    ([16, 5], "configurations 16 and 5 share IPU 5"),
    ([24, 4], "configurations 24 and 4 share IPU 4"),
    ([28, 25], "configurations 28 and 25 share IPU 3"),
])
def test_selections_that_share_ipus_are_refused(device, selection, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ipu_config.configure_ipu_system(_config(select_ipus=selection))
    assert device.configured == []


@pytest.mark.parametrize("values, message", [
    ({"device_connection": {"type": "PRE_COMPILE"}},
     "device_connection.version must be set when device_connection.type is PRE_COMPILE"),
    ({"device_connection": {"type": "NEVER"}},
     "device_connection.version must be set when device_connection.type is NEVER"),
    ({"io_tiles": {"num_io_tiles": 32},
      "norms": {"experimental": {"distributed_batch_norm_replica_group_size": 2}}},
     "distributed_batch_norm_replica_group_size (2) is not supported with I/O tiles "
     "(io_tiles.num_io_tiles=32)"),
    ({"io_tiles": {"place_ops_on_io_tiles": True}},
     "io_tiles.place_ops_on_io_tiles needs I/O tiles"),
    ({"experimental": {"multi_replica_distribution": {"process_count": 2,
                                                      "process_index": 5}}},
     "process_index (5) must be in [0, process_count) = [0, 2)"),
])
def test_options_that_contradict_each_other_are_refused(device, values, message):
    # Each value is valid alone; the reference refuses them together when configuring.
    with pytest.raises(ValueError, match=re.escape(message)):
        ipu_config.configure_ipu_system(_config(auto_select_ipus=1, **values))
    assert device.configured == []


def test_the_combinations_pass_once_completed(device):
    ipu_config.configure_ipu_system(_config(
        auto_select_ipus=1, device_connection={"type": "NEVER", "version": "ipu2"},
        io_tiles={"num_io_tiles": 32, "place_ops_on_io_tiles": True},
        experimental={"multi_replica_distribution": {"process_count": 2, "process_index": 1}}))
    assert len(device.configured) == 1


def test_configure_passes_hardware_order_and_options(device):
    config = _config(auto_select_ipus=4, allow_recompute=True, selection_order="HOOF")
    config.ipu_model.version = "ipu21"
    config.ipu_model.tiles_per_ipu = 16
    config.device_connection.type = DeviceConnectionType.PRE_COMPILE
    config.device_connection.version = "ipu21"
    config.norms.experimental.distributed_batch_norm_replica_group_size = 2
    config.floating_point_behaviour.oflo = True
    config.floating_point_behaviour.esr = True  # no effect: not passed
    config.configure_ipu_system()
    assert device.hardware == [("ipu21", 16)]
    (call,) = device.configured
    assert call["hardware"] == ("hardware", "ipu21", 16)
    assert call["selection_order"] == "HOOF"
    assert call["options"] == {
        "allow_recompute": True,
        "device_connection_type": "PRE_COMPILE",
        "use_synthetic_data": False,
        "synthetic_data_initializer": None,
        "executable_cache_path": None,
        "execution_loop": "auto",
        "xla_compiler_options": "tuned",
        "background_loop_compile": "auto",
        "distributed_batch_norm_replica_group_size": 2,
        "floating_point_exceptions": ("oflo",),
    }


def test_configure_defaults(device):
    ipu_config.configure_ipu_system(_config(auto_select_ipus=1))
    assert device.hardware == [("ipu2", 0)]
    (call,) = device.configured
    assert call["selection_order"] == "AUTO"
    assert call["options"]["device_connection_type"] == "ALWAYS"
    assert call["options"]["allow_recompute"] is False


def test_configure_reads_flags(device, monkeypatch, tmp_path):
    monkeypatch.setenv("TF_POPLAR_FLAGS", "--ipu_model_tiles=32 --use_synthetic_data")
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--executable_cache_path={tmp_path / 'cache'}")
    config = _config(auto_select_ipus=1)
    # The flag's cache replaces the suite's own JAX cache (tests/test_executable_cache.py).
    with pytest.warns(UserWarning, match="--executable_cache_path"):
        config.configure_ipu_system()
    config.ipu_model.tiles_per_ipu = 8  # The config wins over the flag.
    config.configure_ipu_system()
    assert device.hardware == [("ipu2", 32), ("ipu2", 8)]
    options = device.configured[-1]["options"]
    assert options["use_synthetic_data"] is True
    assert options["executable_cache_path"] == str(tmp_path / "cache")
    ipu_config.reset_ipu_configuration()  # Puts the suite's JAX cache back.


def test_a_multi_replica_distribution_that_is_not_the_jobs_is_refused(device, monkeypatch):
    # Before: ignored, so a PopDist port started with plain `python` trained alone, with a
    # quarter of the global batch its configuration asked for.
    from keras_ipu.distributed import runtime

    ipu_config.configure_ipu_system(_config(auto_select_ipus=1))
    config = _config(auto_select_ipus=2)
    config.experimental.multi_replica_distribution.process_count = 4
    config.experimental.multi_replica_distribution.process_index = 3
    with pytest.raises(ValueError, match=r"says process 3 of 4, but this is instance 0 of a "
                                         r"job of 1 instance\(s\)\. Start the job with "
                                         r"`keras-ipu run --num-instances 4"):
        config.configure_ipu_system()
    assert device.hardware == [("ipu2", 0)]  # the system configured before is kept
    monkeypatch.setattr(runtime, "num_instances", lambda: 4)
    monkeypatch.setattr(runtime, "instance_index", lambda: 1)
    with pytest.raises(ValueError, match="this is instance 1 of a job of 4 .* Set "
                                         "process_index to each instance's own"):
        config.configure_ipu_system()
    config.experimental.multi_replica_distribution.process_index = 1
    config.configure_ipu_system()  # this job's: taken
    assert device.hardware == [("ipu2", 0), ("ipu2", 0)]


def test_get_ipu_config_returns_a_copy_of_the_configured_config(device):
    config = _config(auto_select_ipus=[1, 2])
    ipu_config.configure_ipu_system(config)
    config.auto_select_ipus = 8  # Changing the original changes nothing.
    configured = ipu_config.get_ipu_config()
    assert isinstance(configured, IPUConfig)
    assert configured.auto_select_ipus == [1, 2]
    configured.auto_select_ipus = 4
    assert ipu_config.get_ipu_config().auto_select_ipus == [1, 2]


def test_get_ipu_config_before_configuring_raises(device):
    with pytest.raises(RuntimeError, match="(?s)No IPU system is configured.*auto_select_ipus = 1"):
        ipu_config.get_ipu_config()


def test_reset_forgets_the_configuration(device):
    ipu_config.configure_ipu_system(_config(auto_select_ipus=1))
    resets = device.resets
    ipu_config.reset_ipu_configuration()
    assert device.resets == resets + 1 and device.system is None
    with pytest.raises(RuntimeError, match="No IPU system is configured"):
        ipu_config.get_ipu_config()


def test_configure_without_reset_when_configured_raises(device):
    ipu_config.configure_ipu_system(_config(auto_select_ipus=1))
    with pytest.raises(RuntimeError, match="already configured.*reset_ipu_configuration"):
        ipu_config.configure_ipu_system(_config(auto_select_ipus=2), reset_configuration=False)
    assert len(device.configured) == 1
    assert ipu_config.get_ipu_config().auto_select_ipus == 1
    ipu_config.reset_ipu_configuration()
    ipu_config.configure_ipu_system(_config(auto_select_ipus=2), reset_configuration=False)
    assert device.configured[-1]["device_sizes"] == (2,)


def test_configure_replaces_an_existing_configuration(device):
    ipu_config.configure_ipu_system(_config(auto_select_ipus=1))
    ipu_config.configure_ipu_system(_config(auto_select_ipus=[2, 2]))
    assert ipu_config.get_ipu_config().auto_select_ipus == [2, 2]


def test_device_layer_errors_propagate_unchanged(device):
    device.error = RuntimeError("8 IPUs need 8 JAX devices")
    with pytest.raises(RuntimeError, match="^8 IPUs need 8 JAX devices$"):
        ipu_config.configure_ipu_system(_config(auto_select_ipus=8))
    with pytest.raises(RuntimeError, match="No IPU system is configured"):
        ipu_config.get_ipu_config()


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ((None,), TypeError, "expects an IPUConfig, got None"),
        (({"auto_select_ipus": 1},), TypeError, "IPUConfig"),
        ((IPUConfig(),), ValueError, r"config.auto_select_ipus = 1"),
        ((_config(auto_select_ipus=1, select_ipus=0),), ValueError, "Only one of"),
        ((_config(auto_select_ipus=1), "/device:IPU:0"), ValueError, "'/device:IPU:0'"),
        ((_config(auto_select_ipus=1), 0), ValueError, "CPU"),
    ],
)
def test_configure_argument_errors_come_before_the_device_layer(device, arguments, error, match):
    with pytest.raises(error, match=match):
        ipu_config.configure_ipu_system(*arguments)
    assert device.configured == [] and device.hardware == []


@pytest.mark.parametrize("name", ["cpu", "CPU", "/cpu:0", "/device:CPU:0", "cpu:0"])
def test_configure_accepts_cpu_device_names(device, name):
    ipu_config.configure_ipu_system(_config(auto_select_ipus=1), device=name)
    assert len(device.configured) == 1


def test_configure_revalidates_values_changed_in_place(device):
    config = _config(auto_select_ipus=1)
    config.matmuls.poplar_options["availableMemoryProportion"] = 3.0
    with pytest.raises(ValueError, match="matmuls.poplar_options"):
        config.configure_ipu_system()
    assert device.configured == []


def test_get_ipu_config_after_the_device_layer_was_reset(device):
    ipu_config.configure_ipu_system(_config(auto_select_ipus=1))
    device.reset()
    with pytest.raises(RuntimeError, match="No IPU system is configured"):
        ipu_config.get_ipu_config()


def test_numpy_numbers_are_kept_as_python_numbers():
    # A NumPy integer passed validation, then broke the config's repr (np.int64(2) != []).
    config = IPUConfig()
    config.auto_select_ipus = np.int64(2)
    config.ipu_model.tiles_per_ipu = np.int32(8)
    assert repr(config) == "IPUConfig(auto_select_ipus=2, ipu_model.tiles_per_ipu=8)"
    assert type(config.auto_select_ipus) is int and type(config.ipu_model.tiles_per_ipu) is int
    other = IPUConfig()
    other.auto_select_ipus = [np.int64(1), np.int64(2)]
    assert other.auto_select_ipus == [1, 2] and all(type(n) is int for n in other.auto_select_ipus)
    assert IPUConfig.from_json(other.to_json()) == other


def test_from_dict_and_from_json_on_a_config_change_nothing_when_a_value_is_refused():
    config = IPUConfig()
    config.auto_select_ipus = 2
    before = config.to_dict()
    with pytest.raises(ValueError, match="tiles_per_ipu must be >= 0"):
        config.from_dict({"auto_select_ipus": 4,
                          "ipu_model": {"version": "ipu1", "tiles_per_ipu": -1}})
    with pytest.raises(TypeError, match="tiles_per_ipu must be of type int"):
        config.from_json('{"auto_select_ipus": 4, "ipu_model.tiles_per_ipu": "8"}')
    assert config.to_dict() == before
    assert config.from_dict({"auto_select_ipus": 4}) is config and config.auto_select_ipus == 4


def test_poplar_options_are_keyed_by_option_name():
    config = IPUConfig()
    for name in ("matmuls.poplar_options", "compilation_poplar_options", "gcl_poplar_options"):
        with pytest.raises(ValueError, match=r"poplar_options must have option names \(strings\)"):
            config.from_dict({name: {1: "2"}})
    config.matmuls.poplar_options = {"availableMemoryProportion": "0.2"}
    assert IPUConfig.from_json(config.to_json()) == config


def test_sdk3_stochastic_rounding_behaviour_is_taken_and_round_trips():
    config = IPUConfig()
    config.floating_point_behaviour.esr = StochasticRoundingBehaviour.REPLICA_IDENTICAL_ONLY
    assert config.to_dict()["floating_point_behaviour"]["esr"] == "REPLICA_IDENTICAL_ONLY"
    assert IPUConfig.from_dict(config.to_dict()) == config
    assert IPUConfig.from_dict({"floating_point_behaviour": {"esr": 1}}).floating_point_behaviour \
        .esr is StochasticRoundingBehaviour.ON
    assert StochasticRoundingBehaviour.from_bool(True) is StochasticRoundingBehaviour.ON
    config.floating_point_behaviour.esr = True  # the seeds' bool still
    assert config.floating_point_behaviour.esr is True


def test_numpy_bools_and_keys_that_are_no_names():
    # Before: "must be of type bool, got np.True_ of type bool"; Python's setattr error.
    config = IPUConfig()
    config.allow_recompute = np.bool_(True)
    assert config.allow_recompute is True
    assert IPUConfig.from_dict({"floating_point_behaviour": {"inv": np.bool_(True)}}) \
        .floating_point_behaviour.inv is True
    with pytest.raises(TypeError, match=r"attribute names are strings, got 1 at the top "
                                        r"level\. Valid names: allow_recompute"):
        IPUConfig.from_dict({1: 2})
    with pytest.raises(TypeError, match=r"got None in 'ipu_model'\. Valid names: "
                                        r"compile_ipu_code, tiles_per_ipu, version\."):
        IPUConfig.from_dict({"ipu_model": {None: 3}})


def test_the_ipus_of_all_devices_together_are_at_most_a_pod1024():
    # Before: [1024, 1024] configured 2048 IPUs.
    config = IPUConfig()
    config.auto_select_ipus = [512, 512]
    with pytest.raises(ValueError, match=r"must ask for at most 1024 IPUs in all .*got "
                                         r"\[1024, 1024\]"):
        config.auto_select_ipus = [1024, 1024]
    assert config.auto_select_ipus == [512, 512]
