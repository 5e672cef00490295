"""Tensor parallelism's ranks: their launch, the executor that drives them from the
engine, and the worker loop each rank runs (see docs/tensor_parallel.md)."""
