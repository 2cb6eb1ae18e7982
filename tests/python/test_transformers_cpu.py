"""pounce as transformers' experts backend on the CPU: tiny random-init models of every covered family
(no download), the loss and every parameter's gradient of experts_implementation="pounce" against
transformers' own eager experts; shared experts inside pounce, EP over a CPU group (ranks as threads),
frozen experts, the registration paths."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pounce = pytest.importorskip(
    "pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)"
)
import pounce.torch as pt  # noqa: E402

from conftest import on_ranks, raise_first  # noqa: E402
from torch_reference import route_as  # noqa: E402

try:
    from transformers.integrations.moe import ExpertsInterface  # noqa: E402
except ImportError:
    pytest.skip("transformers has no experts interface (needs transformers 5)", allow_module_level=True)

# Tiny shapes pounce takes: hidden and intermediate multiples of 64.
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, max_position_embeddings=64, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)

FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=64, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=64, intermediate_size=128, shared_expert_intermediate_size=64,
                       num_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=64, intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
                         n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=32, head_dim=16,
                         num_key_value_heads=2, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"])),
}


def build(family, seed=0, dtype=torch.float32):
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # bf16 values: the experts read bf16 weights, the reference the same
            p.copy_(p.to(torch.bfloat16).to(dtype))
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                # Wide router margins: a token whose top two experts nearly tie would flip on the bf16-level
                # differences of the layer below and change the gradients by far more than rounding does.
                p.mul_(8)
            if name.endswith("_bias"):  # GPT-OSS's expert biases start at zero: make them count
                p.copy_((torch.randn_like(p.float()) * 0.1).to(torch.bfloat16).to(dtype))
    return model


def batch(seed=1, rows=3, length=16):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, COMMON["vocab_size"], (rows, length), generator=gen)
    return ids


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def close(name, got, ref, tolerance):
    err = (got.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    assert err <= tolerance * scale + 1e-7, f"{name}: |got - ref| = {err:.3g}, |ref| = {scale:.3g}"


def compare(model_pounce, model_ref, ids, *, tolerance=0.05, skip=()):
    loss_p, grads_p = loss_and_grads(model_pounce, ids)
    loss_r, grads_r = loss_and_grads(model_ref, ids)
    close("loss", loss_p, loss_r, 2e-3)
    assert set(grads_p) == set(grads_r), set(grads_p) ^ set(grads_r)
    for name in grads_r:
        if not any(s in name for s in skip):
            close(name, grads_p[name], grads_r[name], tolerance)
    return loss_p, grads_p


def pounce_and_reference(family, reference="eager", **build_kwargs):
    ref = build(family, **build_kwargs)
    ref.set_experts_implementation(reference)
    model = copy.deepcopy(ref)
    model.set_experts_implementation("pounce")
    return model, ref


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_eager_experts(family):
    pt.free_workspaces()
    model, ref = pounce_and_reference(family)
    ids = batch()
    compare(model, ref, ids)
    experts = [m for m in model.modules() if "_pounce" in m.__dict__]
    assert len(experts) == model.config.num_hidden_layers  # every experts module ran through pounce
    counts = experts[0].last_tokens_per_expert
    assert counts.dtype == torch.int64 and int(counts.sum()) == ids.numel() * model.config.num_experts_per_tok
    stats = pt.workspace_stats()
    assert sum(s["recomputes"] for s in stats) == 0  # a workspace per layer by default
    assert sum(s["forwards"] for s in stats) == model.config.num_hidden_layers


def test_bf16_model_matches_grouped_mm():
    """bf16 everywhere: pounce and grouped_mm against an fp64 evaluation of the same model, all on
    grouped_mm's routing (a token whose second and third router logits lie within a bf16 ulp routes on
    the bf16-level differences of the layer below, and one such token moves the next layer's expert
    gradients by 5-20%); pounce's error on every gradient within 1.5x grouped_mm's own plus 5e-3."""
    model, ref = pounce_and_reference("qwen3_moe", reference="grouped_mm", dtype=torch.bfloat16)
    exact = copy.deepcopy(ref).double()
    exact.set_experts_implementation("eager")
    ids = batch(seed=2)
    routing = {}
    results = []
    for m, record in ((ref, True), (exact, False), (model, False)):
        handles = route_as(m, routing, record)
        results.append(loss_and_grads(m, ids))
        for handle in handles:
            handle.remove()
    (loss_r, grads_r), (_, grads_e), (loss_p, grads_p) = results
    close("loss", loss_p, loss_r, 2e-3)
    assert set(grads_p) == set(grads_r), set(grads_p) ^ set(grads_r)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / (b.double().norm() + 1e-30)).item()

    failures = []
    for name, g in grads_p.items():
        err, err_ref, direct = rel(g, grads_e[name]), rel(grads_r[name], grads_e[name]), rel(g, grads_r[name])
        if err > 1.5 * err_ref + 5e-3 or direct > 0.05:
            failures.append(f"{name}: relative error vs fp64 {err:.4f} (grouped_mm's {err_ref:.4f}), "
                            f"vs grouped_mm {direct:.4f}")
    assert not failures, "\n".join(failures)


def test_deepseek_shared_experts_inside_pounce():
    pt.free_workspaces()
    model, ref = pounce_and_reference("deepseek_v3", seed=0)
    counts = pt.configure_transformers(model, fuse_shared_experts=True)
    assert counts == {"experts": 2, "shared_inside": 2}
    compare(model, ref, batch())
    stats = pt.workspace_stats()
    assert {s["shape"][5] for s in stats} == {64}  # shared_intermediate: the shared experts run in pounce
    # Qwen2-MoE's sigmoid-gated shared expert stays in transformers' code.
    qwen2, _ = pounce_and_reference("qwen2_moe")
    assert pt.configure_transformers(qwen2, fuse_shared_experts=True) == {"experts": 2, "shared_inside": 0}


def test_frozen_experts_get_no_gradients():
    model, ref = pounce_and_reference("qwen3_moe", seed=5)
    for m in (model, ref):
        for name, p in m.named_parameters():
            if ".experts." in name:
                p.requires_grad_(False)
    _, grads = compare(model, ref, batch(seed=6))
    assert not any(".experts." in name for name in grads)


def test_workspace_grows_with_the_input_and_checkpointing_shares():
    pt.free_workspaces()
    model, ref = pounce_and_reference("olmoe", seed=7)
    compare(model, ref, batch(seed=8, rows=2, length=8))
    compare(model, ref, batch(seed=9, rows=12, length=16))  # 192 tokens: past the first 128-token workspace
    pt.configure_transformers(model, share_workspace=True)
    pt.free_workspaces()
    compare(model, ref, batch(seed=10))
    (stats,) = pt.workspace_stats()
    assert stats["shared"] and stats["layers"] == 2 and stats["recomputes"] == 1


def test_expert_parallel_over_a_cpu_group():
    """Two ranks (threads), each with its own batch and half the experts of every layer: each rank's loss
    and non-expert gradients equal those of the eager model on its batch; a local expert's gradient sums
    over every rank's tokens, so it is the slice of the eager gradients summed over the batches."""
    R = 2
    groups = pounce.Group.create_cpu(R)
    ref = build("qwen3_moe", seed=11)
    ref.set_experts_implementation("eager")
    models = [copy.deepcopy(ref) for _ in range(R)]
    batches = [batch(seed=12 + r) for r in range(R)]
    refs = [loss_and_grads(ref, ids) for ids in batches]

    def body(rank):
        model = models[rank]
        model.set_experts_implementation("pounce")
        assert pt.configure_transformers(model, group=groups[rank], max_tokens=64)["experts"] == 2
        return loss_and_grads(model, batches[rank])

    results, errors = on_ranks(R, body)
    raise_first(errors)
    for rank, ((loss, grads), (loss_ref, grads_ref)) in enumerate(zip(results, refs)):
        close(f"rank {rank} loss", loss, loss_ref, 2e-3)
        for name, g in grads.items():
            g_ref = grads_ref[name]
            if ".experts." in name:
                local = g.shape[0]
                g_ref = sum(other[1][name] for other in refs)[rank * local:(rank + 1) * local]
            close(f"rank {rank} {name}", g, g_ref, 0.03)


