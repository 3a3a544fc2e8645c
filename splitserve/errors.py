"""One error root for the whole platform, split into recoverable and fatal.

A recoverable error is the request's fault or a passing condition: the caller
reports it to the client (HTTP 4xx) and carries on. A fatal error means the
process cannot go on serving (corrupt weights, a broken device).
"""


class SplitserveError(Exception):
    """Root of every error splitserve raises on purpose. `str()` is fit for a client."""


class RecoverableError(SplitserveError):
    """The request cannot be served as asked; the process is fine."""


class FatalError(SplitserveError):
    """The process cannot serve (bad model files, device failure)."""


class InvalidRequestError(RecoverableError):
    """Bad input: empty prompt, prompt too long, out-of-range parameter."""


class ModelLoadError(FatalError):
    """Missing, corrupt or unsupported model files."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but its architecture or options are not supported."""
