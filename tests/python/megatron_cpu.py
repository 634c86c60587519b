"""Runs Megatron-core's MoE code on CPU tensors over gloo, for the drop-in tests.

Megatron's MoE layer and token dispatchers were written for GPUs: they make CUDA streams and
events, allocate on ``torch.cuda.current_device()`` and move split sizes to the host with
``non_blocking`` copies from a side stream. None of that changes what the layer computes, so
on a machine without a GPU this module stands in for it: streams and events that are always
complete, "cuda" devices read as the CPU, and host copies that are plain copies. Every
operation the layers compute with (routing, permutation, all-to-all, expert GEMMs, autograd)
is Megatron's own, unchanged."""

import contextlib
import functools

import torch


class _Stream:
    def __init__(self, *a, **k):
        self.cuda_stream = 0

    def wait_stream(self, s):
        pass

    def wait_event(self, e):
        pass

    def synchronize(self):
        pass

    def record_event(self, e=None):
        return e or _Event()

    def query(self):
        return True


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, s=None):
        pass

    def wait(self, s=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_STREAM = _Stream()


def _cpu_device(d):
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cpu")
    if isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return d


def _on_cpu(f):
    @functools.wraps(f)
    def g(*a, **k):
        if "device" in k:
            k["device"] = _cpu_device(k["device"])
        return f(*a, **k)

    return g


_FACTORIES = ("zeros", "empty", "ones", "full", "tensor", "arange", "randn", "rand", "zeros_like", "empty_like",
              "ones_like", "full_like")
_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _to_host(tensor, as_numpy=False, record_stream=False):
    if torch.is_tensor(tensor):
        t = tensor.detach().clone()
        return t.numpy() if as_numpy else t
    return tensor


def install():
    """Call once per process, before Megatron builds anything. torch.cuda.is_available() stays
    False, so epx (and anything else that asks) still sees a machine without a GPU."""
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.default_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    for n in _FACTORIES:
        setattr(torch, n, _on_cpu(getattr(torch, n)))
    T = torch.Tensor
    for n in _METHODS:
        setattr(T, n, _on_cpu(getattr(T, n)))
    orig_to = T.to

    def to(self, *a, **k):
        if a and not isinstance(a[0], torch.dtype) and not torch.is_tensor(a[0]):
            a = (_cpu_device(a[0]),) + a[1:]
        if "device" in k:
            k["device"] = _cpu_device(k["device"])
        return orig_to(self, *a, **k)

    T.to = to
    T.cuda = lambda self, *a, **k: self
    T.record_stream = lambda self, s: None


def install_megatron():
    """After megatron.core's MoE modules are imported: host copies are plain copies."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
