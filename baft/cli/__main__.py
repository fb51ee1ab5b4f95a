"""``python -m baft.cli ...``: the ``baft`` command without the console script."""

import sys

from baft.cli import main

sys.exit(main())
