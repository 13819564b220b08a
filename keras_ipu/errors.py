"""Errors raised by keras_ipu that have no built-in Python equivalent."""

from __future__ import annotations


class IPUOutOfMemoryError(RuntimeError):
    """A program needs more memory than an IPU has.

    Raised before the program runs, so no weights change. Of several IPUs
    out of memory, it names the one that needs most.

    Args:
        ipu: Index of the IPU that ran out of memory.
        required_bytes: Bytes the program needs on that IPU.
        capacity_bytes: Bytes the IPU has.
        program: Name of the program (for example `"fit"`).
        pipelined: Whether the program runs a pipeline (the remedies differ).
        recomputing: Whether the pipeline recomputes already (not suggested).
        parts: `(state, temporaries and code, io)` bytes of that IPU's need,
            where known.

    Example:

    >>> err = IPUOutOfMemoryError(0, 2_000_000, 1_000_000, "fit")
    >>> err.required_bytes
    2000000
    """

    def __init__(self, ipu: int, required_bytes: int, capacity_bytes: int,
                 program: str = "program", pipelined: bool = False,
                 recomputing: bool = False, parts: tuple[int, int, int] | None = None):
        self.ipu = ipu
        self.required_bytes = required_bytes
        self.capacity_bytes = capacity_bytes
        self.program = program
        self.pipelined = pipelined
        self.recomputing = recomputing
        self.parts = parts
        state_alone = parts is not None and parts[0] > capacity_bytes
        super().__init__(
            f"Out of memory on IPU {ipu}: the {program} program needs "
            f"{required_bytes:,} bytes{_described(parts)}, but the IPU has "
            f"{capacity_bytes:,} bytes ({required_bytes / capacity_bytes:.2f}x its capacity). "
            f"Usual remedies: {_remedies(program, pipelined, recomputing, state_alone)}."
        )

    def __reduce__(self):
        return (
            type(self),
            (self.ipu, self.required_bytes, self.capacity_bytes, self.program, self.pipelined,
             self.recomputing, self.parts),
        )


def _described(parts: tuple[int, int, int] | None) -> str:
    if parts is None:
        return ""
    state, temporary, io = parts
    return (f" (weights, optimizer and metric state {state:,}; temporaries and code "
            f"{temporary:,}; one step's inputs and outputs {io:,})")


def _remedies(program: str, pipelined: bool, recomputing: bool = False,
              state_alone: bool = False) -> str:
    """What frees memory for this program: recomputation and accumulation only train;
    only `fit`, `evaluate` and `predict` can be pipelined; neither a smaller batch nor
    recomputation shrinks state that alone is over the capacity."""
    training = program == "fit"
    if program in _BATCH_METHODS:
        remedies = [f"run the model with {_BATCH_METHODS[program]}, which can pipeline it "
                    f"over more IPUs (the batch methods run it whole on one IPU)"]
    elif program not in ("fit", "evaluate", "predict"):  # a graph-style program
        remedies = ["split the work between programs, or pipeline a Keras model's "
                    "`fit`/`evaluate`/`predict` over more IPUs"]
    elif pipelined:
        remedies = ["move layers from this IPU's stages to other IPUs, or pipeline over more "
                    "IPUs (`set_pipeline_stage_assignment`)"]
    else:
        remedies = ["pipeline the model over more IPUs (`set_pipeline_stage_assignment` and "
                    "`set_pipelining_options`)"]
    if state_alone:  # neither a smaller batch nor recomputation would do
        return f"{remedies[0]} (its state alone is over the capacity)"
    if training and pipelined and not recomputing:
        remedies.append("enable recomputation (`IPUConfig.allow_recompute = True`)")
    remedies.append("use a smaller batch size (with gradient accumulation to keep the "
                    "effective batch size)" if training else "use a smaller batch size")
    return ", ".join(remedies[:-1]) + f", or {remedies[-1]}"


# Keras' batch methods and the method that can pipeline the same work.
_BATCH_METHODS = {"train_on_batch": "`fit`", "test_on_batch": "`evaluate`",
                  "predict_on_batch": "`predict`"}


class IPUNotAttachedError(RuntimeError):
    """A program was to run on a system configured never to attach to its IPUs.

    With `DeviceConnectionType.NEVER` programs are compiled (their memory
    checked and their reports made) but nothing runs. Raised before anything
    runs, so no weights change.

    Args:
        program: Name of the program (for example `"fit"`).

    Example:

    >>> str(IPUNotAttachedError("fit")).startswith("The fit program")
    True
    """

    def __init__(self, program: str = "program"):
        self.program = program
        super().__init__(
            f"The {program} program was compiled but cannot run: the IPU system is "
            f"configured with `device_connection.type = DeviceConnectionType.NEVER`, which "
            f"never attaches to an IPU. Use `DeviceConnectionType.PRE_COMPILE` to compile "
            f"and get zeros for everything the device would return, or `ALWAYS` or "
            f"`ON_DEMAND` to run it."
        )

    def __reduce__(self):
        return type(self), (self.program,)


class IPUFloatingPointError(FloatingPointError):
    """An operation raised a floating point exception that the IPU system traps.

    Raised when `floating_point_behaviour.inv`, `div0` or `oflo` is set and an
    execution raised that exception; the execution's results are not kept, so
    the model keeps the weights of the last execution that completed.

    Args:
        program: Name of the program (for example `"fit"`).
        exception: What happened, and where (the operation and its source line).

    Example:

    >>> str(IPUFloatingPointError("fit", "division by zero")).startswith("Floating point")
    True
    """

    def __init__(self, program: str, exception: str):
        self.program = program
        self.exception = exception
        super().__init__(
            f"Floating point exception in the {program} program: {exception} "
            f"(the IPU system's `floating_point_behaviour` traps it). The execution's "
            f"results were dropped: the state is that of the last execution that completed."
        )

    def __reduce__(self):
        return type(self), (self.program, self.exception)
