"""`python -m uag.demo`, kept for older commands: now `python -m uag models` (uag.models.demo)."""

import sys

from uag.models.demo import main

if __name__ == "__main__":
    sys.exit(main())
