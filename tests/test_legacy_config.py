"""The SDK 2.0 configuration functions of `ipu.utils` build the IPUConfig they stand for.

Seed 002 §18.6: `create_ipu_config()`, `auto_select_ipus`, `select_ipus` and
the `set_*_options` functions, used as `opts = set_x(opts, ...)` and then
`ipu.utils.configure_ipu_system(opts)`.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.config import (
    DeviceConnectionType,
    ExecutionProfileType,
    IPUConfig,
    MergeRemoteBuffersBehaviour,
    SchedulingAlgorithm,
    SelectionOrder,
    VerificationOptions,
)
from keras_ipu.device.hardware import hardware_for

from conftest import assert_weights_close

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _changes(config: IPUConfig) -> dict:
    """The options of `config` that differ from a new IPUConfig's, by path."""
    return dict(config._changed())


# (function, its non-default arguments, the IPUConfig options they must set)
MAPPINGS = [
    (ipu.utils.create_ipu_config, dict(
        scheduler_selection=SchedulingAlgorithm.LOOK_AHEAD,
        always_rearrange_copies_on_the_host=True, merge_infeed_io_copies=True,
        disable_graph_outlining=True, max_cross_replica_sum_buffer_size=1024,
        max_inter_ipu_copies_buffer_size=2048, max_scheduler_lookahead_depth=7,
        max_scheduler_search_space_size=99, prefetch_data_streams=False,
        selection_order=SelectionOrder.SNAKE, enable_experimental_remote_buffer_embedding=True,
        profiling=True, profile_execution=ExecutionProfileType.IPU_PROFILE,
        report_directory="/tmp/reports"), {
        "scheduling.algorithm": SchedulingAlgorithm.LOOK_AHEAD,
        "experimental.always_rearrange_copies_on_the_host": True,
        "optimizations.merge_infeed_io_copies": True,
        "optimizations.enable_graph_outlining": False,
        "optimizations.maximum_cross_replica_sum_buffer_size": 1024,
        "optimizations.maximum_inter_ipu_copies_buffer_size": 2048,
        "scheduling.maximum_scheduler_lookahead_depth": 7,
        "scheduling.maximum_scheduler_search_space_size": 99,
        "optimizations.prefetch_data_streams": False,
        "selection_order": SelectionOrder.SNAKE,
        "experimental.enable_remote_buffer_embedding": True,
    }),
    (ipu.utils.auto_select_ipus, dict(num_ipus=[1, 2]), {"auto_select_ipus": [1, 2]}),
    (ipu.utils.select_ipus, dict(indices=[24, 25]), {"select_ipus": [24, 25]}),
    (ipu.utils.set_ipu_connection_type, dict(
        connection_type=DeviceConnectionType.PRE_COMPILE, ipu_version="ipu21",
        enable_remote_buffers=True), {
        "device_connection.type": DeviceConnectionType.PRE_COMPILE,
        "device_connection.version": "ipu21",
        "device_connection.enable_remote_buffers": True,
    }),
    (ipu.utils.set_ipu_model_options, dict(
        compile_ipu_code=False, tiles_per_ipu=8, ipu_model_version="ipu21"), {
        "ipu_model.compile_ipu_code": False, "ipu_model.tiles_per_ipu": 8,
        "ipu_model.version": "ipu21",
    }),
    (ipu.utils.set_experimental_multi_replica_distribution_options, dict(
        process_count=4, process_index=3), {
        "experimental.multi_replica_distribution.process_count": 4,
        "experimental.multi_replica_distribution.process_index": 3,
    }),
    (ipu.utils.set_recomputation_options, {}, {"allow_recompute": True}),
    (ipu.utils.set_serialization_options, dict(output_folder="/tmp/net"),
     {"serialization_output_folder": "/tmp/net"}),
    (ipu.utils.set_compilation_options, dict(compilation_options={"debug.instrument": "true"}),
     {"compilation_poplar_options": {"debug.instrument": "true"}}),
    (ipu.utils.set_convolution_options,
     dict(convolution_options={"availableMemoryProportion": "0.1"}),
     {"convolutions.poplar_options": {"availableMemoryProportion": "0.1"}}),
    (ipu.utils.set_pooling_options,
     dict(pooling_options={"poolUseIntrospectiveMapping": "false"}),
     {"pooling.poplar_options": {"poolUseIntrospectiveMapping": "false"}}),
    (ipu.utils.set_gcl_options, dict(gcl_options={"syncful.maxBroadcastSize": "1024"}),
     {"gcl_poplar_options": {"syncful.maxBroadcastSize": "1024"}}),
    (ipu.utils.set_matmul_options, dict(
        matmul_options={"availableMemoryProportion": "0.5"}, clear_pass_type=True), {
        "matmuls.poplar_options": {"availableMemoryProportion": "0.5"},
        "matmuls.clear_pass_type": True,
    }),
    (ipu.utils.set_norm_options, dict(
        use_stable_statistics=True,
        experimental_distributed_batch_norm_replica_group_size=2), {
        "norms.use_stable_statistics": True,
        "norms.experimental.distributed_batch_norm_replica_group_size": 2,
    }),
    # Every argument is set, defaults included: the reference's NO_MERGING
    # default differs from IPUConfig's IF_BENEFICIAL.
    (ipu.utils.set_optimization_options, dict(
        combine_embedding_lookups=True, combine_matmuls=True,
        max_cross_replica_sum_buffer_size=1, max_reduce_scatter_buffer_size=2,
        max_inter_ipu_copies_buffer_size=3, max_send_recv_cluster_size=4,
        minimum_remote_tensor_size=5, gather_simplifier=False,
        triangular_solve_expander_block_size=6, cholesky_block_size=7, enable_fast_math=True), {
        "optimizations.combine_embedding_lookups": True,
        "optimizations.combine_matmuls": True,
        "optimizations.maximum_cross_replica_sum_buffer_size": 1,
        "optimizations.maximum_reduce_scatter_buffer_size": 2,
        "optimizations.maximum_inter_ipu_copies_buffer_size": 3,
        "optimizations.maximum_send_recv_cluster_size": 4,
        "optimizations.minimum_remote_tensor_size": 5,
        "optimizations.merge_remote_buffers": MergeRemoteBuffersBehaviour.NO_MERGING,
        "optimizations.enable_gather_simplifier": False,
        "optimizations.triangular_solve_expander_block_size": 6,
        "optimizations.cholesky_block_size": 7,
        "optimizations.enable_fast_math": True,
    }),
    (ipu.utils.set_floating_point_behaviour_options, dict(esr=False), {
        "floating_point_behaviour.inv": True, "floating_point_behaviour.div0": True,
        "floating_point_behaviour.oflo": True, "floating_point_behaviour.nanoo": True,
    }),
    (ipu.utils.set_io_tile_options, dict(
        num_io_tiles=64, place_ops_on_io_tiles=True, io_tile_available_memory_proportion=0.5), {
        "io_tiles.num_io_tiles": 64, "io_tiles.place_ops_on_io_tiles": True,
        "io_tiles.available_memory_proportion": 0.5,
    }),
    (ipu.utils.set_report_options, dict(graph_options={"graphOptions": "false"}), {}),
    (ipu.utils.set_transfer_options, dict(use_verified_transfers=True), {}),
    (ipu.utils.set_verification_options, dict(verification_options=VerificationOptions()), {}),
]


