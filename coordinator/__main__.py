"""`python -m coordinator`: run the coordinator."""

import sys

from coordinator.server import main

sys.exit(main())
