"""shardtrain core: the wire contract and what every component shares (codec, errors, settings, capture)."""

__version__ = "0.1.0"
