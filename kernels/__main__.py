"""``python -m difftape``: the ``difftape`` command."""

import sys

from .cli import main

sys.exit(main())