@pytest.mark.parametrize("function, arguments, expected", MAPPINGS,
                         ids=[m[0].__name__ for m in MAPPINGS])
def test_each_argument_sets_its_ipuconfig_option(function, arguments, expected):
    if function is ipu.utils.create_ipu_config:
        opts = function(**arguments)
    else:
        opts = ipu.utils.create_ipu_config()
        assert function(opts, **arguments) is opts  # changed in place and returned
    assert _changes(opts) == expected


def test_the_seeds_sequence_equals_the_ipuconfig_it_stands_for():
    opts = ipu.utils.create_ipu_config(max_cross_replica_sum_buffer_size=10_000_000)
    opts = ipu.utils.auto_select_ipus(opts, num_ipus=[2, 2])
    opts = ipu.utils.set_ipu_model_options(opts, tiles_per_ipu=16)
    opts = ipu.utils.set_matmul_options(opts, {"availableMemoryProportion": "0.2"})
    opts = ipu.utils.set_recomputation_options(opts)

    config = IPUConfig()
    config.optimizations.maximum_cross_replica_sum_buffer_size = 10_000_000
    config.auto_select_ipus = [2, 2]
    config.ipu_model.tiles_per_ipu = 16
    config.matmuls.poplar_options = {"availableMemoryProportion": "0.2"}
    config.allow_recompute = True
    assert opts == config


