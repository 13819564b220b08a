"""The instances of a multi-host job: joining JAX's distributed runtime, and host collectives.

An instance is one process of the job; each configures its own (local) IPUs
and the replicas of a model span every instance's IPUs. Instances find each
other through JAX's distributed runtime (`jax.distributed`): the coordinator
(instance 0) runs its coordination service, which also watches every
instance's heartbeat, so that when one dies the others stop with an error
instead of waiting for it forever. Collectives between the devices of
different instances go over the accelerators' own network, and over gloo
between CPU devices; nothing here moves data itself.

The job's shape comes from the launcher (`keras-ipu run --num-instances N`)
through environment variables, or from a cluster that
`jax.distributed.initialize()` detects itself (SLURM, Open MPI).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The launcher's environment: what each instance it starts is told.
COORDINATOR_ENV = "KERAS_IPU_COORDINATOR"
NUM_INSTANCES_ENV = "KERAS_IPU_NUM_INSTANCES"
INSTANCE_INDEX_ENV = "KERAS_IPU_INSTANCE_INDEX"
NUM_REPLICAS_ENV = "KERAS_IPU_NUM_REPLICAS"
IPUS_PER_REPLICA_ENV = "KERAS_IPU_IPUS_PER_REPLICA"
HEARTBEAT_ENV = "KERAS_IPU_HEARTBEAT_TIMEOUT"

# Seconds without a heartbeat after which the coordination service declares
# an instance dead and the others' next collective fails. JAX's default (100
# s) is meant for large pods; a job of a few instances notices sooner.
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 10
# Seconds instance 0 waits for all instances to join before giving up.
DEFAULT_INITIALIZATION_TIMEOUT_SECONDS = 120

# Cluster environments `jax.distributed.initialize()` detects by itself, by
# the variable that gives their number of processes.
_CLUSTER_SIZE_VARIABLES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")

_LOG = logging.getLogger("keras_ipu.distributed")


def positive_int_env(name: str, default: int) -> int:
    """An environment variable of the job's shape that holds a positive integer.

    Args:
        name: The variable (`KERAS_IPU_HEARTBEAT_TIMEOUT`, say).
        default: Its value when it is not set.

    Returns:
        Its value.

    Raises:
        ValueError: Naming the variable, when it holds anything else.

    Example:

    >>> positive_int_env(IPUS_PER_REPLICA_ENV, 1)   # not set
    1
    """
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1 or str(number) != value.strip():
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return number


def launcher_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The job's shape as the launcher gives it, or `None` outside a launched job.

    Args:
        environ: The environment to read (default: `os.environ`).

    Returns:
        `{"coordinator", "num_instances", "instance_index"}`, or `None` when
        `KERAS_IPU_NUM_INSTANCES` is not set.

    Raises:
        ValueError: When the variables are incomplete or out of range.

    Example:

    >>> launcher_environment({"KERAS_IPU_NUM_INSTANCES": "2", "KERAS_IPU_INSTANCE_INDEX": "1",
    ...                       "KERAS_IPU_COORDINATOR": "127.0.0.1:4000"})["instance_index"]
    1
    """
    environ = os.environ if environ is None else environ
    if NUM_INSTANCES_ENV not in environ:
        return None
    try:
        count = int(environ[NUM_INSTANCES_ENV])
        # Only a job of one instance may leave its index out: two would both be instance 0.
        index = int(environ.get(INSTANCE_INDEX_ENV, "0" if count == 1 else "-1"))
    except ValueError as error:
        raise ValueError(
            f"{NUM_INSTANCES_ENV} and {INSTANCE_INDEX_ENV} must be integers, got "
            f"{environ.get(NUM_INSTANCES_ENV)!r} and {environ.get(INSTANCE_INDEX_ENV)!r}."
        ) from error
    coordinator = environ.get(COORDINATOR_ENV)
    if count < 1 or not 0 <= index < count or (count > 1 and not coordinator):
        raise ValueError(
            f"The launcher's environment is inconsistent: {NUM_INSTANCES_ENV}={count}, "
            f"{INSTANCE_INDEX_ENV}={environ.get(INSTANCE_INDEX_ENV, '(not set)')}, "
            f"{COORDINATOR_ENV}={coordinator!r}. Start the "
            f"instances with `keras-ipu run --num-instances N`, or set all three "
            f"(the index in 0..N-1, the coordinator as HOST:PORT)."
        )
    return {"coordinator": coordinator, "num_instances": count, "instance_index": index}


