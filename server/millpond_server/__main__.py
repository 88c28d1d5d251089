"""``python -m millpond_server`` works like the ``millpond`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
