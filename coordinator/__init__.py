"""The coordinator: registers shards, partitions models into stages and ships them. Never carries tensors."""
