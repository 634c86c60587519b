"""One collective operation made from Python: the checks of its arguments and the C collective
calls it makes, so that a rank whose Python checks refuse its arguments still takes part.

The Python layer checks shapes, dtypes and devices before anything reaches C. A rank that
raised there and made no C call would leave its peers waiting in theirs until the timeout, or
worse, pair their call with this rank's next one. So a refusal found in Python still makes the
C call the peers are in, with arguments that call refuses by their form (a struct never set up,
a negative token count): libepx then takes part carrying EPX_ERR_INVALID_ARGUMENT, the status of
every Python check's error, and the peers fail at once with an error naming this rank. This
rank raises the Python error, whose message says what was wrong.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable, Optional

from .numpy_frontend import _NUMPY

if TYPE_CHECKING:
    from .comm import Comm

_THREAD = threading.local()  # .ops: the operations open on this thread, outermost first


class _Collective:
    """``with _Collective(comm, refuse, fe) as op:`` around one operation's checks and calls.

    ``refuse()`` makes the C call the peers are in with arguments it refuses and returns
    its status; the operation may change it as it goes (``op.refuse = ...``: a dispatch that
    has made its plan then refuses the dispatch alone). Every C collective call goes through
    :meth:`call`; once the operation's last one was made, or any one failed (the rank then
    failed together with its peers), an exception is the rank's own affair and nothing more
    takes part. Any exception before that (a Python check, a conversion) takes part first,
    then propagates unchanged; one whose stream cannot host the call cannot host its refusal
    either (see :meth:`_take_part`).

    Operations nest (``epx.torch.dispatch`` checks its arguments, then calls
    ``Handle.dispatch``): the innermost open one takes part, and whatever it settles (a C
    call made, a refusal sent) settles the enclosing ones of the same comm too, so a rank
    takes part once.
    """

    def __init__(self, comm: Optional["Comm"], refuse: Callable[[], int], fe=_NUMPY):
        self.comm = comm
        self.refuse = refuse
        self.fe = fe
        self._owed = True  # the peers still wait for a C call from this operation

    def __enter__(self) -> "_Collective":
        ops = _THREAD.__dict__.setdefault("ops", [])
        ops.append(self)
        return self

    def _settle(self) -> None:
        """Nothing more is owed, by this operation or the ones of its comm around it."""
        for op in getattr(_THREAD, "ops", ()):
            if op.comm is self.comm:
                op._owed = False

    def call(self, fn: Callable[[], int], device: Optional[str], last: bool = True) -> int:
        """Makes one of the operation's C collective calls on the comm's stream for ``device``
        (the frontend's current stream on CUDA); returns its status for the caller to check."""
        with self.fe.on_stream(self.comm, device):
            st = fn()
            if last or st != 0:
                self._settle()
        return st

    def __exit__(self, et, ev, tb) -> bool:
        ops = getattr(_THREAD, "ops", [])
        try:
            if self._owed and isinstance(ev, Exception):
                self._settle()
                self._take_part()
        finally:
            if ops and ops[-1] is self:
                ops.pop()
        return False  # the exception propagates as it was

    def _take_part(self) -> None:
        """Makes the refused call where the operation's own call would have gone: on CUDA the
        rank's device and the caller's current stream. Where the frontend finds that stream
        cannot host the call (torch's legacy default stream shared by ranks of one GPU, whose
        waiting kernels would queue behind each other), it cannot host the refusal either:
        the rank then reports its error alone, as its peers, on the same streams, do. Whatever
        the refused call returns, this rank reports its own refusal."""
        where = self._stream_frontend()
        if where is None:
            return
        fe, device = where
        with contextlib.suppress(Exception):
            with fe.on_stream(self.comm, device):
                self.refuse()

    def _stream_frontend(self):
        """The frontend and device whose stream the refused call goes to (no stream for a
        call that runs on none, such as comm creation: ``comm`` None); None where no stream
        can be told."""
        if self.comm is None or self.comm.backend != "cuda":
            return _NUMPY, None
        try:
            from .torch import _TORCH  # a CUDA world in Python runs on torch (epx.gpu)

            return _TORCH, f"cuda:{self.comm.world.device_of(self.comm.rank)}"
        except Exception:  # noqa: BLE001 - no CUDA stream to trust with the refusal
            return None