def test_unsupported_modules_raise_clear_errors():
    model, _ = pounce_and_reference("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="configure_transformers"):
        model(input_ids=batch())
    experts._is_expert_parallel = False
    with pytest.raises(TypeError, match="hidden_states"):
        experts(torch.zeros(4, 64, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2))
    pt.configure_transformers(model, group=pounce.Group.create_cpu(2)[0])  # EP without max_tokens
    assert experts.gate_up_proj.shape[0] == 4  # this rank's half
    with pytest.raises(pounce.PounceError, match="max_tokens"):
        model(input_ids=batch())
    gpt_oss, _ = pounce_and_reference("gpt_oss")
    with pytest.raises(NotImplementedError, match="biases under EP"):
        pt.configure_transformers(gpt_oss, group=pounce.Group.create_cpu(2)[0], max_tokens=64)


def test_registration_on_import_and_from_pretrained(tmp_path):
    """A fresh interpreter: importing pounce.torch before transformers registers "pounce" once the MoE
    integration loads; from_pretrained(experts_implementation="pounce") then takes it."""
    model = build("mixtral", seed=13)
    model.save_pretrained(tmp_path)
    script = f"""
import pounce.torch, sys
assert "transformers.integrations.moe" not in sys.modules
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, experts_implementation="pounce")
from transformers.integrations.moe import ExpertsInterface
assert "pounce" in ExpertsInterface._global_mapping
loss = model(input_ids=torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss
assert torch.isfinite(loss)
assert model.model.layers[0].mlp.experts.last_tokens_per_expert.sum() == 8
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    assert pt.register_transformers()


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    model, _ = pounce_and_reference("qwen3_moe", seed=14)
    ids = batch(seed=15)
    loss, grads = loss_and_grads(model, ids)
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True), ids)
    assert torch.equal(loss, compiled_loss)
    for name, g in grads.items():
        assert torch.equal(g, compiled_grads[f"_orig_mod.{name}"]), name
