#!/usr/bin/env python3
"""CPU tests of the peers (peers.py) and of torch_moe.py's custom specs: which peer runs which
configuration, and, where torch (and transformers) import, that each peer's layer on the baseline's weights
and inputs gives the baseline's output and gradients (the GPU run checks the same before timing).

  python3 bench/baselines/test_peers.py          # unittest; torch-less machines run the pure tests only
"""
from __future__ import annotations

import importlib.util
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_TRANSFORMERS = HAVE_TORCH and importlib.util.find_spec("transformers") is not None

QWEN3 = dict(hidden=2048, intermediate=768, experts=128, topk=8, shared_intermediate=0, activation="swiglu",
             limit=None)
DEEPSEEK = dict(QWEN3, hidden=7168, intermediate=2048, experts=256, shared_intermediate=2048)
GPTOSS = dict(hidden=2880, intermediate=2880, experts=128, topk=4, shared_intermediate=0, activation="gptoss",
              limit=7.0)


class PureTests(unittest.TestCase):
    def test_parse_peers(self):
        self.assertEqual(peers.parse_peers("floor,liger,floor"), ["liger", "floor"])
        self.assertEqual(peers.parse_peers("all"), ["liger", "transformers", "floor"])
        self.assertEqual(peers.parse_peers(""), [])
        with self.assertRaisesRegex(ValueError, "unknown peer 'megablocks'"):
            peers.parse_peers("liger,megablocks")

    def test_who_runs_what(self):
        for peer in peers.PEERS:
            self.assertIsNone(peers.unsupported_reason(peer, QWEN3, 1), peer)
        self.assertIsNone(peers.unsupported_reason("floor", DEEPSEEK, 8))
        self.assertIsNone(peers.unsupported_reason("floor", GPTOSS, 2))
        self.assertIn("EP2", peers.unsupported_reason("liger", QWEN3, 2))
        self.assertIn("EP4", peers.unsupported_reason("transformers", QWEN3, 4))
        self.assertIn("custom:7168:2048:256:8", peers.unsupported_reason("liger", DEEPSEEK, 1))
        self.assertIn("shared expert", peers.unsupported_reason("transformers", DEEPSEEK, 1))
        self.assertIn("SwiGLU only", peers.unsupported_reason("liger", GPTOSS, 1))
        self.assertIsNone(peers.unsupported_reason("transformers", GPTOSS, 1))
        self.assertIn("clamp", peers.unsupported_reason("liger", dict(QWEN3, limit=7.0), 1))
        self.assertIn("clamp", peers.unsupported_reason("transformers", dict(QWEN3, limit=7.0), 1))
        self.assertIn("not at 5.0", peers.unsupported_reason("transformers", dict(GPTOSS, limit=5.0), 1))


