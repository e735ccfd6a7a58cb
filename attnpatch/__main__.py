"""``python -m attnpatch``: the ``attnpatch`` command."""

import sys

from .cli import main

sys.exit(main())
