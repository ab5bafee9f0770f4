"""The uag app: the target alone vs speculative decoding, side by side. `python app.py --help` for options."""

import sys

from uag.serve import main

if __name__ == "__main__":
    sys.exit(main())
