"""The shard: a gRPC server that runs one stage of a model."""
