"""`python -m harness.report EXP [key=value ...]`: rebuild results/EXP/summary.{md,csv} and plots from the cells."""
from __future__ import annotations

import sys

from harness.reporting.rebuild import main

if __name__ == "__main__":
    sys.exit(main())
