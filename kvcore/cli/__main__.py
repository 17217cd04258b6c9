"""``python -m kvcore.cli``: the ``kvcore`` command."""

import sys

from kvcore.cli.app import main

sys.exit(main())
