"""epx's exceptions: one :class:`Error` subclass per status, and the check that turns a failed C
call into one (with the calling thread's ``epx_last_error()``)."""

from __future__ import annotations

from . import _lib
from ._lib import Status


class Error(Exception):
    """An epx failure. ``status`` is a :class:`Status` (an ``int`` with a ``.name``), ``message``
    the detailed text (``epx_last_error()`` for failures inside C).

    Subclasses, one per status, so ``except epx.CommTimeoutError`` works; each also derives
    from the closest built-in exception (``ValueError`` for bad input, ``TimeoutError`` for a
    timeout, ...):

    ==========================  ==============================  ==========================
    class                       status                          also a
    ==========================  ==============================  ==========================
    InvalidArgumentError        INVALID_ARGUMENT                ValueError
      ShapeError                INVALID_ARGUMENT (Python check) ValueError
      DTypeError                INVALID_ARGUMENT (Python check) ValueError, TypeError
      DeviceError               INVALID_ARGUMENT (Python check) ValueError
    NullPointerError            NULL_POINTER                    ValueError
    ExpertOutOfRangeError       EXPERT_OUT_OF_RANGE             ValueError
    ExpertsNotDivisibleError    EXPERTS_NOT_DIVISIBLE           ValueError
    TopkRangeError              TOPK_RANGE                      ValueError
    HiddenRangeError            HIDDEN_RANGE                    ValueError
    RowAlignmentError           ROW_ALIGNMENT                   ValueError
    OutputTooSmallError         OUTPUT_TOO_SMALL                ValueError
    LowLatencyOverflowError     LL_OVERFLOW                     ValueError
    ConfigMismatchError         CONFIG_MISMATCH                 ValueError
    CommTimeoutError            TIMEOUT                         TimeoutError
      (alias ``TimeoutError_``)
    PeerLostError               PEER_LOST                       ConnectionError
    UnsupportedError            UNSUPPORTED                     NotImplementedError
    OutOfMemoryError            OUT_OF_MEMORY                   MemoryError
    SystemCallError             SYSTEM                          RuntimeError
    CudaError                   CUDA                            RuntimeError
    BrokenCommError             BROKEN                          RuntimeError
    InternalError               INTERNAL                        RuntimeError
    OutOfStepError              OUT_OF_STEP                     RuntimeError
    BusyError                   BUSY                            RuntimeError
    ==========================  ==============================  ==========================
    """

    default_status = Status.INTERNAL

    def __init__(self, status=None, message: str = ""):
        if status is None:
            status = self.default_status
        try:
            status = Status(int(status))
        except ValueError:
            pass
        self.status = status
        self.message = message
        name = status.c_name if isinstance(status, Status) else f"EPX status {status}"
        super().__init__(f"{name}: {message}" if message else name)

    @property
    def status_name(self) -> str:
        """``EPX_ERR_...``, the C name of the status."""
        return self.status.c_name if isinstance(self.status, Status) else str(self.status)


def _errcls(name, status, *bases, doc=""):
    cls = type(name, (Error,) + bases, {"default_status": status, "__doc__": doc or f"Status {status.c_name}."})
    cls.__module__ = "epx"
    return cls


