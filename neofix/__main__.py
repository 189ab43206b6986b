"""``python -m neofix doctor``: the same command as the ``neofix`` console script."""

import sys

from ._cli import main

sys.exit(main())
