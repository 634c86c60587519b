"""What every drop-in buffer shares: one epx world per process group, comms keyed by the
shapes they serve, and DeepEP's stream semantics around each operation."""

import contextlib
import threading
import weakref
from typing import Dict, Optional, Tuple

import torch

import epx

from .utils import EventHandle, EventOverlap

_lock = threading.Lock()
_worlds: Dict[int, "epx.World"] = {}
_comms: Dict[Tuple, "epx.Comm"] = {}

# The CUDA backend's kernels give each top-k slot of a token its own lane; the CPU backend has
# no such limit (EPX_MAX_TOPK).
CUDA_MAX_TOPK = 16


def group_key(group) -> int:
    return id(group)


def world_for(group) -> "epx.World":
    """The epx world of this process's rank in `group`, made once (collective over the group
    the first time)."""
    key = group_key(group)
    with _lock:
        w = _worlds.get(key)
    if w is None:
        w = epx.World.from_torch_distributed(group=group, backend="auto")
        with _lock:
            _worlds[key] = w
    return w


def comm_for(group, *, num_experts: int, hidden: int, topk: int, max_tokens: int, num_sms: int = 0,
             algo: str = "ht") -> "epx.Comm":
    """A comm of `group` for these shapes, made once (collective: every rank asks for the same
    shapes in the same order, as a framework's layers do). `max_tokens` counts only when the
    comm is made, and may differ between ranks (epx takes the group's largest): it is not part
    of the key, which every rank must compute alike."""
    w = world_for(group)
    key = (group_key(group), algo, int(num_experts), int(hidden), int(topk), int(num_sms))
    with _lock:
        c = _comms.get(key)
    if c is None:
        c = w.comm(w.rank, num_experts=int(num_experts), hidden=int(hidden), topk=int(topk),
                   max_tokens_per_rank=int(max_tokens), num_sms=int(num_sms))
        with _lock:
            _comms[key] = c
    return c


def release(group) -> None:
    """Closes the comms and the world of `group` (Buffer.destroy)."""
    key = group_key(group)
    with _lock:
        comms = [k for k in _comms if k[0] == key]
        cs = [_comms.pop(k) for k in comms]
        w = _worlds.pop(key, None)
    for c in cs:
        c.close()
    if w is not None:
        w.close()


_retired = []  # (handle, event or None): plans the framework dropped, to close at the next reap()


def own(plan, handle: "epx.Handle", stream=None) -> None:
    """Retires `handle` once `plan` (what the framework holds until backward) is collected, so a
    plan lives as long as the framework keeps it; reap() closes it at the next operation. The
    collector may run inside any epx call (which may hold the world's lock), so retiring only
    appends to a list. With a CUDA `stream`, closing also waits (without blocking: reap() polls)
    until the work queued on the stream by then is done, as kernels in flight may still use
    the plan's memory."""

    def retire():
        ev = None
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
        _retired.append((handle, ev))

    weakref.finalize(plan, retire)


def reap() -> None:
    """Closes the retired handles whose work has finished (never waits)."""
    done = [item for item in list(_retired) if item[1] is None or item[1].query()]
    for item in done:
        _retired.remove(item)
    for h, _ in done:
        h.close()


# ---- streams and events ----------------------------------------------------------------------


def _is_cuda(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.is_cuda


class CommStreamScope:
    """DeepEP's rules for one operation, on CUDA tensors: the work runs on the buffer's comm
    stream, which first waits for `previous_event` (or, without one, for the current stream);
    outputs are allocated on the comm stream when `allocate_on_comm_stream`, else on the
    current stream's behalf (recorded on it either way, so neither stream frees memory the
    other still uses); with `async_finish` the caller gets an event to wait on, without it the
    current stream waits for the comm stream before the call returns. On CPU tensors every
    operation has finished when it returns: the returned event is complete."""

    def __init__(self, comm_stream, inputs, previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        self.cuda = any(_is_cuda(t) for t in inputs) and comm_stream is not None
        self.comm_stream = comm_stream
        self.inputs = [t for t in inputs if _is_cuda(t)]
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.compute_stream = torch.cuda.current_stream() if self.cuda else None

    @contextlib.contextmanager
    def run(self):
        if not self.cuda:
            yield
            return
        ev = getattr(self.previous_event, "event", None)
        if isinstance(ev, EventHandle):
            ev.stream_wait(self.comm_stream)
        else:
            self.comm_stream.wait_stream(self.compute_stream)
        for t in self.inputs:
            t.record_stream(self.comm_stream)
        with torch.cuda.stream(self.comm_stream):
            yield

    def finish(self, outputs) -> EventOverlap:
        if not self.cuda:
            return EventOverlap(EventHandle())
        for t in outputs:
            if _is_cuda(t):
                t.record_stream(self.compute_stream)
        event = EventHandle(self.comm_stream)
        if not self.async_finish:
            event.current_stream_wait()
        return EventOverlap(event, extra_tensors=tuple(t for t in outputs if torch.is_tensor(t)))
