"""Exceptions raised by datapipes for bad input.

Every message names what a user needs to find the problem on disk: the file,
the variable and the shapes involved. The types derive from the builtins a
caller would catch anyway (``ValueError``, ``FileNotFoundError``), so generic
``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = ["DataPipeError", "MissingDataError", "DecompositionError", "InvalidValuesError", "FileChangedError",
           "ChecksumError"]


class DataPipeError(ValueError):
    """Data on disk, or a request about it, that the pipe cannot honour."""


class MissingDataError(DataPipeError, FileNotFoundError):
    """A file, group or variable that was asked for does not exist."""


class DecompositionError(DataPipeError):
    """A domain split that cannot be made (dim too small, halo too wide, bad sizes)."""


class InvalidValuesError(DataPipeError):
    """Values that fail validation (NaN or infinity) in data read with ``validate=True``."""


class FileChangedError(DataPipeError):
    """A data file changed while a source was reading it: truncated, replaced, rewritten (see ``_identity``)."""


class ChecksumError(DataPipeError):
    """Bytes of a file that do not match the checksum written with them (see ``_checksums``)."""
