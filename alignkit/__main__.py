"""`python -m alignkit ...` is the same as the `alignkit` command."""

import sys

from .cli import main

sys.exit(main())
