"""Errors the model zoo raises: each names the file or input at fault and how to fix it.

The CLI prints these as one line and exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base class: a model could not be built or run as asked. str(e) is the whole user-facing message."""


class CheckpointError(ModelError):
    """A checkpoint file is truncated, malformed, or lacks a tensor the architecture needs."""


class UnsupportedArchitectureError(ModelError):
    """The checkpoint declares an architecture the zoo does not implement."""


class ContextLengthError(ModelError):
    """The prompt (plus the tokens to generate) does not fit in the model's context."""


class TokenIdError(ModelError):
    """A prompt holds a token id outside the model's vocabulary."""
