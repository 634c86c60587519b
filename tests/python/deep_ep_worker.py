"""One rank of test_compat's cross-process tests of epx.compat.deep_ep (gloo, CPU tensors)."""

import os
import traceback


def budget_worker(rank, world, port, data, q):
    try:
        import numpy as np
        import torch
        import torch.distributed as dist

        from epx.compat.deep_ep import HybridEPBuffer

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        x, idx, w, E, L, align, budget = data
        T, K = idx.shape
        m = np.zeros((T, E), bool)
        p = np.zeros((T, E), np.float32)
        for t in range(T):
            for k in range(K):
                if idx[t, k] >= 0:
                    m[t, idx[t, k]], p[t, idx[t, k]] = True, w[t, k]
        buf = HybridEPBuffer(group=dist.group.WORLD, hidden_dim=x.shape[1], max_num_of_tokens_per_rank=T,
                             num_local_experts=L)
        rx, rp, _, tpe, h = buf.dispatch_with_permute(
            hidden=torch.from_numpy(x), routing_map=torch.from_numpy(m), probs=torch.from_numpy(p),
            num_of_experts_per_rank=L, pad_multiple=align, num_permuted_tokens=budget, non_blocking=True)
        # each row sends its row number + 1 back as its probability gradient
        g = torch.arange(1, rx.shape[0] + 1, dtype=torch.float32)
        out, pg = buf.combine_with_unpermute(hidden=rx, probs=g, handle=h, pad_multiple=align)
        q.put((rank, "ok", (rx.numpy(), rp.numpy(), tpe.numpy(), int(h[-1][0]), out.numpy(), pg.numpy())))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def low_latency_worker(rank, world, port, data, q):
    """DeepEP's decode calls: dispatch, stand-in experts (row times global expert id + 1, in
    bf16), combine with the router's weights."""
    try:
        import torch
        import torch.distributed as dist

        from epx.compat.deep_ep import Buffer

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        x, idx, w, E, M = data
        buf = Buffer(dist.group.WORLD, 0, 0, low_latency_mode=True)
        xt = torch.from_numpy(x).to(torch.bfloat16)
        it = torch.from_numpy(idx)
        recv, count, handle, _, hook = buf.low_latency_dispatch(xt, it, M, E, use_fp8=False)
        hook()
        L = E // world
        scale = (rank * L + torch.arange(L, dtype=torch.float32) + 1).view(L, 1, 1)
        y = (recv.float() * scale).to(torch.bfloat16)
        out, _, hook = buf.low_latency_combine(y, it, torch.from_numpy(w), handle)
        hook()
        q.put((rank, "ok", (recv.float().numpy(), count.numpy(), out.float().numpy())))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
