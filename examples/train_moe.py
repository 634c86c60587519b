"""Train a small MoE layer for a few steps on an emulated expert-parallel group: one process,
one thread per rank, epx's CPU backend. Each rank owns E/R experts (a two-layer MLP each) and
a replica of the router; tokens go to their top-k experts through epx's Megatron-style flex
dispatcher and come back weighted. Without torch, runs one forward pass with numpy instead
and checks it against a dense computation.

    python examples/train_moe.py [--ranks 4] [--steps 30]
"""

import argparse
import threading

import numpy as np

import epx

p = argparse.ArgumentParser()
p.add_argument("--ranks", type=int, default=4)
p.add_argument("--experts", type=int, default=8)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--ffn", type=int, default=64)
p.add_argument("--topk", type=int, default=2)
p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
p.add_argument("--steps", type=int, default=30)
a = p.parse_args()
R, E, H, F, K, T = a.ranks, a.experts, a.hidden, a.ffn, a.topk, a.tokens
L = E // R
cfg = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T)

try:
    import torch
except ImportError:
    torch = None


def train_torch():
    import epx.torch as et

    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh(), torch.nn.Linear(H, H))
    router0 = torch.randn(H, E) * 0.1  # replicated router: same start on every rank
    grads, losses = [None] * R, [0.0] * R
    barrier = threading.Barrier(R)

    def rank(r):
        g = torch.Generator().manual_seed(100 + r)
        router = router0.clone().requires_grad_()
        w1 = (torch.randn(L, H, F, generator=g) / H ** 0.5).requires_grad_()  # this rank's experts
        w2 = (torch.randn(L, F, H, generator=g) / F ** 0.5).requires_grad_()
        opt = torch.optim.Adam([router, w1, w2], lr=1e-2)
        with world.comm(r, **cfg) as comm:
            disp = et.FlexTokenDispatcher(comm, align=8)  # Megatron style: experts apply the probs
            for step in range(a.steps):
                x = torch.randn(T, H, generator=g)
                with torch.no_grad():
                    target = teacher(x)
                probs = torch.softmax(x @ router, dim=-1)
                top = probs.topk(K, dim=-1).indices
                routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
                xs, tokens_per_expert, p_rows = disp.dispatch(x, routing_map, probs * routing_map)
                outs = []
                for l, blk in enumerate(xs.split(tokens_per_expert.tolist())):  # a grouped GEMM, by hand
                    outs.append(torch.relu(blk @ w1[l]) @ w2[l])
                y = torch.cat(outs) * p_rows[:, None]
                out = disp.combine(y)
                loss = torch.nn.functional.mse_loss(out + x, target)
                opt.zero_grad()
                loss.backward()  # both exchanges run backwards through epx: every rank takes part
                grads[r], losses[r] = router.grad, loss.item()
                barrier.wait()  # the router is data-parallel: average its gradient over the ranks
                router.grad = sum(grads) / R
                barrier.wait()
                opt.step()
                if r == 0 and (step % 5 == 0 or step == a.steps - 1):
                    print(f"step {step:3d}  loss {sum(losses) / R:.4f}")
            disp.close()

    world.run(rank)


def forward_numpy():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(R)]
    router = (rng.standard_normal((H, E)) * 0.1).astype(np.float32)
    w = rng.standard_normal((E, H, H)).astype(np.float32) / np.float32(H ** 0.5)

    def route(x):
        logits = x @ router
        idx = np.argsort(-logits, axis=1)[:, :K]
        pr = np.exp(logits - logits.max(1, keepdims=True))
        pr /= pr.sum(1, keepdims=True)
        return idx, np.take_along_axis(pr, idx, 1).astype(np.float32)

    def rank(r):
        idx, wt = route(xs[r])
        with world.comm(r, **cfg) as comm, comm.handle("ht", "expert") as h:
            res = h.dispatch(xs[r], topk_idx=idx, topk_weights=wt)
            y, start = np.zeros_like(res.recv_x), 0
            for l, c in enumerate(res.tokens_per_local_expert):
                y[start:start + c] = res.recv_x[start:start + c] @ w[r * L + l]
                start += c
            return h.combine(y)  # weighted by the router probabilities

    outs = world.run(rank)
    err = 0.0
    for r in range(R):
        idx, wt = route(xs[r])
        dense = sum(wt[:, k:k + 1] * np.einsum("th,thg->tg", xs[r], w[idx[:, k]]) for k in range(K))
        err = max(err, float(np.abs(outs[r] - dense).max()))
    print(f"numpy forward on {R} ranks: max |epx - dense| = {err:.2e}")
    assert err < 1e-4


with epx.World(R, backend="host") as world:
    print(f"epx {epx.__version__}: {R} ranks ({world.backend}), {E} experts, top-{K}, hidden {H}")
    if torch is not None:
        train_torch()
    else:
        print("torch is not installed: numpy forward pass only")
        forward_numpy()
