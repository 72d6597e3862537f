"""``python -m runtime ...``: see runtime.cli."""

import sys

from runtime.cli import main

sys.exit(main())
