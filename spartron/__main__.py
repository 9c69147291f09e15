"""`python -m spartron ...` runs the `spartron` command."""

import sys

from spartron.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