@unittest.skipUnless(HAVE_TORCH, "torch does not import here")
class LayerTests(unittest.TestCase):
    """Small shapes on CPU: a peer's output and gradients against the baseline's (baseline_forward)."""

    H, I, E, k, T = 64, 32, 8, 2, 24

    def setUp(self):
        import torch

        import torch_moe

        self.torch, self.tm = torch, torch_moe
        gen = torch.Generator().manual_seed(3)
        bf = torch.bfloat16

        def param(*shape, fan_in):
            return (torch.randn(*shape, generator=gen) * fan_in ** -0.5).to(bf).requires_grad_()

        H, I, E, k, T = self.H, self.I, self.E, self.k, self.T
        self.w = dict(gate=param(E, I, H, fan_in=H), up=param(E, I, H, fan_in=H), down=param(E, H, I, fan_in=I))
        self.sets = []
        for s in range(2):
            x, idx, wt, dout = torch_moe._make_inputs(T, H, E, k, 11 + s, torch.device("cpu"))
            self.sets.append((x.requires_grad_(), idx, wt.requires_grad_(), dout))

    def baseline(self, s, cfg, shared=()):
        x, idx, wt, _ = self.sets[s]
        return self.tm.baseline_forward(x, idx, wt, self.w["gate"], self.w["up"], self.w["down"], *shared,
                                        activation=cfg["activation"], limit=cfg["limit"])

    def grads(self, tensors):
        out = [t.grad.detach().float().clone() for t in tensors]
        for t in tensors:
            t.grad = None
        return out

    def test_custom_spec_is_swiglu_without_clamp(self):
        cfg = self.tm.custom_spec_config("custom:7168:2048:384:8")
        self.assertEqual((cfg["hidden"], cfg["intermediate"], cfg["experts"], cfg["topk"]), (7168, 2048, 384, 8))
        self.assertEqual((cfg["shared_intermediate"], cfg["activation"], cfg["limit"]), (0, "swiglu", None))
        self.assertEqual(self.tm.custom_spec_config("custom:256:128:8:2:64")["shared_intermediate"], 64)
        with self.assertRaises(SystemExit):
            self.tm.custom_spec_config("custom:256:128:8")

    @unittest.skipUnless(HAVE_TRANSFORMERS, "transformers does not import here")
    def test_transformers_matches_the_baseline(self):
        for activation, limit in (("swiglu", None), ("gptoss", 7.0)):
            cfg = dict(hidden=self.H, intermediate=self.I, experts=self.E, topk=self.k, shared_intermediate=0,
                       activation=activation, limit=limit)
            run, leaves, notes = peers.build_transformers(self.w, self.sets, cfg)
            x, _, wt, dout = self.sets[1]
            ref = self.baseline(1, cfg)
            ref.backward(dout)
            ref_grads = self.grads([x, wt, self.w["gate"], self.w["up"], self.w["down"]])
            out = run(1)
            self.assertLess(self.tm._rel_err(out, ref), 2e-2, activation)
            out.backward(dout)
            # the peer's own leaves: its gate_up/down copies and its bf16 routing weights
            d_x = x.grad.float()
            self.assertLess(self.tm._rel_err(d_x, ref_grads[0]), 2e-2, f"{activation} d_x")
            weights_leaf = leaves[len(leaves) - len(self.sets) + 1]
            self.assertLess(self.tm._rel_err(weights_leaf.grad, ref_grads[1]), 2e-2, f"{activation} d_topk_w")
            gate_up, down = leaves[0], leaves[1]
            if activation == "swiglu":
                d_gate, d_up = gate_up.grad[:, :self.I], gate_up.grad[:, self.I:]
                d_down = down.grad
            else:  # [E,H,2I] interleaved, [E,I,H]
                d_gate, d_up = gate_up.grad[..., 0::2].transpose(1, 2), gate_up.grad[..., 1::2].transpose(1, 2)
                d_down = down.grad.transpose(1, 2)
            for name, mine, ref_g in (("d_gate", d_gate, ref_grads[2]), ("d_up", d_up, ref_grads[3]),
                                      ("d_down", d_down, ref_grads[4])):
                self.assertLess(self.tm._rel_err(mine, ref_g), 2e-2, f"{activation} {name}")
            x.grad = None
            self.assertTrue(any("has_bias=False" in n for n in notes) == (activation == "gptoss"))

    def test_floor_groups_the_rows_of_the_baseline(self):
        torch = self.torch
        Is = 16
        gen = torch.Generator().manual_seed(5)
        shared = [(torch.randn(*s, generator=gen) * 0.1).to(torch.bfloat16).requires_grad_()
                  for s in ((Is, self.H), (Is, self.H), (self.H, Is))]
        cfg = dict(hidden=self.H, intermediate=self.I, experts=self.E, topk=self.k, shared_intermediate=Is,
                   activation="swiglu", limit=None)
        run, grads_of, leaves, notes = peers.build_floor(self.w, self.sets, cfg, None, 1, shared)
        x, idx, wt, dout = self.sets[0]
        y, y_shared = run(0)
        self.assertEqual(tuple(y.shape), (self.T * self.k, self.H))
        # Combining the floor's rows as the layer does gives the baseline's output: the same GEMMs, grouped.
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        pairs = torch.empty_like(y).index_copy(0, order, y.detach())
        combined = (wt.detach().unsqueeze(-1) * pairs.view(self.T, self.k, self.H).float()).sum(1)
        combined = combined + y_shared.detach().float()
        self.assertLess(self.tm._rel_err(combined, self.baseline(0, cfg, shared)), 2e-2)
        # Its backward takes d_out's rows in the same grouping and reaches every weight.
        torch.autograd.backward((y, y_shared), grads_of(0))
        for t in list(self.w.values()) + shared:
            self.assertIsNotNone(t.grad)
            t.grad = None
        self.assertEqual(len(leaves), 2 * len(self.sets))
        self.assertTrue(any("shared expert" in n for n in notes))


