"""Runs Megatron-core's MoE code on CUDA tensors with gloo process groups, for the drop-in
tests on one GPU.

Every rank's process uses the first visible GPU, so NCCL (which refuses two ranks on one GPU)
cannot carry the collectives that Megatron's ``alltoall`` reference dispatcher makes; gloo
carries them instead. Which of gloo's collectives take CUDA tensors depends on the torch
build, so the ones the reference reaches (the all-to-all of tokens, the all-gather of counts,
an all-reduce) go through host copies here: the same values on the same ranks, only moved
through host memory. epx does not use them: its own exchange runs on the GPU (CUDA IPC)."""

import torch

from megatron_cpu import _Done


def install():
    """Call once per process, before anything touches CUDA: every rank on GPU 0. bf16 GEMMs
    keep their float32 partial sums (no reduced-precision split-K reduction), so the two
    paths' experts differ by at most the one rounding of each output the tolerance allows."""
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def _staged_all_to_all(orig):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if not (output.is_cuda or input.is_cuda):
            return orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        host = torch.empty(output.shape, dtype=output.dtype)
        orig(host, input.detach().contiguous().cpu(), output_split_sizes, input_split_sizes, group=group)
        output.copy_(host)
        return _Done() if async_op else None

    return all_to_all_single


def _staged_all_gather(orig):
    def all_gather_into_tensor(output, input, group=None, async_op=False):
        if not (output.is_cuda or input.is_cuda):
            return orig(output, input, group=group, async_op=async_op)
        host = torch.empty(output.shape, dtype=output.dtype)
        orig(host, input.detach().contiguous().cpu(), group=group)
        output.copy_(host)
        return _Done() if async_op else None

    return all_gather_into_tensor


def _staged_all_reduce(orig):
    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if not tensor.is_cuda:
            return orig(tensor, op=op, group=group, async_op=async_op)
        host = tensor.detach().cpu().contiguous()
        orig(host, op=op, group=group)
        tensor.copy_(host)
        return _Done() if async_op else None

    return all_reduce


def install_megatron():
    """After megatron.core's MoE modules are imported (Megatron's tensor-parallel mappings keep
    their own name for the all-gather)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers, mappings

    gather = _staged_all_gather(dist.all_gather_into_tensor)
    dist.all_to_all_single = _staged_all_to_all(dist.all_to_all_single)
    dist.all_gather_into_tensor = gather
    dist.all_reduce = _staged_all_reduce(dist.all_reduce)
    for mod in (layers, mappings):
        if hasattr(mod, "dist_all_gather_func"):
            mod.dist_all_gather_func = gather
