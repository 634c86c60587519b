"""Several nodes from Python (host backend): Config.ranks_per_node is checked and compared
like every config field, and the token-layout combine follows the node-aware order
(docs/design.md, "Nodes"), checked bit for bit against that order written out here (in float32
its additions group differently from the flat order's, with rows of mixed magnitudes the bits
differ)."""

import numpy as np
import pytest

import epx
from moe_ref import expected_token_layout, make_inputs, rng

R, E, H, K = 4, 8, 32, 3
L = E // R
TOKENS = [6, 0, 9, 4]  # rank 1 sends nothing
CFG = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=16, timeout_ms=20000)


def every_rank_raises(ei, cls):
    errs = ei.value.rank_errors
    assert sorted(errs) == list(range(R)), errs
    assert all(isinstance(e, cls) for e in errs.values())


@pytest.mark.parametrize("value", [3, -1, 5])
def test_bad_ranks_per_node(world4, value):
    with pytest.raises(epx.InvalidArgumentError) as ei:
        world4.run(lambda r: epx.Comm(world4, r, **dict(CFG, ranks_per_node=value)))
    every_rank_raises(ei, epx.InvalidArgumentError)


def test_ranks_per_node_mismatch_and_defaults(world4):
    with pytest.raises(epx.ConfigMismatchError) as ei:
        world4.run(lambda r: epx.Comm(world4, r, **dict(CFG, ranks_per_node=1 if r == 2 else 2)))
    assert "ranks_per_node" in ei.value.message

    def one_node(r):  # 0 and R both mean one node, and agree
        with world4.comm(r, **dict(CFG, ranks_per_node=0 if r % 2 else R)) as comm:
            return comm.config.ranks_per_node

    assert world4.run(one_node) == [R] * R


def node_order_combine(ys, srcs, P):
    """out[s][t] = sum over nodes ascending of the node's float32 sum of its ranks' rows in rank
    order (float32 throughout: rounding a float32 partial to float32 changes nothing)."""
    where = [{st: n for n, st in enumerate(srcs[d])} for d in range(R)]
    outs = []
    for s, T in enumerate(TOKENS):
        out = np.zeros((T, H), np.float32)
        for t in range(T):
            for node in range(R // P):
                rows = [ys[d][where[d][(s, t)]] for d in range(node * P, (node + 1) * P) if (s, t) in where[d]]
                if rows:
                    sub = np.zeros(H, np.float32)
                    for v in rows:
                        sub = (sub + v).astype(np.float32)
                    out[t] = (out[t] + sub).astype(np.float32)
        outs.append(out)
    return outs


@pytest.mark.parametrize("P", [1, 2, 4])
def test_token_combine_in_node_order(world4, P):
    xs, idxs, ws = make_inputs(7, R, E, H, K, TOKENS, none_frac=0.0)
    g = rng(8)
    srcs = [expected_token_layout(xs, idxs, ws, R, L, d)[4] for d in range(R)]
    # rows of very different magnitudes, so that the order of the additions shows
    ys = [(g.standard_normal((len(srcs[d]), H)) * 10.0 ** g.integers(-3, 4, (len(srcs[d]), 1))).astype(np.float32)
          for d in range(R)]

    def rank(r):
        with world4.comm(r, **dict(CFG, ranks_per_node=P)) as comm, comm.handle("ht", "token") as h:
            h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
            return h.combine(ys[r])

    got = world4.run(rank)
    want = node_order_combine(ys, srcs, P)
    for r in range(R):
        np.testing.assert_array_equal(got[r], want[r])


def test_node_traffic(world4):
    """2 nodes of 2: rank r receives, as rail peer, the tokens of the rank with its local index
    on the other node that go to its node; its own tokens bring back one row per other node
    they went to; one crossing per rank counts a row per (token, remote rank)."""
    P = 2
    xs, idxs, ws = make_inputs(9, R, E, H, K, TOKENS)

    def ranks_of(s, t):
        return {int(e) // L for e in idxs[s][t] if e >= 0}

    def rank(r):
        with world4.comm(r, **dict(CFG, ranks_per_node=P)) as comm, comm.handle("ht", "token") as h:
            res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
            h.combine(np.zeros_like(res.recv_x))
            return h.node_traffic()

    got = world4.run(rank)
    row = H * 4
    for r in range(R):
        node, other = r // P, 1 - r // P
        rail = other * P + r % P
        forwarded = sum(any(d // P == node for d in ranks_of(rail, t)) for t in range(TOKENS[rail]))
        arrived = sum(r in ranks_of(s, t) for s in range(R) if s // P != node for t in range(TOKENS[s]))
        back_nodes = sum(any(d // P != node for d in ranks_of(r, t)) for t in range(TOKENS[r]))
        back_ranks = sum(sum(d // P != node for d in ranks_of(r, t)) for t in range(TOKENS[r]))
        assert got[r] == epx.NodeTraffic(forwarded * row, back_nodes * row, arrived * row, back_ranks * row), r
