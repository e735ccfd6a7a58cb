"""Exceptions raised by attnpatch.

Every error names the offending value and what is allowed instead.
"""


class AttnpatchError(Exception):
    """Base class of every error attnpatch raises on purpose."""


class OptionError(AttnpatchError, ValueError):
    """An unknown option name, a value of the wrong type, or a value out of range."""


class UnknownMethodError(AttnpatchError, ValueError):
    """A method name that is not in the registry."""


class UnsupportedModelError(AttnpatchError, TypeError):
    """A model class no adapter can patch, or a method that does not fit the model (e.g. causal-only on a ViT)."""


class PatchStateError(AttnpatchError, RuntimeError):
    """Patching an already patched model, or unpatching a model that is not patched."""


class ModelNotFoundError(AttnpatchError, OSError):
    """A model name that is neither a catalogue entry, a local directory, nor a reachable hub id."""


class DataError(AttnpatchError, ValueError):
    """A dataset, task or eval configuration that cannot be built (e.g. a context length too short for the task)."""


class InferenceOnlyError(AttnpatchError, RuntimeError):
    """An approximate method called where it would be silently wrong at run time: with autograd on
    inputs that require grad (its gradients are not implemented), or with attention dropout in training mode."""


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type name when the message is empty), for one-line errors
    that wrap a library's exception."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
