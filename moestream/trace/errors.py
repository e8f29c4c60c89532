"""The one error type of the trace package: a file a user named is missing, cut, or not a trace."""

from __future__ import annotations

from moestream.errors import MoestreamError


class TraceError(MoestreamError):
    """A trace file is missing, truncated, malformed or in an unknown format; the message names the file."""