@unittest.skipUnless(HAVE_TORCH, "torch does not import here")
class SweepTests(unittest.TestCase):
    """bench_config with peers on a one-rank gloo group, the CUDA-event timing replaced by a stand-in: every
    peer gets a record per pass, measured or saying why not, with its version and timed window."""

    def test_every_peer_gets_a_record_per_pass(self):
        import argparse

        import torch
        import torch.distributed as dist

        import torch_moe

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=0, world_size=1)
        calls = []

        def fake_time(prep, run, nsets, warmup, iters, group, device):
            for i in range(warmup + iters):
                prep(i % nsets)
                run(i % nsets)
            calls.append(iters)
            return [1.0 + 0.1 * i for i in range(iters)], (100.0, 101.0)

        saved = torch_moe._time_iterations
        torch_moe._time_iterations = fake_time
        try:
            args = argparse.Namespace(seed=1, sets=3, warmup=1, iters=3, fused_gate_up=False)
            records = []
            for name, cfg in (("custom:64:32:8:2", torch_moe.custom_spec_config("custom:64:32:8:2")),
                              ("custom:64:32:8:2:16", torch_moe.custom_spec_config("custom:64:32:8:2:16"))):
                records += torch_moe.bench_config(name, cfg, 16, ["forward", "forward_backward"], args, 0, 1,
                                                  dist.group.WORLD, torch.device("cpu"), dict(gpu="cpu"),
                                                  peers.PEERS)
        finally:
            torch_moe._time_iterations = saved
        by = {(r["preset"], r["impl"], r["pass"]): r for r in records}
        self.assertEqual(len(by), len(records), "one record per preset, impl and pass")
        self.assertEqual(len(records), 2 * 4 * 2)
        for key, r in by.items():
            self.assertIn("peer", r, key)
            if isinstance(r["median_ms"], (int, float)):
                self.assertEqual(r["median_ms"], 1.1, key)
                self.assertEqual(r["timed_window_unix_s"], [100.0, 101.0], key)
                self.assertIn("peer_version", r, key)
                self.assertGreater(r["flops_per_rank"], 0, key)
            else:
                self.assertTrue(r["error"], key)
        shared = "custom:64:32:8:2:16"
        self.assertTrue(by[(shared, "transformers", "forward")]["unsupported"])
        self.assertTrue(by[(shared, "liger", "forward_backward")]["unsupported"])
        self.assertIsInstance(by[(shared, "floor", "forward")]["median_ms"], float)
        plain = "custom:64:32:8:2"
        if HAVE_TRANSFORMERS:
            self.assertLess(by[(plain, "transformers", "forward")]["check_vs_baseline_max_rel_err"], 2e-2)
        # Here Liger either does not import or fails on CPU tensors: a failure, not a "cannot"
        liger = by[(plain, "liger", "forward")]
        if not isinstance(liger["median_ms"], (int, float)):
            self.assertFalse(liger["unsupported"], liger["error"])
            self.assertIn("liger", liger["error"])
        fb = by[(plain, "floor", "forward_backward")]
        self.assertAlmostEqual(fb["flops_per_rank"], 3 * by[(plain, "floor", "forward")]["flops_per_rank"])
        self.assertEqual(by[(plain, "baseline", "forward")]["flops_per_rank"],
                         by[(plain, "floor", "forward")]["flops_per_rank"], "the same useful work")


if __name__ == "__main__":
    unittest.main()
