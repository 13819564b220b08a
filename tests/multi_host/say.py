"""One line of a job's output in one write.

The launcher runs instances unbuffered, and gloo's C++ logging writes to the
same stream: `print(a, b)` (one write per argument) can be split by it.
"""

import sys


def say(*parts) -> None:
    """Writes `parts` joined by spaces and a newline, in one write."""
    sys.stdout.write(" ".join(str(part) for part in parts) + "\n")
    sys.stdout.flush()