def test_poplar_options_add_to_those_already_set():
    opts = ipu.utils.create_ipu_config()
    ipu.utils.set_convolution_options(opts, {"availableMemoryProportion": "0.3"})
    ipu.utils.set_convolution_options(opts, {"partialsType": "half"})
    ipu.utils.set_convolution_options(opts)  # None adds nothing
    assert opts.convolutions.poplar_options == {
        "availableMemoryProportion": "0.3", "partialsType": "half"}


def test_bad_input_names_the_argument_and_changes_nothing():
    opts = ipu.utils.create_ipu_config()
    before = IPUConfig.from_dict(opts.to_dict())
    with pytest.raises(ValueError, match=r"max_reduce_scatter_buffer_size=-1.*must be >= 0"):
        ipu.utils.set_optimization_options(opts, combine_matmuls=True,
                                           max_reduce_scatter_buffer_size=-1)
    with pytest.raises(TypeError, match=r"set_norm_options\(use_stable_statistics='yes'\)"):
        ipu.utils.set_norm_options(opts, use_stable_statistics="yes")
    with pytest.raises(ValueError, match="availableMemoryProportion"):
        ipu.utils.set_matmul_options(opts, {"availableMemoryProportion": "1.5"})
    with pytest.raises(TypeError, match="dictionary of Poplar option names"):
        ipu.utils.set_pooling_options(opts, ["poolUseIntrospectiveMapping"])
    with pytest.raises(ValueError, match=r"ipu_version='ipu9'.*'ipu1', 'ipu2', 'ipu21'"):
        ipu.utils.set_ipu_connection_type(opts, DeviceConnectionType.NEVER, ipu_version="ipu9")
    with pytest.raises(ValueError, match=r"process_index=2 must be in \[0, process_count=2\)"):
        ipu.utils.set_experimental_multi_replica_distribution_options(opts, 2, 2)
    with pytest.raises(TypeError, match="VerificationOptions"):
        ipu.utils.set_verification_options(opts, {"inputs": 1})
    with pytest.raises(TypeError, match="must be bool"):
        ipu.utils.set_transfer_options(opts, use_verified_transfers=1)
    assert opts == before


@pytest.mark.parametrize("function", [ipu.utils.set_norm_options, ipu.utils.auto_select_ipus])
def test_only_configs_are_accepted(function):
    arguments = {"num_ipus": 1} if function is ipu.utils.auto_select_ipus else {}
    with pytest.raises(TypeError, match="create_ipu_config"):
        function({"auto_select_ipus": 1}, **arguments)


def test_ipus_are_selected_once():
    opts = ipu.utils.auto_select_ipus(ipu.utils.create_ipu_config(), 2)
    with pytest.raises(ValueError, match=r"already selects its IPUs \(auto_select_ipus=2\)"):
        ipu.utils.select_ipus(opts, [0])
    with pytest.raises(ValueError, match="already selects"):
        ipu.utils.auto_select_ipus(opts, 1)
    assert opts.auto_select_ipus == 2 and opts.select_ipus == []


