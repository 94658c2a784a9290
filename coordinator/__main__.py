"""`python -m coordinator`: as `shardtrain coordinator`, run the coordinator."""

import sys

from shardtrain.cli import main

sys.exit(main(["coordinator", *sys.argv[1:]]))
