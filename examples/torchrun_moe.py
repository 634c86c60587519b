"""One process per GPU from Python: an MoE layer's forward and backward pass with epx, one rank
per process, launched by torchrun. The epx group is bootstrapped over torch.distributed's own
allgather (no id to pass around). Each rank owns E/R experts (a two-layer MLP each); tokens go
to their top-k experts in the expert layout and come back weighted by the router. The forward
pass and the gradient of the tokens are checked against a dense computation of the same layer
(the backward pass runs through both exchanges).

    torchrun --nproc-per-node 8 examples/torchrun_moe.py             # one rank per GPU, CUDA backend
    torchrun --nproc-per-node 2 examples/torchrun_moe.py --cpu       # CPU backend, gloo (no GPU needed)

On GPUs every rank must be on this host; rank r uses GPU LOCAL_RANK.
"""

import argparse
import os

import torch
import torch.distributed as dist

import epx
import epx.torch as et

p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true", help="CPU backend and gloo, even with GPUs")
p.add_argument("--experts", type=int, default=16)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--ffn", type=int, default=128)
p.add_argument("--topk", type=int, default=4)
p.add_argument("--tokens", type=int, default=48, help="tokens per rank")
a = p.parse_args()

cuda = torch.cuda.is_available() and epx.backend_available("cuda") and not a.cpu
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if cuda else "gloo")
rank, R = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda") if cuda else torch.device("cpu")
E, H, F, K, T = a.experts, a.hidden, a.ffn, a.topk, a.tokens
L = E // R

# Every rank draws every expert's weights from one seed, then keeps its own: the dense check
# below can then compute any token's experts locally.
torch.manual_seed(0)
w1_all = torch.randn(E, H, F) / H ** 0.5
w2_all = torch.randn(E, F, H) / F ** 0.5
router = (torch.randn(H, E) * 0.1).to(dev)
w1 = w1_all[rank * L:(rank + 1) * L].to(dev).requires_grad_()
w2 = w2_all[rank * L:(rank + 1) * L].to(dev).requires_grad_()
g = torch.Generator().manual_seed(100 + rank)
x = torch.randn(T, H, generator=g).to(dev).requires_grad_()

with epx.World.from_torch_distributed(backend="cuda" if cuda else "host") as world:
    with world.comm(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T) as comm, \
            comm.handle("ht", layout="expert", align=8) as h:
        probs = torch.softmax(x @ router, dim=-1)
        weights, idx = probs.topk(K, dim=-1)
        res = et.dispatch(h, x, idx.int(), weights)  # rows grouped by local expert
        y, start = torch.zeros_like(res.recv_x), 0
        for l, n in enumerate(res.tokens_per_local_expert.tolist()):  # a grouped GEMM, by hand
            y[start:start + n] = torch.relu(res.recv_x[start:start + n] @ w1[l]) @ w2[l]
            start += (n + h.align - 1) // h.align * h.align  # each expert's block is padded to align rows
        out = et.combine(h, y, res.recv_probs)  # out[t] = sum over its experts of weight * expert(x[t])
        out.square().mean().backward()  # through both exchanges: every rank takes part
        if cuda:
            comm.synchronize()

# The same layer dense, on this process alone: a token's output depends on its own row only,
# so its value and x's gradient (through the experts and the router's weights) must agree.
xd = x.detach().cpu().requires_grad_()
wd, idd = torch.softmax(xd @ router.cpu(), dim=-1).topk(K, dim=-1)
dense = sum(wd[:, k:k + 1] * torch.stack([torch.relu(xd[t] @ w1_all[idd[t, k]]) @ w2_all[idd[t, k]] for t in range(T)])
            for k in range(K))
dense.square().mean().backward()
err = torch.tensor([(out.detach().cpu() - dense.detach()).abs().max().item(),
                    (x.grad.cpu() - xd.grad).abs().max().item() / xd.grad.abs().max().item()])
dist.all_reduce(err, op=dist.ReduceOp.MAX)
ok = bool((err < 1e-4).all()) and w1.grad is not None and bool(torch.isfinite(w1.grad).all())
if rank == 0:
    print(f"torchrun_moe: epx {epx.__version__}, {R} processes, backend {'cuda' if cuda else 'host'}: "
          f"max |epx - dense| = {err[0].item():.2e}, x.grad within {err[1].item():.2e} of dense: {'ok' if ok else 'FAILED'}")
dist.destroy_process_group()
raise SystemExit(0 if ok else 1)
