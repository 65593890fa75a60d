"""`python -m bitfuse ...`, the same as the `bitfuse` command."""

import sys

from .cli import main

sys.exit(main())
