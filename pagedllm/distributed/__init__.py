"""Tensor parallelism: how a decoder splits over ranks, and the processes that run them."""
