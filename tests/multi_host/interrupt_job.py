"""Waits to be interrupted: prints "ready" and the pid of a child process it started (a
data-loader worker's stand-in), then "interrupted" when Ctrl-C (SIGINT) arrives.

Plain Python: what is tested is the launcher forwarding the signal, so the
job stays quick to start; with the argument `join` it joins the job's runtime
first (whose preemption service once took SIGTERM for itself).
"""

import subprocess
import sys
import time

from job import say, start

if "join" in sys.argv[1:]:
    start()
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
try:
    # Ready inside the `try`: the interrupt may come as soon as it is printed.
    say("ready", worker.pid)
    time.sleep(120)  # bounded: the test interrupts it within seconds
except KeyboardInterrupt:
    say("interrupted")
    raise
