"""Tensor parallelism: shard arithmetic, collectives, the rank-0 runner proxy and the worker loop.

    parallel.py   TensorParallel (rank, size) + the three collectives the model uses
    sharding.py   which slice of every tensor a rank holds; the per-rank ModelConfig
    group.py      process start-up (spawned workers or torchrun), control channel, shutdown
    worker.py     ranks > 0: receive calls from rank 0, run them on the local ModelRunner
    runner.py     TPModelRunner: rank 0's ModelRunner stand-in that mirrors every call
"""
