"""Errors a user can cause. Each carries one sentence that names the file, tensor or setting at fault.

The CLI prints the message and exits non-zero; the server maps them to 4xx. Anything else is a bug.
"""

from __future__ import annotations


class MoestreamError(Exception):
    """Base class of user-facing errors: the message is shown as is, without a traceback."""


class CheckpointError(MoestreamError):
    """The checkpoint is missing, incomplete or malformed."""


class UnsupportedModelError(MoestreamError):
    """The checkpoint's model_type is dense or not (yet) supported."""


class CacheBudgetError(MoestreamError):
    """The expert cache budget cannot hold what one layer needs."""


class ExpertReadError(MoestreamError):
    """Reading expert bytes failed or came up short."""


class CheckpointChangedError(CheckpointError):
    """A checkpoint file was rewritten, replaced or removed while the process was using it."""


class MemoryBudgetError(CacheBudgetError):
    """What a run would hold does not fit in the memory the process may use."""
