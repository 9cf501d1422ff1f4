"""The one error type of GGUF reading."""


class GGUFError(ValueError):
    """A GGUF file this loader cannot read: corrupt, truncated, or unsupported."""
