"""Plain numpy reference of the whole EP group (docs/design.md §1), for the Python tests.

``reference(problem, ranks, bf16=False)`` evaluates the layer in float64; with ``bf16=True`` it rounds
to bf16 at the points that docs/design.md §1 (forward) and docs/design.md (backward) fix, with float64
between them. The first is the truth, the second measures how far an honest bf16 implementation lands
from it: docs/design.md §6 passes a result when ``max|got - ref64| <= 2 * max|ref_bf16 - ref64| + atol``.

Inputs per rank (``RankData``): x [T,H], topk_idx [T,k], topk_weights [T,k], d_out [T,H], the rank's
routed weights w_gate/w_up [El,I,H], w_down [El,H,I] and the shared weights (replicas; rank 0's are
used, as the CPU backend does). Values are float64 arrays holding bf16-representable numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def round_bf16(values):
    """float64/float32 -> nearest bf16 value (ties to even) as float64."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


@dataclass
class Problem:
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    shared_intermediate: int = 0
    num_ranks: int = 1
    activation: str = "swiglu"  # or "gpt_oss"
    clamp_limit: float | None = None
    alpha: float = 1.702

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


@dataclass
class RankData:
    x: np.ndarray
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    d_out: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    ws_gate: np.ndarray | None = None
    ws_up: np.ndarray | None = None
    ws_down: np.ndarray | None = None


@dataclass
class RankResult:
    out: np.ndarray
    d_x: np.ndarray
    d_topk_weights: np.ndarray
    d_w_gate: np.ndarray
    d_w_up: np.ndarray
    d_w_down: np.ndarray
    d_ws: list = field(default_factory=list)  # [d_gate, d_up, d_down] or []


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def activation(p: Problem, g, u):
    """a = act(g, u) and (da/dg, da/du), the clamp blocking where it is strictly active."""
    pass_g = np.ones_like(g)
    pass_u = np.ones_like(u)
    if p.clamp_limit is not None:
        L = p.clamp_limit
        pass_g = (g <= L).astype(np.float64)
        pass_u = (np.abs(u) <= L).astype(np.float64)
        g = np.minimum(g, L)
        u = np.clip(u, -L, L)
    if p.activation == "swiglu":
        s = _sigmoid(g)
        silu = g * s
        return silu * u, u * s * (1 + g * (1 - s)) * pass_g, silu * pass_u
    s = _sigmoid(p.alpha * g)
    glu = g * s
    return (u + 1) * glu, (u + 1) * (s + p.alpha * g * s * (1 - s)) * pass_g, glu * pass_u


def _mlp(p: Problem, x, gate, up, down, rnd):
    g = rnd(x @ gate.T)
    u = rnd(x @ up.T)
    a_raw, dg, du = activation(p, g, u)
    a = rnd(a_raw)
    return rnd(a @ down.T), (g, u, a, dg, du)


def _mlp_backward(rnd, x, gate, up, down, saved, dy):
    g, u, a, dg, du = saved
    d_a = rnd(dy @ down)
    d_g = rnd(d_a * dg)
    d_u = rnd(d_a * du)
    d_x = rnd(d_g @ gate + d_u @ up)
    return d_x, d_g.T @ x, d_u.T @ x, dy.T @ a


