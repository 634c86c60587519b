"""DeepEP's event helpers on epx.

An :class:`EventHandle` marks a point of a stream; :class:`EventOverlap` wraps one so the caller
can make its current stream wait for it. On CUDA tensors the event is a ``torch.cuda.Event``
recorded on the stream the work went to (the comm stream when ``allocate_on_comm_stream``); on
the CPU backend every operation has finished when it returns, so the event is already complete
and waiting on it is a no-op."""

from typing import Any, Optional

import torch

__all__ = ["EventHandle", "EventOverlap"]


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class EventHandle:
    """An event recorded on the current stream when made (CUDA), or a completed marker (CPU)."""

    def __init__(self, stream: Optional[Any] = None):
        self.event = None
        if _cuda_ready():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """The current stream waits for the event (CUDA); nothing to wait for on the CPU."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream) -> None:
        if self.event is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """DeepEP's ``EventOverlap``: ``current_stream_wait()``, and a ``with`` block after which the
    current stream waits for the event. ``extra_tensors`` are kept alive until then."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[tuple] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False
