"""commfuse.fusion on decoders that transformers parallelises itself (`DistributedConfig`): its tensor-parallel
plan (`tp_plan="auto"`: row-wise o_proj / down_proj whose partial products an all-reduce sums), and expert
parallelism whose all-reduce sums each rank's experts' share of the combine (`ep_implementation="all_reduce"`).
Tiny configs, random weights, 2+ ranks on the CPU over gloo: the pass fuses every all-reduce tail, MoE combines
included (DeepSeek's shared experts, all-reduced apart, with them), and the compiled model computes the
uncompiled one's logits. Skipped with a reason where transformers
or accelerate (which transformers needs to load a model with a parallel plan) is not installed, or where the
ranks share a GPU (transformers binds rank r to device r)."""
import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import fusion

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
pytest.importorskip("accelerate", reason="transformers loads a model with a parallel plan only with accelerate "
                                         "(pip install accelerate)")

mpi = pytest.mark.mpi(min_size=2)
LAYERS = 2
EP = {"enable_expert_parallel": True, "ep_implementation": "all_reduce"}
MOE = {"num_experts_per_tok": 2}
# family: config, model, config extras, DistributedConfig extras, (fused_all_reduce, moe_all_reduce) in all
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {}, (4, 0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {}, (4, 0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, {}, (4, 0)),
    # attention tensor-parallel, whole experts per rank
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(MOE, sliding_window=None), EP, (2, 2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE, EP, (2, 2)),
    # its plan leaves attention replicated: only the experts are shared out
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(MOE, sliding_window=4), EP, (0, 2)),
    # latent attention; a dense first layer; the shared experts' row-parallel down_proj all-reduced apart from
    # the routed experts' combine, the two sums added: one moe_all_reduce with the shared output as its input
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MOE, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=48,
                         kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=16), EP, (3, 1)),
}


@pytest.fixture(scope="module")
def folder(comm, tmp_path_factory):
    """One folder that every rank reads (rank 0's)."""
    path = [str(tmp_path_factory.mktemp("models")) if dist.get_rank(comm.group) == 0 else None]
    dist.broadcast_object_list(path, src=0, group=comm.group)
    return path[0]


def saved(family, folder, world, rank):
    """A tiny checkpoint of `family` saved by rank 0: an expert per rank, two key-value heads per rank."""
    config_name, model_name, extra, _, _ = FAMILIES[family]
    kv = 2 * world
    path = f"{folder}/{family}"
    if rank == 0:
        # Latent attention expands every query head's own key and value: as many key-value heads as heads.
        kv_heads = 2 * kv if "kv_lora_rank" in extra else kv
        config = getattr(transformers, config_name)(
            hidden_size=2 * kv * 16, intermediate_size=64 * kv, num_hidden_layers=LAYERS, num_attention_heads=2 * kv,
            num_key_value_heads=kv_heads, head_dim=16, vocab_size=128, max_position_embeddings=64, num_experts=world,
            num_local_experts=world, n_routed_experts=world, moe_intermediate_size=32 * kv, **extra)
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config)
        with torch.no_grad():  # biases and sinks start at zero or near it
            for name, p in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    p.normal_(0.0, 0.5)
        model.save_pretrained(path)
    dist.barrier()
    return path


@mpi
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fusion_fuses_transformers_own_parallel_plans(comm, folder, family):
    if comm.device.type == "cuda" and torch.cuda.device_count() < comm.world_size:
        pytest.skip("transformers binds rank r to GPU r: the ranks share a GPU here")
    c = commfuse.Communicator(comm.group)
    c.check_calls = False
    torch._dynamo.reset()
    _, _, _, parallel, expected = FAMILIES[family]
    config = transformers.DistributedConfig(tp_plan="auto", tp_size=comm.world_size, **parallel)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        saved(family, folder, comm.world_size, dist.get_rank(comm.group)), distributed_config=config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(c.device)
    with torch.inference_mode():
        want = model(ids, use_cache=False).logits.float()
        compiled = fusion.compile(model, c, backend="aot_eager")
        got = compiled(ids, use_cache=False).logits.float()
    reports = compiled.fusion_reports
    text = "\n".join(map(str, reports))
    counts = (sum(r.count("commfuse::fused_all_reduce") for r in reports),
              sum(r.count("commfuse::moe_all_reduce") for r in reports))
    assert counts == expected, text
    assert not any(s.what in ("all-reduce", "moe combine") for r in reports for s in r.skipped), text
    # The fused norms and combines round once where the model's round twice (docs/fusion.md, Tolerances).
    err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert err < 0.03, f"relative RMS error {err:.3g}"
