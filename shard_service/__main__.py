"""`python -m shard_service`: as `shardtrain shard`, run one shard."""

import sys

from shardtrain.cli import main

sys.exit(main(["shard", *sys.argv[1:]]))
