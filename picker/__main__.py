"""`python -m picker` is the same as the `picker` command."""

import sys

from picker.cli import main

sys.exit(main())
