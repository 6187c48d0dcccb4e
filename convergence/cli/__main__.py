"""``python -m convergence.cli`` (the nightly sbatch script calls it so)."""

import sys

from convergence.cli import main

sys.exit(main())
