import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import the tiny model factory as `tiny_models`

import hf_adaptive_spec  # noqa: E402,F401  (installs the generate() hook)
