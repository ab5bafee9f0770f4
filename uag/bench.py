"""`python -m uag.bench`, kept for older commands: now `python -m uag bench` (uag.study.bench)."""

import sys

from uag.study.bench import main

if __name__ == "__main__":
    sys.exit(main())
