import sys

from uag.cli import main

sys.exit(main())
