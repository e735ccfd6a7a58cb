"""``python -m attnpatch.cli``: the ``attnpatch`` command."""

import sys

from . import main

sys.exit(main())