InvalidArgumentError = _errcls("InvalidArgumentError", Status.INVALID_ARGUMENT, ValueError)
NullPointerError = _errcls("NullPointerError", Status.NULL_POINTER, ValueError)
ExpertOutOfRangeError = _errcls("ExpertOutOfRangeError", Status.EXPERT_OUT_OF_RANGE, ValueError)
ExpertsNotDivisibleError = _errcls("ExpertsNotDivisibleError", Status.EXPERTS_NOT_DIVISIBLE, ValueError)
TopkRangeError = _errcls("TopkRangeError", Status.TOPK_RANGE, ValueError)
HiddenRangeError = _errcls("HiddenRangeError", Status.HIDDEN_RANGE, ValueError)
RowAlignmentError = _errcls("RowAlignmentError", Status.ROW_ALIGNMENT, ValueError)
OutputTooSmallError = _errcls("OutputTooSmallError", Status.OUTPUT_TOO_SMALL, ValueError)
LowLatencyOverflowError = _errcls("LowLatencyOverflowError", Status.LL_OVERFLOW, ValueError)
ConfigMismatchError = _errcls("ConfigMismatchError", Status.CONFIG_MISMATCH, ValueError)
CommTimeoutError = _errcls("CommTimeoutError", Status.TIMEOUT, TimeoutError)
PeerLostError = _errcls("PeerLostError", Status.PEER_LOST, ConnectionError)
UnsupportedError = _errcls("UnsupportedError", Status.UNSUPPORTED, NotImplementedError)
OutOfMemoryError = _errcls("OutOfMemoryError", Status.OUT_OF_MEMORY, MemoryError)
SystemCallError = _errcls("SystemCallError", Status.SYSTEM, RuntimeError)
CudaError = _errcls("CudaError", Status.CUDA, RuntimeError)
BrokenCommError = _errcls("BrokenCommError", Status.BROKEN, RuntimeError)
InternalError = _errcls("InternalError", Status.INTERNAL, RuntimeError)
OutOfStepError = _errcls("OutOfStepError", Status.OUT_OF_STEP, RuntimeError,
                         doc="Status EPX_ERR_OUT_OF_STEP: the ranks were in different collective calls (another "
                             "operation, call number or handle); the comm is broken afterwards.")
BusyError = _errcls("BusyError", Status.BUSY, RuntimeError,
                     doc="Status EPX_ERR_BUSY: another thread is inside a call on the comm, or a destroy found "
                         "live comms or handles; the call did nothing.")
TimeoutError_ = CommTimeoutError


class ShapeError(InvalidArgumentError):
    """An array of the wrong shape (found in Python; in a collective the rank still takes part,
    so its peers fail at once with an InvalidArgumentError naming it: epx.collective)."""


class DTypeError(InvalidArgumentError, TypeError):
    """An array of the wrong dtype (found in Python; a collective's peers learn it at once, as
    for ShapeError)."""


class DeviceError(InvalidArgumentError):
    """An array on the wrong device for the comm's backend (found in Python; a collective's
    peers learn it at once, as for ShapeError)."""


for _c in (ShapeError, DTypeError, DeviceError):
    _c.__module__ = "epx"

_ERRORS = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.NULL_POINTER: NullPointerError,
    Status.EXPERT_OUT_OF_RANGE: ExpertOutOfRangeError,
    Status.EXPERTS_NOT_DIVISIBLE: ExpertsNotDivisibleError,
    Status.TOPK_RANGE: TopkRangeError,
    Status.HIDDEN_RANGE: HiddenRangeError,
    Status.ROW_ALIGNMENT: RowAlignmentError,
    Status.OUTPUT_TOO_SMALL: OutputTooSmallError,
    Status.LL_OVERFLOW: LowLatencyOverflowError,
    Status.CONFIG_MISMATCH: ConfigMismatchError,
    Status.TIMEOUT: CommTimeoutError,
    Status.PEER_LOST: PeerLostError,
    Status.UNSUPPORTED: UnsupportedError,
    Status.OUT_OF_MEMORY: OutOfMemoryError,
    Status.SYSTEM: SystemCallError,
    Status.CUDA: CudaError,
    Status.BROKEN: BrokenCommError,
    Status.INTERNAL: InternalError,
    Status.OUT_OF_STEP: OutOfStepError,
    Status.BUSY: BusyError,
}


def error_class(status) -> type:
    """The :class:`Error` subclass raised for a status."""
    try:
        return _ERRORS.get(Status(int(status)), Error)
    except ValueError:
        return Error


def _raise(status, message: str = ""):
    raise error_class(status)(status, message)


def _check(status: int, what: str = "") -> None:
    """Raises the Error of a failed C call, with this thread's epx_last_error()."""
    if status == 0:
        return
    lib = _lib.load()
    msg = (lib.epx_last_error() or b"").decode(errors="replace")
    if not msg:
        msg = (lib.epx_status_string(status) or b"").decode(errors="replace")
    if what:
        msg = f"{what}: {msg}"
    _raise(status, msg)


def _shape_error(msg):
    raise ShapeError(Status.INVALID_ARGUMENT, msg)


def _dtype_error(msg):
    raise DTypeError(Status.INVALID_ARGUMENT, msg)


def _arg_error(msg):
    raise InvalidArgumentError(Status.INVALID_ARGUMENT, msg)
