"""The uag app: the target alone vs speculative decoding, side by side. `python app.py --help` for options."""

import sys

from uag.app.launch import main

if __name__ == "__main__":
    sys.exit(main())
