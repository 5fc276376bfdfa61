"""``python -m drills.upstream``: see `drills.upstream.cli`."""

import sys

from drills.upstream.cli import main

if __name__ == "__main__":
    sys.exit(main())
