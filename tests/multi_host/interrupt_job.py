"""Waits to be interrupted: prints "ready", then "interrupted" when Ctrl-C (SIGINT) arrives.

Plain Python: what is tested is the launcher forwarding the signal, so the
job stays quick to start (the instances need not join the job's runtime).
"""

import time

from job import say

try:
    # Ready inside the `try`: the interrupt may come as soon as it is printed.
    say("ready")
    time.sleep(120)  # bounded: the test interrupts it within seconds
except KeyboardInterrupt:
    say("interrupted")
    raise
