"""``python -m benchmarks.acceptance``: the benchmark's command line (``benchmarks.acceptance.cli``)."""

import sys

from benchmarks.acceptance.cli import main

sys.exit(main())
