"""What every job of this folder does: join the job, and print lines whole.

The launcher runs instances unbuffered, and gloo's C++ logging writes to the
same stream: `print(a, b)` (one write per argument) can be split by it.
"""

import sys

import keras_ipu as ipu


def start():
    """Configures this instance's IPUs from the launcher's job; returns `(strategy, index)`."""
    config = ipu.config.IPUConfig()
    ipu.distributed.update_ipu_config(config)
    config.configure_ipu_system()
    return ipu.distributed.IPUMultiReplicaStrategy(), ipu.distributed.instance_index()


def say(*parts) -> None:
    """Writes `parts` joined by spaces and a newline, in one write."""
    sys.stdout.write(" ".join(str(part) for part in parts) + "\n")
    sys.stdout.flush()
