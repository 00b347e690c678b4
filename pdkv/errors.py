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


class OutOfPages(PdkvError, RuntimeError):
    """The page allocator cannot hand out the pages asked for; nothing was allocated. (Admission
    never sees it: the scheduler checks first and the request waits, pdkv/engine/scheduler.py.)"""


class AdmissionRefused(PdkvError, RuntimeError):
    """A request refused at admission (``LLMEngine.add_request``), e.g. no prefill node is
    connected; the KV connector says so with ``Answer.refuse`` (pdkv/engine/connector.py).
    ``status`` / ``retry_after``: what the client is told (503 + Retry-After: try again later)."""

    def __init__(self, message: str, status: int = 500, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class PageStateError(PdkvError, RuntimeError):
    """A page was freed twice, or a pinned page was freed without being unpinned first."""
