"""``python -m latte``: the same as the ``latte`` command."""

import sys

from latte.cli import main

sys.exit(main())
