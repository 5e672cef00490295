"""The one error type model loading raises, so callers can catch it by name."""


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded; the message names what was found and where."""
