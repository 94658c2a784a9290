"""`python -m shard_service`: run one shard."""

import sys

from shard_service.server import main

sys.exit(main())
