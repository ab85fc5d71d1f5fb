"""`python -m kvoffload`: the `kvoffload` command."""

import sys

from kvoffload.cli import main

sys.exit(main())
