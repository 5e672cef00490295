"""The failure that ends a tensor-parallel engine."""


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died, hung past ``distributed_timeout``, or fell out of
    step: the engine cannot run another step, and has stopped its ranks."""
