"""pdkv's error types. Each message names what was wrong (a field, a file, a number).

``InvalidRequest`` subclasses ValueError so callers that only know Python's builtins still catch
it; the server maps it to HTTP 400.
"""

from __future__ import annotations


class PdkvError(Exception):
    """Base of every error pdkv raises on purpose."""


class InvalidRequest(PdkvError, ValueError):
    """A request (prompt or sampling parameters) that the engine refuses; nothing was changed."""


class ModelLoadError(PdkvError, ValueError):
    """A model folder that cannot be loaded; the message names the file and what is wrong."""


class UnsupportedArchitecture(ModelLoadError):
    """config.json names an architecture no model family implements."""


class BackendUnavailable(PdkvError, RuntimeError):
    """An attention backend was chosen that cannot run here (not installed, no GPU, bad layout)."""


class ResourceBusy(PdkvError, RuntimeError):
    """A request cannot be admitted now: a per-request resource (pages, a hidden-state slot, ...)
    is not free. Nothing was reserved; admission is tried again later (pdkv.engine.loop)."""


class OutOfPages(ResourceBusy):
    """The page allocator cannot hand out the pages asked for; nothing was allocated."""


class AdmissionRefused(PdkvError, RuntimeError):
    """The KV connector refuses a request it cannot serve (e.g. no prefill node connected).
    ``status`` / ``retry_after``: what the client is told (503 + Retry-After: try again later)."""

    def __init__(self, message: str, status: int = 500, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class PageStateError(PdkvError, RuntimeError):
    """A page was freed twice, or a pinned page was freed without being unpinned first."""
