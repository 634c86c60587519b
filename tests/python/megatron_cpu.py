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


class _Done:
    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True


def _all_gather(orig):
    """gloo's all_gather takes equal sizes only; Megatron's sequence-parallel gather passes
    each rank's own: gather padded to the largest, then keep each rank's rows."""

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if len({tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}) <= 1:
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        n = max(t.shape[0] for t in tensor_list)
        pad = tensor.new_zeros((n,) + tuple(tensor.shape[1:]))
        pad[: tensor.shape[0]] = tensor
        bufs = [torch.empty_like(pad) for _ in tensor_list]
        orig(bufs, pad, group=group)
        for out, b in zip(tensor_list, bufs):
            out.copy_(b[: out.shape[0]])
        return _Done() if async_op else None

    return all_gather


def _reduce_scatter_list(output, input_list, op=None, group=None, async_op=False):
    """gloo has no reduce-scatter: a sum over the group, then this rank's part."""
    import torch.distributed as dist

    full = torch.cat([t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1) for t in input_list]).contiguous()
    dist.all_reduce(full, group=group)
    rank = dist.get_rank(group)
    start = sum(t.shape[0] for t in input_list[:rank])
    output.copy_(full[start: start + input_list[rank].shape[0]].reshape(output.shape))
    return _Done() if async_op else None


def _reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    import torch.distributed as dist

    n = dist.get_world_size(group)
    return _reduce_scatter_list(output, list(input.chunk(n)), group=group, async_op=async_op)


def install_megatron():
    """After megatron.core's MoE modules are imported: host copies are plain copies, and the
    collectives Megatron's tensor parallelism needs and gloo lacks (uneven all-gather,
    reduce-scatter) are made from the ones it has."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    dist.all_gather = _all_gather(dist.all_gather)
    dist.reduce_scatter = _reduce_scatter_list
    for mod in (layers, mappings):
        if hasattr(mod, "dist_reduce_scatter_func"):
            mod.dist_reduce_scatter_func = _reduce_scatter_tensor
