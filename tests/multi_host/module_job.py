"""Run as `-m module_job`: says which instance it is and what it was given."""

import os
import sys

print("module", os.environ["KERAS_IPU_INSTANCE_INDEX"], sys.argv[1:], flush=True)
