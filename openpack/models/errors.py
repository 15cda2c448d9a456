"""What a model flag can be refused with; the CLIs print the message as one line and exit 2."""


class ModelLoadError(ValueError):
    """--pretrain (or --ref_pretrain, ...) names nothing loadable; the message says which flag and what was tried."""


class UnsupportedModelError(ModelLoadError):
    """A model family or feature that packing cannot make exact (``models.families``); the message names it and
    the fix."""
