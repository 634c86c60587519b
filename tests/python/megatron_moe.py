"""One rank of a drop-in test: Megatron-core's own MoELayer, built twice with the same weights
(once with Megatron's ``alltoall`` dispatcher, once with the ``flex`` dispatcher on epx's
``deep_ep``), run forward and backward on the same inputs; the rank reports every difference
and, on CUDA, the memory each path's layers hold while they are in flight.

Run by test_megatron_dropin.py in one process per rank over gloo: on CPU tensors
(``megatron_cpu`` stands in for torch.cuda) or on CUDA tensors, every rank on GPU 0
(``megatron_gpu``)."""

import os
import sys
import traceback


def _setup(rank, world, port, device):
    if device == "cuda":
        import megatron_gpu as stand_in
    else:
        import megatron_cpu as stand_in

    stand_in.install()
    import epx.compat

    epx.compat.install()
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401  (after install: sees deep_ep)

    stand_in.install_megatron()


def _config(case, dispatcher, backend):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = case["dtype"] == "bf16"
    kw = dict(num_layers=case["layers"], hidden_size=case["hidden"], num_attention_heads=2,
              ffn_hidden_size=case["ffn"], moe_ffn_hidden_size=case["ffn"], num_moe_experts=case["experts"],
              moe_router_topk=case["topk"], tensor_model_parallel_size=case["tp"],
              expert_model_parallel_size=case["ep"], use_cpu_initialization=True,
              moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="none", add_bias_linear=False,
              params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16, moe_grouped_gemm=False,
              gradient_accumulation_fusion=False, moe_router_dtype="fp32", moe_permute_fusion=False)
    if case["tp"] > 1:  # Megatron's MoE layer requires it with tensor parallelism
        kw["sequence_parallel"] = True
    if case.get("capacity") is not None:
        kw["moe_expert_capacity_factor"] = case["capacity"]
    if dispatcher == "flex":
        kw["moe_flex_dispatcher_backend"] = backend
        kw["moe_flex_dispatcher_num_sms"] = 8
    return TransformerConfig(**kw)


def _layers(case, dispatcher, backend, like=None):
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    cfg = _config(case, dispatcher, backend)
    sub = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    layers = []
    for i in range(case["layers"]):
        # the same seed on every rank: the router (replicated) must agree across ranks
        torch.manual_seed(case["seed"] * 1000 + i)
        layer = MoELayer(cfg, submodules=sub, layer_number=i + 1)
        if case.get("device", "cpu") != "cpu":
            layer.to(case["device"])  # built on the host (use_cpu_initialization), run on the GPU
        if like is not None:
            layer.load_state_dict(like[i].state_dict())
        layers.append(layer)
    return layers


def _inputs(case, tokens, run):
    """x and the output gradient of this rank: [S, 1, H], S from the run's token counts per
    data-parallel rank (the ranks of one tensor-parallel group hold equal sequence shards)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_rank()
    S = tokens[dp % len(tokens)]
    g = torch.Generator().manual_seed(case["seed"] * 7919 + dist.get_rank() + 1000003 * run)
    dt = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    dev = case.get("device", "cpu")
    x = torch.randn(S, 1, case["hidden"], generator=g).to(dt).to(dev)
    gy = torch.randn(S, 1, case["hidden"], generator=g).to(dt).to(dev)
    return x, gy


def _allocated(device):
    """Bytes torch holds on the GPU now (None on CPU), once the frees that waited for a stream
    have been taken back (the allocator does so at its next allocation)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.empty(1, device=device)  # an allocation, freed at once: takes back the waiting frees
    return torch.cuda.memory_allocated(device)


def _run(layers, x, gy, fan=False):
    """Forward through every layer, then one backward. Chained, each layer takes the one
    before's output; fanned out (``fan``), each takes its own copy of x, so that no layer's
    routing depends on how an earlier layer rounded. Either way every layer's plan stays alive
    until the backward. Returns (output, input gradient, parameter gradients, memory): on CUDA,
    memory is (bytes held after the forward, peak bytes until the backward has finished), over
    what was allocated before the forward."""
    import torch

    xs = [x.clone().requires_grad_(True) for _ in (layers if fan else layers[:1])]
    base = _allocated(x.device)
    if base is not None:
        torch.cuda.reset_peak_memory_stats(x.device)
    outs, h = [], xs[0]
    for i, layer in enumerate(layers):
        h, _ = layer(xs[i] if fan else h)
        outs.append(h)
    held = _allocated(x.device)
    if fan:
        torch.autograd.backward(outs, [gy] * len(outs))
    else:
        h.backward(gy)
    memory = None if base is None else (held - base, torch.cuda.max_memory_allocated(x.device) - base)
    grads = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            grads[f"layer{i}.{name}"] = p.grad.detach().clone() if p.grad is not None else None
    if fan:
        return torch.stack([o.detach() for o in outs]), torch.stack([t.grad.detach() for t in xs]), grads, memory
    return h.detach(), xs[0].grad.detach(), grads, memory


def _diff(a, b):
    """(bit-identical, max |a - b|, max |a|)."""
    import torch

    if a is None or b is None:
        return (a is None and b is None), 0.0, 0.0
    exact = a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    d = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    m = float(a.float().abs().max()) if a.numel() else 0.0
    return exact, d, m


def _compare(case, ref, flex, tokens, run):
    """One forward and backward of both paths on the same inputs: what this rank reports."""
    x, gy = _inputs(case, tokens, run)
    fan = case.get("fan", False)
    for layer in ref + flex:
        layer.zero_grad(set_to_none=True)
    out_r, gx_r, g_r, mem_r = _run(ref, x, gy, fan)
    out_f, gx_f, g_f, mem_f = _run(flex, x, gy, fan)
    report = {"output": _diff(out_f, out_r), "input_grad": _diff(gx_f, gx_r)}
    from megatron.core.transformer.moe import fused_a2a

    used = fused_a2a._buffer if case["backend"] == "deepep" else fused_a2a._hybrid_ep_buffer
    if not type(used).__module__.startswith("epx.compat."):
        raise AssertionError(f"the flex dispatcher ran on {type(used)!r}, not on epx")
    mgr = flex[-1].token_dispatcher._comm_manager  # the last layer's routing, as dispatched
    routed = int((mgr.token_indices >= 0).sum()) if case["backend"] == "deepep" else int(mgr.routing_map.sum())
    missing = sorted(set(g_r) ^ set(g_f))
    for name in sorted(set(g_r) & set(g_f)):
        report[name] = _diff(g_f[name], g_r[name])
    return {"report": report, "missing": missing, "tokens": int(x.shape[0]), "routed_pairs": routed,
            "memory": None if mem_f is None else {"flex": mem_f, "alltoall": mem_r}}


def worker(rank, world, port, case, outq):
    """Reports the comparison of every run (the case's ``tokens``, then each of ``more_tokens``,
    on the same layers); the first run's also at the top level."""
    try:
        _setup(rank, world, port, case.get("device", "cpu"))
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=case["tp"], expert_model_parallel_size=case["ep"],
                                     create_gloo_process_groups=False)
        ref = _layers(case, "alltoall", None)
        flex = _layers(case, "flex", case["backend"], like=ref)
        runs = [_compare(case, ref, flex, tokens, i) for i, tokens in
                enumerate([case["tokens"]] + list(case.get("more_tokens", [])))]
        outq.put((rank, "ok", dict(runs[0], runs=runs)))
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        outq.put((rank, "error", traceback.format_exc()))
        sys.exit(1)
