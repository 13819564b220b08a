"""`update_ipu_config`: an instance's IPUConfig from the launcher's job shape."""

from __future__ import annotations

import os
from typing import Any

from keras_ipu.distributed import runtime


def update_ipu_config(config: Any, ipus_per_replica: int | None = None) -> Any:
    """Sets the multi-replica distribution options and this instance's share of the IPUs.

    Under `keras-ipu run --num-instances N` (as `popdist.tensorflow.set_ipu_config`):
    `experimental.multi_replica_distribution.process_count` becomes `N` and
    `.process_index` this instance's index; with `--num-replicas R
    [--ipus-per-replica K]` an instance also gets `auto_select_ipus = R / N × K`
    (K rounded up to a power of two, as a replica takes: 4 for 3 stages).
    Outside a launched job the config is left as it is.

    Args:
        config: An `IPUConfig`, changed in place.
        ipus_per_replica: IPUs per replica; default: the launcher's
            `--ipus-per-replica`, else 1.

    Returns:
        `config`.

    Raises:
        ValueError: When `KERAS_IPU_NUM_REPLICAS` or `KERAS_IPU_IPUS_PER_REPLICA`
            is not a positive integer, or the replicas are not a multiple of
            the instances.

    Example:

    >>> config = keras_ipu.config.IPUConfig()
    >>> update_ipu_config(config).auto_select_ipus   # --num-instances 2 --num-replicas 4
    2
    >>> config.experimental.multi_replica_distribution.process_count
    2
    """
    shape = runtime.launcher_environment()
    if shape is None:
        return config
    distribution = config.experimental.multi_replica_distribution
    distribution.process_count = shape["num_instances"]
    distribution.process_index = shape["instance_index"]
    if os.environ.get(runtime.NUM_REPLICAS_ENV) is None:
        return config
    replicas = runtime.positive_int_env(runtime.NUM_REPLICAS_ENV, 1)
    if replicas % shape["num_instances"]:
        raise ValueError(
            f"{runtime.NUM_REPLICAS_ENV}={replicas} must be a multiple of the job's "
            f"{shape['num_instances']} instances: each instance runs as many replicas.")
    per_replica = ipus_per_replica or runtime.positive_int_env(runtime.IPUS_PER_REPLICA_ENV, 1)
    # A replica takes a power of two of IPUs: a 3-stage pipeline's replica takes 4.
    per_replica = 1 << (per_replica - 1).bit_length()
    config.auto_select_ipus = replicas // shape["num_instances"] * per_replica
    return config
