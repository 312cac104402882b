import os
import sys

# Triton kernels run on the CPU through the interpreter in tests; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests import the tiny model factory as `tiny_models`

import hf_adaptive_spec  # noqa: E402,F401  (installs the generate() hook)