@pytest.mark.parametrize("arguments, message", [
    (dict(profiling=True, enable_ipu_events=True), "mutually exclusive"),
    (dict(profile_execution=True), "needs profiling=True"),
    (dict(profiling=True, profile_execution="yes"), "profile_execution=...\\) must be bool"),
    (dict(max_report_size=-1), "max_report_size=-1"),
    (dict(disable_graph_outlining=1), "disable_graph_outlining=...\\) must be bool"),
    (dict(selection_order="SNAKE"), "selection_order='SNAKE'"),
])
def test_create_ipu_config_checks_its_arguments(arguments, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ipu.utils.create_ipu_config(**arguments)


def test_each_function_warns_that_it_is_deprecated_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opts = ipu.utils.create_ipu_config()
        ipu.utils.set_convolution_options(opts)  # a helper deeper than the others
        ipu.utils.set_report_options(opts)
    deprecations = [w for w in caught if w.category is DeprecationWarning]
    assert [str(w.message).split(" is ")[0] for w in deprecations] == [
        "keras_ipu.utils.create_ipu_config", "keras_ipu.utils.set_convolution_options",
        "keras_ipu.utils.set_report_options"]
    assert {w.filename for w in deprecations} == {__file__}
    assert "IPUConfig" in str(deprecations[0].message)


def test_move_variable_initialization_to_cpu_takes_no_graph():
    assert ipu.utils.move_variable_initialization_to_cpu() is None
    with pytest.raises(TypeError, match="takes no graph"):
        ipu.utils.move_variable_initialization_to_cpu(object())


def test_a_legacy_config_configures_the_system_and_trains_as_plain_keras():
    opts = ipu.utils.create_ipu_config()
    opts = ipu.utils.auto_select_ipus(opts, num_ipus=[1, 2])
    opts = ipu.utils.set_ipu_model_options(opts, tiles_per_ipu=16)
    ipu.utils.configure_ipu_system(opts)
    ipu.utils.move_variable_initialization_to_cpu()

    assert ipu.config.get_ipu_config() == opts
    assert [ipu.utils.get_num_of_ipus_in_device(d) for d in ("/device:IPU:0", 1)] == [1, 2]
    with pytest.raises(ValueError):
        ipu.utils.get_num_of_ipus_in_device("/device:IPU:2")

    rng = np.random.default_rng(0)
    x, y = rng.random((32, 4), np.float32), rng.random((32, 1), np.float32)

    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
        return model

    plain = build()
    plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = build()
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    capacity = hardware_for("ipu2", tiles_per_ipu=16).memory_capacity_bytes
    assert ipu.utils.execution_report(model, "fit").ipus[0].memory_capacity_bytes == capacity


def test_older_sdks_spellings_are_accepted():
    opts = ipu.utils.create_ipu_config(scheduler_selection="", selection_order=None,
                                       profile_execution=ExecutionProfileType.NO_PROFILE)
    assert _changes(opts) == {}
    for given, expected in ((True, MergeRemoteBuffersBehaviour.MERGE),
                            (None, MergeRemoteBuffersBehaviour.IF_BENEFICIAL),
                            (False, MergeRemoteBuffersBehaviour.NO_MERGING)):
        ipu.utils.set_optimization_options(opts, merge_remote_buffers=given)
        assert opts.optimizations.merge_remote_buffers is expected
    with pytest.raises(TypeError, match="merge_remote_buffers=1"):
        ipu.utils.set_optimization_options(opts, merge_remote_buffers=1)
    ipu.utils.set_ipu_connection_type(opts, None, ipu_version=2)
    assert opts.device_connection.type is DeviceConnectionType.ALWAYS
    assert opts.device_connection.version == "ipu2"


def test_the_multi_replica_options_check_the_config_first_and_the_count():
    with pytest.raises(TypeError, match="create_ipu_config"):
        ipu.utils.set_experimental_multi_replica_distribution_options(None, 2, 5)
    with pytest.raises(ValueError, match=r"process_index=0 must be in \[0, process_count=0\)"):
        ipu.utils.set_experimental_multi_replica_distribution_options(
            ipu.utils.create_ipu_config(), 0, 0)