def reference(p: Problem, ranks: list[RankData], bf16: bool = False) -> list[RankResult]:
    rnd = round_bf16 if bf16 else (lambda v: v)
    El, R = p.num_local_experts, p.num_ranks
    results = []
    d_w = [[np.zeros_like(r.w_gate), np.zeros_like(r.w_up), np.zeros_like(r.w_down)] for r in ranks]
    shared = ranks[0]
    for data in ranks:
        T = data.x.shape[0]
        H = p.hidden
        ys = np.zeros((T, H))
        d_xs = np.zeros((T, H))
        d_ws = []
        if p.shared_intermediate > 0:
            ys, saved = _mlp(p, data.x, shared.ws_gate, shared.ws_up, shared.ws_down, rnd)
            d_xs, dg, du, dd = _mlp_backward(rnd, data.x, shared.ws_gate, shared.ws_up, shared.ws_down, saved,
                                             data.d_out)
            d_ws = [dg, du, dd]
        out = ys.copy()
        d_x = d_xs.copy()
        d_topk_weights = np.zeros((T, p.num_topk))
        for j in range(p.num_topk):  # ascending slots, as the fp32 sums of §1
            for t in range(T):
                e = int(data.topk_idx[t, j])
                if e < 0:
                    continue
                owner, local = divmod(e, El)
                w = ranks[owner]
                xt = data.x[t:t + 1]
                y, saved = _mlp(p, xt, w.w_gate[local], w.w_up[local], w.w_down[local], rnd)
                out[t] += data.topk_weights[t, j] * y[0]
                d_topk_weights[t, j] = float(data.d_out[t] @ y[0])
                dy = rnd(data.topk_weights[t, j] * data.d_out[t:t + 1])
                dxp, dg, du, dd = _mlp_backward(rnd, xt, w.w_gate[local], w.w_up[local], w.w_down[local], saved, dy)
                d_x[t] += dxp[0]
                d_w[owner][0][local] += dg
                d_w[owner][1][local] += du
                d_w[owner][2][local] += dd
        results.append(RankResult(rnd(out), rnd(d_x), d_topk_weights, None, None, None, d_ws))
    for r in range(R):
        results[r].d_w_gate, results[r].d_w_up, results[r].d_w_down = d_w[r]
    return results


def check_close(name: str, got, ref64, ref_bf16, rel_atol: float = 1e-3):
    """docs/design.md §6: max|got - ref64| <= 2 * max|ref_bf16 - ref64| + atol (atol relative to the tensor's
    scale). Raises AssertionError naming the tensor, the worst coordinate and the values."""
    got = np.asarray(got, dtype=np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    assert got.shape == ref64.shape, f"{name}: shape {got.shape} != reference {ref64.shape}"
    if got.size == 0:
        return
    assert np.all(np.isfinite(got)), f"{name}: non-finite value at {np.argwhere(~np.isfinite(got))[0]}"
    err = np.abs(got - ref64)
    noise = np.max(np.abs(np.asarray(ref_bf16, dtype=np.float64) - ref64))
    atol = rel_atol * max(np.max(np.abs(ref64)), 1e-30)
    bound = 2 * noise + atol
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] <= bound, (
        f"{name}: max|got - ref64| = {err[worst]:.3g} at {tuple(int(i) for i in worst)} (got {got[worst]!r}, "
        f"ref64 {ref64[worst]!r}) exceeds 2 * bf16 noise {noise:.3g} + atol {atol:.3g}"
    )


def make_ranks(p: Problem, tokens: list[int], seed: int = 0, unused_slots: bool = True,
               one_expert: int | None = None) -> list[RankData]:
    """Random bf16-representable inputs per rank; every token picks distinct experts, some slots are -1
    (when ``unused_slots``); ``one_expert`` sends every pair to that expert instead."""
    rng = np.random.default_rng(seed)
    shared_rng = np.random.default_rng(seed + 1000)  # replicas: the same on every rank
    El, H, I, Is, k = p.num_local_experts, p.hidden, p.intermediate, p.shared_intermediate, p.num_topk

    def normal(gen, shape, scale):
        return round_bf16(gen.standard_normal(shape) * scale)

    shared = None
    if Is > 0:
        shared = (normal(shared_rng, (Is, H), H**-0.5), normal(shared_rng, (Is, H), H**-0.5),
                  normal(shared_rng, (H, Is), Is**-0.5))
    ranks = []
    for T in tokens:
        idx = np.stack([rng.permutation(p.num_experts)[:k] for _ in range(T)]) if T else np.zeros((0, k))
        idx = idx.astype(np.int64)
        if one_expert is not None:
            idx[:] = -1
            idx[:, 0] = one_expert
        elif unused_slots and T:
            idx[rng.random((T, k)) < 0.15] = -1
        ranks.append(RankData(
            x=normal(rng, (T, H), 1.0),
            topk_idx=idx,
            topk_weights=(0.1 + np.abs(rng.standard_normal((T, k)))).astype(np.float32).astype(np.float64),
            d_out=normal(rng, (T, H), 1.0),
            w_gate=normal(rng, (El, I, H), H**-0.5),
            w_up=normal(rng, (El, I, H), H**-0.5),
            w_down=normal(rng, (El, H, I), I**-0.5),
            ws_gate=shared[0] if shared else None,
            ws_up=shared[1] if shared else None,
            ws_down=shared[2] if shared else None,
        ))
    return ranks
