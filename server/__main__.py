"""``python -m difftape.server``: the same as ``difftape serve``."""

from __future__ import annotations

import sys

from difftape.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
