"""The one exception tree of kvmesh.

Expected scarcity (a cache miss, a full pool) is a return value, caller misuse is ``ValueError``,
and a broken invariant is an ``assert``. What is left are the failures below. Third-party errors
are translated where they enter the code and chained with ``from exc``.
"""

from __future__ import annotations


class KVMeshError(Exception):
    """Base class of every error kvmesh raises on purpose."""


class ConfigError(KVMeshError, ValueError):
    """A configuration file, flag or environment variable has an invalid value."""


class ProtocolError(KVMeshError):
    """A frame or message does not follow the wire format."""


class CorruptChunkError(KVMeshError):
    """A stored chunk failed its checksum, HMAC or header validation."""


class TierUnavailableError(KVMeshError):
    """A storage tier cannot be reached (connection refused, timeout, breaker open)."""


class ModelLoadError(KVMeshError):
    """A model or tokenizer could not be loaded from local files."""


class FleetError(KVMeshError):
    """A fleet process failed to start, exited early, or never became healthy."""


class RequestError(KVMeshError, ValueError):
    """A client request is invalid; the server answers it with a 4xx and this message."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class UpstreamError(KVMeshError):
    """An endpoint's answer broke after it began (reset or closed mid-answer, malformed HTTP)."""


class UpstreamUnreachableError(UpstreamError):
    """No answer began: the connection could not be opened, or it closed before the first byte of
    a response. Nothing was generated, so another endpoint may take the request."""
