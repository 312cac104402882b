"""`python -m hf_adaptive_spec.bench ...`: the benchmark's command line (`bench.run.main`)."""

import sys

from .run import main

sys.exit(main())
