"""`python -m uag.analyze`, kept for older commands: now `python -m uag analyze` (uag.study.analyze)."""

import sys

from uag.study.analyze import main

if __name__ == "__main__":
    sys.exit(main())
