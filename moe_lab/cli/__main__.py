"""`python -m moe_lab.cli ...` = `moe-lab ...`."""

import sys

from .main import main

sys.exit(main())