def _cluster_detected() -> bool:
    return any(int(os.environ.get(name, "1") or 1) > 1 for name in _CLUSTER_SIZE_VARIABLES)


def leave_job_environment() -> None:
    """Makes this process a process of its own, outside the job its environment names.

    For the one-process tools (`keras-ipu convert`, `run`, `show`, `serve`)
    started from inside a job (by an instance, or in a SLURM allocation of
    several tasks): they inherit the job's variables, and would otherwise
    join the job as a member it never waits for, and hang.

    Example:

    >>> leave_job_environment()   # in `keras-ipu convert`, started by an instance
    >>> launcher_environment() is None
    True
    """
    for name in (COORDINATOR_ENV, NUM_INSTANCES_ENV, INSTANCE_INDEX_ENV, NUM_REPLICAS_ENV,
                 IPUS_PER_REPLICA_ENV, *_CLUSTER_SIZE_VARIABLES):
        os.environ.pop(name, None)


def is_initialized() -> bool:
    """Whether this process has joined a distributed job (of any size)."""
    return jax.distributed.is_initialized()


def initialize() -> bool:
    """Joins the job's distributed runtime, once, when the process is one of several.

    Called by `configure_ipu_system` and the multi-instance strategies; it
    must run before JAX starts its backends (before any JAX computation),
    which `configure_ipu_system` ensures when called first. CPU devices
    exchange data with gloo.

    Returns:
        Whether the process is part of a multi-instance job.

    Raises:
        RuntimeError: When the job needs the runtime but JAX already started
            its backends in this process.

    Example:

    >>> initialize()   # under `keras-ipu run --num-instances 2`
    True
    """
    if is_initialized():
        return jax.process_count() > 1
    shape = launcher_environment()
    if shape is None and not _cluster_detected():
        return False
    if shape is not None and shape["num_instances"] == 1:
        return False
    from keras_ipu.device import system

    # The CPU devices each instance gets are fixed when it joins the job.
    system.request_cpu_devices(system.DEFAULT_CPU_DEVICES)
    # On CPU the cross-process collectives need gloo; the setting does not
    # affect accelerators.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service would take SIGTERM for itself (and training went on):
    # the launcher's forwarded SIGTERM stops the instance, as in one process.
    with contextlib.suppress(AttributeError):  # an option of the JAX versions that have it
        jax.config.update("jax_enable_preemption_service", False)
    heartbeat = positive_int_env(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_SECONDS)
    kwargs: dict[str, Any] = {
        "heartbeat_timeout_seconds": heartbeat,
        "initialization_timeout": DEFAULT_INITIALIZATION_TIMEOUT_SECONDS,
    }
    if shape is not None:
        kwargs.update(coordinator_address=shape["coordinator"],
                      num_processes=shape["num_instances"],
                      process_id=shape["instance_index"])
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as error:
        if "before" not in str(error):
            raise
        raise RuntimeError(
            "This process is an instance of a multi-instance job, but JAX already "
            "started its devices, so it can no longer join the job. Call "
            "`config.configure_ipu_system()` (or create the strategy) before any JAX "
            "computation, e.g. at the top of the script."
        ) from error
    _LOG.info("Instance %d of %d joined the job.", jax.process_index(), jax.process_count())
    if jax.process_count() > 1:
        _end_at_once_when_uncaught()
    return jax.process_count() > 1


def _end_at_once_when_uncaught() -> None:
    """An exception that ends this instance's script ends the process at once.

    Python's exit would run JAX's shutdown barrier, which waits for every
    instance, while the others wait in a collective for this one: the job
    would hang for the barrier's timeout (minutes), then abort. Ended at once,
    the instance is a dead one to the others, which stop at the heartbeat.
    `keras-ipu run` ends its instances so itself (`instance_main`); this
    serves jobs started otherwise (a cluster's launcher, variables set by hand).
    """
    from keras_ipu.distributed import instance_main

    previous = sys.excepthook

    def end_at_once(kind, error, trace):
        previous(kind, error, trace)  # the traceback, as Python prints it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(instance_main.exit_status(error))

    sys.excepthook = end_at_once


