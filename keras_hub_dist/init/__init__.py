"""Init: random initialization drawn shard by shard.

Distributed twins of Keras's random initializers (`initializers`), the
block-offset PRNG behind them (`sharded_random`), the embedding-path registry
(`registry`) and the backbone factories that use them (`factories`).
"""
