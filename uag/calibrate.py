"""`python -m uag.calibrate`, kept for older commands: now `python -m uag calibrate` (uag.study.calibrate)."""

import sys

from uag.study.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
