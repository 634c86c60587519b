"""One rank of a drop-in test: Megatron-core's own MoELayer, built twice with the same weights
(once with Megatron's ``alltoall`` dispatcher, once with the ``flex`` dispatcher on epx's
``deep_ep``), run forward and backward on the same inputs; the rank reports every difference.

Run by test_megatron_dropin.py in one process per rank (gloo, CPU tensors)."""

import os
import sys
import traceback


def _setup(rank, world, port):
    import megatron_cpu

    megatron_cpu.install()
    import epx.compat

    epx.compat.install()
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401  (after install: sees deep_ep)

    megatron_cpu.install_megatron()


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
        if like is not None:
            layer.load_state_dict(like[i].state_dict())
        layers.append(layer)
    return layers


def _inputs(case):
    """x and the output gradient of this rank: [S, 1, H], S from the case's token counts per
    data-parallel rank (the ranks of one tensor-parallel group hold equal sequence shards)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_rank()
    S = case["tokens"][dp % len(case["tokens"])]
    g = torch.Generator().manual_seed(case["seed"] * 7919 + dist.get_rank())
    dt = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    x = torch.randn(S, 1, case["hidden"], generator=g).to(dt)
    gy = torch.randn(S, 1, case["hidden"], generator=g).to(dt)
    return x, gy


def _run(layers, x, gy):
    x = x.clone().requires_grad_(True)
    h = x
    for layer in layers:  # every layer's plan stays alive until the backward below
        h, _ = layer(h)
    h.backward(gy)
    grads = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            grads[f"layer{i}.{name}"] = p.grad.detach().clone() if p.grad is not None else None
    return h.detach(), x.grad.detach(), grads


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


def worker(rank, world, port, case, outq):
    try:
        _setup(rank, world, port)
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=case["tp"], expert_model_parallel_size=case["ep"],
                                     create_gloo_process_groups=False)
        ref = _layers(case, "alltoall", None)
        flex = _layers(case, "flex", case["backend"], like=ref)
        x, gy = _inputs(case)
        out_r, gx_r, g_r = _run(ref, x, gy)
        out_f, gx_f, g_f = _run(flex, x, gy)
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
        outq.put((rank, "ok", {"report": report, "missing": missing, "tokens": int(x.shape[0]), "routed_pairs": routed}))
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        outq.put((rank, "error", traceback.format_exc()))
        sys.exit(1)
