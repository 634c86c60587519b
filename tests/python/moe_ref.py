"""An independent numpy statement of what epx must do: inputs, a dense MoE reference, and the
expected contents of dispatch's outputs. Nothing here calls epx.

Every random input is drawn from ``rng(stream)``: a generator for one numbered stream of the
run's base seed, fresh per run (``EPX_TEST_SEED`` replays one; conftest prints it). Child
processes inherit the base seed through the environment."""

import os
import secrets

import numpy as np

if not os.environ.get("EPX_TEST_SEED"):
    os.environ["EPX_TEST_SEED"] = str(secrets.randbits(32))
BASE_SEED = int(os.environ["EPX_TEST_SEED"])


def rng(stream):
    """The generator of one numbered stream of this run's inputs."""
    return np.random.default_rng([BASE_SEED, stream])


def make_inputs(seed, R, E, H, K, tokens, none_frac=0.15):
    """Per rank: x [T, H] float32 in [-2, 2), topk_idx [T, K] int64 (distinct experts, some
    slots -1), topk_weights [T, K] float32 in (0, 1) (also on -1 slots: epx must ignore them)."""
    g = rng(seed)
    xs, idxs, ws = [], [], []
    for r in range(R):
        T = tokens[r]
        x = g.uniform(-2, 2, (T, H)).astype(np.float32)
        idx = np.full((T, K), -1, np.int64)
        for t in range(T):
            chosen = g.choice(E, K, replace=False)
            keep = g.random(K) >= none_frac
            if not keep.any():
                keep[g.integers(K)] = True
            idx[t] = np.where(keep, chosen, -1)
        w = g.uniform(0.05, 1.0, (T, K)).astype(np.float32)
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


def to_map(idx, w, E):
    """topk -> multi-hot map [T, E] bool and probs [T, E] float32."""
    T, K = idx.shape
    m = np.zeros((T, E), bool)
    p = np.zeros((T, E), np.float32)
    for t in range(T):
        for k in range(K):
            e = idx[t, k]
            if e >= 0:
                m[t, e] = True
                p[t, e] = w[t, k]
    return m, p


def canonical_topk(m, p, K):
    """The topk form epx derives from a map: ascending expert ids, padded with -1 / 0."""
    T, E = m.shape
    idx = np.full((T, K), -1, np.int64)
    w = np.zeros((T, K), np.float32)
    for t in range(T):
        es = np.nonzero(m[t])[0]
        idx[t, :len(es)] = es
        w[t, :len(es)] = p[t, es]
    return idx, w


class Experts:
    """Global expert e: f_e(x) = x * scale[e] + shift[e] (elementwise, float32)."""

    def __init__(self, seed, E, H):
        g = rng(seed + 1000)
        self.scale = g.uniform(0.5, 1.5, (E, H)).astype(np.float32)
        self.shift = g.uniform(-0.5, 0.5, (E, H)).astype(np.float32)

    def __call__(self, e, x):
        return (x * self.scale[e] + self.shift[e]).astype(np.float32)


def dense_moe(xs, idxs, ws, experts):
    """out[t] = sum over routed slots k of w[t, k] * f_{e}(x[t]), in float64."""
    outs = []
    for x, idx, w in zip(xs, idxs, ws):
        out = np.zeros(x.shape, np.float64)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                e = idx[t, k]
                if e >= 0:
                    out[t] += np.float64(w[t, k]) * experts(e, x[t]).astype(np.float64)
        outs.append(out)
    return outs


def expected_token_layout(xs, idxs, ws, R, L, d):
    """Rank d's token-layout receive: rows by (source rank, source token); local ids and
    weights for the slots on d, -1 / 0 elsewhere; pair counts per local expert.
    Also returns, per row, its (source rank, source token)."""
    rows, ridx, rw, src = [], [], [], []
    counts = np.zeros(L, np.int32)
    for s in range(R):
        for t in range(xs[s].shape[0]):
            here = [(idxs[s][t, k] >= 0 and idxs[s][t, k] // L == d) for k in range(idxs[s].shape[1])]
            if not any(here):
                continue
            rows.append(xs[s][t])
            ridx.append([idxs[s][t, k] % L if h else -1 for k, h in enumerate(here)])
            rw.append([ws[s][t, k] if h else 0.0 for k, h in enumerate(here)])
            src.append((s, t))
            for k, h in enumerate(here):
                if h:
                    counts[idxs[s][t, k] % L] += 1
    K = idxs[0].shape[1]
    H = xs[0].shape[1]
    return (np.array(rows, np.float32).reshape(-1, H), np.array(ridx, np.int32).reshape(-1, K),
            np.array(rw, np.float32).reshape(-1, K), counts, src)


def expected_expert_layout(xs, idxs, ws, R, L, d, align=1, ll_block=None):
    """Rank d's expert-layout receive: per local expert l, the pairs (s, t) that chose expert
    d*L+l in (source rank, source token) order; blocks padded to `align` (zero rows, prob 0), or
    for low-latency fixed blocks of `ll_block` rows starting at l * ll_block.
    Returns (rows [n, H], probs [n], counts [L], row_keys: list of (row, s, t, k, l))."""
    H = xs[0].shape[1]
    blocks, keys = [], []
    counts = np.zeros(L, np.int32)
    start = 0
    for l in range(L):
        e = d * L + l
        pairs = []
        for s in range(R):
            for t in range(xs[s].shape[0]):
                for k in range(idxs[s].shape[1]):
                    if idxs[s][t, k] == e:
                        pairs.append((s, t, k))
        counts[l] = len(pairs)
        size = ll_block if ll_block is not None else (len(pairs) + align - 1) // align * align
        blk_x = np.zeros((size, H), np.float32)
        blk_p = np.zeros(size, np.float32)
        for i, (s, t, k) in enumerate(pairs):
            blk_x[i] = xs[s][t]
            blk_p[i] = ws[s][t, k]
            keys.append((start + i, s, t, k, l))
        blocks.append((blk_x, blk_p))
        start += size
    rows = np.concatenate([b[0] for b in blocks]) if blocks else np.zeros((0, H), np.float32)
    probs = np.concatenate([b[1] for b in blocks]) if blocks else np.zeros(0, np.float32)
    return rows, probs, counts, keys


def f32_round_bf16(a):
    """float32 -> nearest-even bf16, returned as float32 (independent of epx's helpers)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)