def instance_index() -> int:
    """This instance's index in the job (0 for a single process).

    Example:

    >>> instance_index()   # the second instance
    1
    """
    initialize()
    return jax.process_index()


def num_instances() -> int:
    """The number of instances in the job (1 for a single process).

    Example:

    >>> num_instances()
    2
    """
    initialize()
    return jax.process_count()


def check_one_instance(what: str) -> None:
    """Refuses what would run on this instance's IPUs alone in a job of several instances.

    Args:
        what: What the user called, for the message (`"`train_on_batch`"`).

    Raises:
        NotImplementedError: When the job has several instances: the
            instances' weights would part.

    Example:

    >>> check_one_instance("`train_on_batch`")   # one instance: nothing happens
    """
    if num_instances() > 1:
        raise NotImplementedError(
            f"{what} runs on this instance's IPUs alone, so the instances' weights would "
            f"part: in a job of several instances, train with `fit` (one batch: `fit(x, y, "
            f"batch_size=len(x))`) and evaluate with `evaluate`.")


def num_local_replicas(ipus_per_replica: int | None = None) -> int:
    """Replicas on this instance's configured IPUs.

    Args:
        ipus_per_replica: IPUs each replica uses (rounded up to a power of
            two); by default the launcher's `--ipus-per-replica` (1 outside a
            `keras-ipu run` job).

    Returns:
        The number of replicas, at least 1.

    Raises:
        RuntimeError: When no IPU system is configured.

    Example:

    >>> num_local_replicas(2)   # 4 IPUs, 2 per replica
    2
    """
    from keras_ipu.device import system

    if ipus_per_replica is None:
        ipus_per_replica = positive_int_env(IPUS_PER_REPLICA_ENV, 1)
    per_replica = 1 << max(ipus_per_replica - 1, 0).bit_length()
    return max(system.require().num_ipus // per_replica, 1)


def num_global_replicas(ipus_per_replica: int | None = None) -> int:
    """Replicas over all instances: instances × this instance's replicas.

    Args:
        ipus_per_replica: IPUs each replica uses (a pipeline's stages); by
            default the launcher's `--ipus-per-replica` (1 outside a job).

    Returns:
        The number of global replicas.

    Raises:
        RuntimeError: When no IPU system is configured.

    Example:

    >>> num_global_replicas()   # 2 instances, 2 IPUs each
    4
    """
    return num_instances() * num_local_replicas(ipus_per_replica)


_REDUCTIONS = {"sum": np.sum, "mean": np.mean, "average": np.mean, "max": np.max,
               "min": np.min}


def reduce_stacked(stacked: np.ndarray, op: str) -> np.ndarray:
    """`stacked[0] op stacked[1] op ...`, in `stacked`'s dtype (as Horovod's allreduce).

    Sums wrap around in an integer dtype; an integer mean is the sum divided
    by the count, truncated toward zero (Horovod scales the sum by `1 / N`); a
    boolean mean is true where at least half the values are.

    Example:

    >>> reduce_stacked(np.array([[3, -3], [4, -4]], "int32"), "mean")
    array([ 3, -3], dtype=int32)
    """
    stacked = np.asarray(stacked)
    if op == "sum":
        reduced = np.sum(stacked, axis=0, dtype=stacked.dtype)
    elif op in ("mean", "average") and stacked.dtype == bool:
        # A mean of truth values, as a truth value: true where at least half are.
        reduced = np.mean(stacked, axis=0) >= 0.5
    elif op in ("mean", "average") and not jnp.issubdtype(stacked.dtype, jnp.inexact):
        total = np.sum(stacked, axis=0, dtype=stacked.dtype)
        # Truncated toward zero in integers: a float64 quotient loses int64s past 2**53.
        reduced = np.sign(total) * (np.abs(total) // stacked.shape[0])
    elif op in ("mean", "average") and stacked.dtype.itemsize < 4:  # bfloat16, float16
        reduced = np.mean(stacked.astype(np.float32), axis=0)
    else:
        reduced = _REDUCTIONS[op](stacked, axis=0)
    # An array whatever the reduction (NumPy's sums of a 0-d value are scalars).
    return np.asarray(reduced).astype(stacked.dtype, copy=False)


def allreduce(value: Any, op: str = "mean") -> Any:
    """Reduces a host value over all instances (every instance must call it).

    Args:
        value: An array-like or a tree of them, the same shape on every instance.
        op: `"mean"` (default, as Horovod's `Average`), `"sum"`, `"max"` or `"min"`.

    Returns:
        The reduced value, as NumPy arrays of the input's shapes and dtypes, on
        every instance (see `reduce_stacked`: an integer mean is truncated).

    Raises:
        ValueError: For an unknown `op`.

    Example:

    >>> allreduce(np.float32(instance_index()), op="sum")   # 2 instances
    array(1., dtype=float32)
    """
    name = str(getattr(op, "name", op)).lower()
    if name not in _REDUCTIONS:
        raise ValueError(f"Unknown reduction {op!r}; valid ones are {sorted(_REDUCTIONS)}.")
    _check_alike(value, "allreduce")
    gathered = _gather_stacked(value)
    return jax.tree_util.tree_map(lambda a: reduce_stacked(a, name), gathered)


def allgather(value: Any) -> Any:
    """Concatenates a host value from all instances along its first axis.

    Unlike `allreduce`, the first dimension may differ between instances.

    Args:
        value: An array-like with at least one dimension, or a tree of them.

    Returns:
        The concatenation in instance order, as NumPy arrays, on every instance.

    Example:

    >>> allgather(np.full((instance_index() + 1,), instance_index()))   # 2 instances
    array([0, 1, 1])
    """
    _check_alike(value, "allgather", first_axis_free=True)  # before raising alone
    if any(not np.ndim(leaf) for leaf in jax.tree_util.tree_leaves(value)):
        raise ValueError("allgather concatenates along the first axis: give arrays of at least "
                         "one dimension (a scalar `x` as `np.atleast_1d(x)`).")
    if num_instances() == 1:
        return jax.tree_util.tree_map(np.asarray, value)
    from jax.experimental import multihost_utils

    def gather(leaf):
        leaf = np.asarray(leaf)
        lengths = multihost_utils.process_allgather(np.int64(leaf.shape[0]))
        longest = int(np.max(lengths))
        padded = np.zeros((longest, *leaf.shape[1:]), leaf.dtype)
        padded[: leaf.shape[0]] = leaf
        stacked = _exchanged(lambda a: multihost_utils.process_allgather(a, tiled=False), padded)
        return np.concatenate([stacked[i, :n] for i, n in enumerate(lengths)])

    return jax.tree_util.tree_map(gather, value)


def broadcast(value: Any, root_rank: int = 0) -> Any:
    """Instance `root_rank`'s value, on every instance (every instance must call it).

    Args:
        value: An array-like or a tree of them, the same shapes on every instance.
        root_rank: The instance whose value is kept.

    Returns:
        The root's value, as NumPy arrays.

    Raises:
        ValueError: When `root_rank` is not an instance.

    Example:

    >>> broadcast(np.float32(instance_index()))   # 2 instances
    0.0
    """
    count = num_instances()
    if not 0 <= root_rank < count:
        raise ValueError(f"root_rank must be an instance index in 0..{count - 1}, "
                         f"got {root_rank!r}.")
    if count == 1:
        return jax.tree_util.tree_map(np.asarray, value)
    _check_alike(value, "broadcast")
    if root_rank == 0:
        from jax.experimental import multihost_utils

        return jax.tree_util.tree_map(
            lambda a: _exchanged(multihost_utils.broadcast_one_to_all, a), value)
    return jax.tree_util.tree_map(lambda a: a[root_rank], _gather_stacked(value))


def barrier(name: str) -> None:
    """Waits until every instance reached the barrier of the same name."""
    if num_instances() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def check_described_alike(lines: Sequence[str], what: str, advice: str) -> None:
    """Raises in every instance when the instances' descriptions of one thing differ.

    Every instance must call it at the same point. The instances exchange a
    digest of their lines; only when the digests differ do they exchange the
    lines, to name the first that differs in each instance.

    Args:
        lines: This instance's description, one fact per line.
        what: The thing described, for the message (``"`fit`'s program"``).
        advice: What makes the instances agree, for the message.

    Raises:
        ValueError: The same in every instance, naming each instance's first
            line that is not instance 0's.

    Example:

    >>> check_described_alike(["batch 0: float32[8, 4]"], "`fit`'s program", "Feed alike.")
    """
    if num_instances() == 1:
        return
    from jax.experimental import multihost_utils

    text = "\n".join(lines)
    digests = np.asarray(multihost_utils.process_allgather(np.uint32(zlib.crc32(text.encode()))))
    if len(set(digests.ravel().tolist())) == 1:
        return
    encoded = np.frombuffer(text.encode(), np.uint8)
    lengths = allgather(np.array([encoded.size], np.int64))
    every = np.split(allgather(encoded), np.cumsum(lengths)[:-1])
    described = [bytes(e).decode().split("\n") for e in every]
    first = described[0]
    differences = []
    for index, theirs in enumerate(described[1:], start=1):
        at = next((j for j, (a, b) in enumerate(zip(first, theirs)) if a != b),
                  min(len(first), len(theirs)))
        mine = first[at] if at < len(first) else "nothing more"
        other = theirs[at] if at < len(theirs) else "nothing more"
        if mine != other:
            differences.append(f"instance 0 has {mine!r} where instance {index} has {other!r}")
    raise ValueError(
        f"{what} differs between the {len(described)} instances, so their collectives would "
        f"not match and the job would abort: {'; '.join(differences)}. {advice}")


def _check_alike(value: Any, operation: str, first_axis_free: bool = False) -> None:
    """Raises in every instance when their values differ in structure, dtypes or shapes.

    The exchange itself would mix their bytes, or wait forever for an
    instance sending another size, as Horovod refuses mismatched tensors.
    """
    if num_instances() == 1:
        return
    from jax.experimental import multihost_utils

    leaves, structure = jax.tree_util.tree_flatten(value)
    described = f"{structure}: " + ", ".join(
        f"{np.asarray(leaf).dtype}"
        + (f"[*{list(np.shape(leaf)[1:])}]" if first_axis_free and np.ndim(leaf)
           else f"{list(np.shape(leaf))}") for leaf in leaves)
    digests = multihost_utils.process_allgather(np.uint32(zlib.crc32(described.encode())))
    if len(set(np.asarray(digests).ravel().tolist())) > 1:
        raise ValueError(
            f"{operation} needs the same structure, dtypes and shapes"
            f"{' (but for the first axis)' if first_axis_free else ''} on every instance; "
            f"instance {instance_index()} has {described}, and not every instance has the same.")


def _gather_stacked(value: Any) -> Any:
    """Every instance's value, stacked on a new first axis (NumPy)."""
    if num_instances() == 1:
        return jax.tree_util.tree_map(lambda a: np.asarray(a)[None], value)
    from jax.experimental import multihost_utils

    return jax.tree_util.tree_map(
        lambda a: _exchanged(lambda w: multihost_utils.process_allgather(w, tiled=False), a),
        value)


def _exchanged(exchange, value: Any) -> np.ndarray:
    """`exchange(value)` for a host value of any width, as NumPy.

    JAX without 64-bit types would cut 64-bit values to 32 bits on the way,
    so those travel as their 32-bit words (a trailing axis) and come back
    whole, in their own dtype.
    """
    array = np.asarray(value)
    if array.dtype.itemsize <= 4:
        return np.asarray(exchange(array))
    words = np.array(array, order="C")[..., None].view(np.uint32)  # keeps a 0-d shape
    back = np.array(exchange(words), dtype=np.uint32, order="C")
    return back.view(array.dtype)[..., 0]
