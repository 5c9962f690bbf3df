"""commfuse.sharding on transformers' own decoder classes (tiny configs, random weights), 2+ ranks (on the
CPU over gloo, or ranks sharing a GPU): the sharded model computes the unsharded one's logits, and
commfuse.fusion fuses every all-reduce tail of it, the model on the Communicator's device. Skipped with a
reason where transformers is not installed."""
import re

import pytest
import torch

import commfuse
from commfuse import fusion
from commfuse.sharding import RowParallelLinear, shard_decoder

transformers = pytest.importorskip("transformers", reason="the sharding tests need transformers (pip install transformers)")

mpi = pytest.mark.mpi(min_size=2)

# The classes that the oldest transformers these tests run with (the GPU image's 5.17) lacks, and the version that
# first ran them here: below it their tests skip. Any other class missing is a failure (a misspelt name, or a
# class transformers removed), not a skip that would hide it.
NEWER_CLASSES = {"ErgoForCausalLM": "5.25", "MiniCPM5MoeForCausalLM": "5.25"}


def model_class(name):
    """transformers' class `name`; a skip where it is one of NEWER_CLASSES and the installed transformers is older
    than the version that has it, else a failure where it is missing."""
    if hasattr(transformers, name):
        return getattr(transformers, name)
    from packaging.version import Version

    since = NEWER_CLASSES.get(name)
    if since is not None and Version(transformers.__version__) < Version(since):
        pytest.skip(f"transformers {transformers.__version__} has no {name} (tested from {since})")
    pytest.fail(f"transformers {transformers.__version__} has no {name}: a misspelt class, or one it removed")
MOE = {"num_experts_per_tok": 2}  # 4 experts of 32 * kv intermediate features each (set in tiny)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {}),  # dropout between each all-reduce and its add
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),  # query_ / key_layernorm per head
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),  # an ungated MLP: down_proj(relu2(up_proj(x)))
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": 0}),  # layers without rotary embeddings
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"pad_token_id": 0, "use_bias": True}),  # biases
    # projections in one: q, k and v (Phi-3's qkv_proj), gate and up (Phi-3's and GLM's gate_up_proj)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "phi3_one_kv_head": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "num_key_value_heads": 1}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"pad_token_id": 0}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"pad_token_id": 0}),  # post-norms too, fused as Gemma 2 / 3's
    # qkv_proj's output viewed as heads, then split; per-head q/k norms; post-norms in float32 (LEFT_UNFUSED)
    "ergo": ("ErgoConfig", "ErgoForCausalLM", {"mlp_layer_types": ["dense", "dense"], "sliding_window": 4,
                                                "layer_types": ["sliding_attention", "full_attention"]}),
    # a post-norm (the all-reduced sum normalised, added to the residual, then the next pre-norm): fused_all_reduce's
    # post_weight
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 4}),
    # post-norms and no pre-norms: only the last layer's sum is normalised after its add (LEFT_UNFUSED); q/k norms
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": 4}),
    # the sum scaled before the residual add (residual + sum * residual_multiplier): not fused_all_reduce's tail
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"residual_multiplier": 0.5}),
    # attention and MLP in parallel, both all-reduced sums added to the residual; LayerNorm
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": 4}),
    # views its projections with its own num_heads; LayerNorm, which the pass does not fuse
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "stablelm_qk_layernorm": ("StableLmConfig", "StableLmForCausalLM", {"qk_layernorm": True}),  # a LayerNorm a head
    # fewer key-value heads than ranks, each replicated: one (multi-query attention, Gemma 2B's); half the ranks
    "gemma_one_kv_head": ("GemmaConfig", "GemmaForCausalLM", {"num_key_value_heads": 1}),
    # (eager attention: its repeat_kv reads the attention's num_key_value_groups, which sdpa may not)
    "llama_kv_heads_half_the_ranks": ("LlamaConfig", "LlamaForCausalLM", {
        "num_key_value_heads": lambda world: max(1, world // 2), "attn_implementation": "eager"}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(MOE, num_local_experts=4, sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(MOE, num_experts=4)),  # with a shared expert
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, num_experts=4)),
    # shared experts (plural, ungated); the first layer a dense MLP
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(MOE, n_routed_experts=4, n_shared_experts=1,
                                                             first_k_dense_replace=1)),
}
# Latent attention (per-head dims 8 + 16 for q and k, the rotary part head_dim's 16; 16 for v), the router's
# groups one, as above otherwise.
DEEPSEEK = dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=16)
FAMILIES.update({"deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK),
                 "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
                 "deepseek_v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(DEEPSEEK, q_lora_rank=None)),
                 # experts transposed, gate and up interleaved, with biases; attention sinks; sliding layers
                 "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(MOE, num_local_experts=4, sliding_window=4)),
                 # every MLP a MoE block: its config has no intermediate_size (tiny leaves it out); a gated-delta
                 # layer, kept whole, then a full attention
                 "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                                 dict(MOE, num_experts=4, layer_types=["linear_attention", "full_attention"]))})
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v2", "deepseek_v3", "deepseek_v3_no_q_lora",
                "gpt_oss", "qwen3_5_moe")
NO_INTERMEDIATE_SIZE = ("qwen3_5_moe",)
# Families whose every all-reduce the pass leaves, each reported with this reason.
POST_NORM = re.escape("(a post-norm), which fused_all_reduce takes only where its output alone is added to a "
                      "residual that an RMSNorm then normalises")
LEFT_UNFUSED = {"exaone4": POST_NORM, "ergo": POST_NORM,
                "granite": r"no residual add \+ RMSNorm .* reads its sum: it is read by \S+ \(mul\)",
                "cohere2": r"no residual add \+ RMSNorm .* reads its sum: it is read by \S+ \(add\)"}
FUSED_TOO = {"exaone4": 1}  # the last layer's MLP sum: its post-norm, + residual, then the model's final norm
LINEAR_ATTENTION_LAYERS = {"qwen3_5_moe": 1}  # kept whole: no o_proj sharded, no all-reduce
QUERY_GATED = ("qwen3_5_moe",)  # q_proj gives each head's queries and its output gate
# Families shard_decoder refuses: a norm over the whole q / k projection (Olmo2), per-layer lambdas mixing
# two halves of the heads (DiffLlama), a norm over the whole attention output before o_proj (BitNet).
# MLPs of other shapes, which would stay whole on every rank: c_fc / c_proj (Starcoder2).
OTHERS = {"olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}), "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {}),
          "cohere": ("CohereConfig", "CohereForCausalLM", {"use_qk_norm": True}),
          "bitnet": ("BitNetConfig", "BitNetForCausalLM", {}),
          "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"pad_token_id": 0}),
          # Attentions of other shapes: one projection for the queries and an output gate (MiniCPM5-MoE's
          # q_gate_proj), DeepSeek-V4's; ungated experts (Nemotron-H's up_proj / down_proj).
          "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", dict(MOE, n_routed_experts=4)),
          "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(MOE, n_routed_experts=4)),
          "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(MOE, n_routed_experts=4,
                                                                         layers_block_type=["attention", "moe"])),
          # ungated experts, each with a norm of its own (its dense layers shard: "ergo" above)
          "ergo_moe": ("ErgoConfig", "ErgoForCausalLM", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                                             mlp_layer_types=["dense", "sparse"], sliding_window=4,
                                                             layer_types=["sliding_attention", "full_attention"]))}
LAYERS = 2


def tiny(family, dtype, seed=0):
    """Two key-value heads per rank (at least two in all), two query heads per key-value head (latent attention:
    one each)."""
    import torch.distributed as dist

    config_name, model_name, extra = {**FAMILIES, **OTHERS}[family]
    model_type = model_class(model_name)
    kv = 2 * dist.get_world_size()
    if family in MOE_FAMILIES:
        extra = dict(extra, moe_intermediate_size=32 * kv, shared_expert_intermediate_size=64 * kv)
    # Latent attention expands every query head's own key and value: as many key-value heads as heads.
    kv_heads = 2 * kv if "kv_lora_rank" in extra else kv
    sizes = dict(hidden_size=2 * kv * 16, intermediate_size=128 * kv, num_hidden_layers=LAYERS,
                 num_attention_heads=2 * kv, num_key_value_heads=kv_heads, head_dim=16, vocab_size=128,
                 max_position_embeddings=64)
    extra = {k: v(dist.get_world_size()) if callable(v) else v for k, v in extra.items()}
    if family in NO_INTERMEDIATE_SIZE:
        del sizes["intermediate_size"]  # a config takes unknown keywords as attributes
    config = getattr(transformers, config_name)(**{**sizes, **extra})
    assert family not in NO_INTERMEDIATE_SIZE or not hasattr(config, "intermediate_size")
    torch.manual_seed(seed)  # the same weights on every rank
    model = model_type(config)
    with torch.no_grad():  # biases, sinks and per-head norms start alike: random ones, so a wrong share shows
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            elif any(f".{n}." in name for n in ("q_norm", "k_norm", "query_layernorm", "key_layernorm",
                                                  "q_layernorm", "k_layernorm")):
                p.normal_(1.0, 0.5)
    return model.to(dtype).eval()


def moe_layers(model):
    return sum(hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj") for m in model.modules())


def tokens(seed=1):
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(seed))


@mpi
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_model_computes_the_unsharded_logits(comm, family):
    """The prompt's logits, and a decode step's from the prompt's key-value cache."""
    ids, step = tokens(), tokens(3)[:, :1]

    def run(model):
        prompt = model(ids, use_cache=True)
        return prompt.logits, model(step, past_key_values=prompt.past_key_values, use_cache=True).logits

    with torch.inference_mode():
        want = run(tiny(family, torch.float32))
        model = shard_decoder(tiny(family, torch.float32))
        got = run(model)
    rows = sum(isinstance(m, RowParallelLinear) for m in model.modules())
    # o_proj's, and down_proj's in a dense MLP
    assert rows == 2 * LAYERS - moe_layers(model) - LINEAR_ATTENTION_LAYERS.get(family, 0)
    attention = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    config = model.config
    kv = max(1, config.num_key_value_heads // comm.world_size)  # a rank's key-value heads, or the one it shares
    if hasattr(attention, "qkv_proj"):  # q, k and v in one projection: a rank's share of each
        assert attention.qkv_proj.out_features == (config.num_attention_heads // comm.world_size + 2 * kv) * 16
    else:
        q = attention.q_b_proj if getattr(attention, "q_b_proj", None) is not None else attention.q_proj
        per_head = getattr(config, "qk_head_dim", 16) * (2 if family in QUERY_GATED else 1)
        assert q.out_features == config.num_attention_heads * per_head // comm.world_size
    if getattr(attention, "k_proj", None) is not None:
        assert attention.k_proj.out_features == kv * 16
    assert not any(p.requires_grad for p in model.parameters())  # inference only
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@mpi
@pytest.mark.parametrize("family", sorted(LEFT_UNFUSED))
def test_fusion_reports_why_it_leaves_each_all_reduce(comm, family):
    """EXAONE 4 normalises each all-reduced sum before adding it to the residual (a post-norm) with no norm after the
    add but the model's last, Ergo's post-norms compute in float32, Granite scales the sum, Cohere 2 adds the
    attention's and the MLP's sums to the residual together: fused_all_reduce takes none of them (EXAONE 4's last
    aside: FUSED_TOO), and each all-reduce's reason says which. The norms are matched as local ops; the logits stay
    the unfused model's (bf16, within the norms' rounding)."""
    c = commfuse.Communicator(comm.group)
    c.check_calls = False
    torch._dynamo.reset()
    with torch.inference_mode():
        model = shard_decoder(tiny(family, torch.bfloat16)).to(c.device)
        ids = tokens(2).to(c.device)
        want = model(ids, use_cache=False).logits.float()
        compiled = fusion.compile(model, c, backend="aot_eager")
        got = compiled(ids, use_cache=False).logits.float()
    reports = compiled.fusion_reports
    text = "\n".join(map(str, reports))
    assert sum(r.count("commfuse::fused_all_reduce") for r in reports) == FUSED_TOO.get(family, 0), text
    reasons = [s.reason for r in reports for s in r.skipped if s.what == "all-reduce"]
    assert len(reasons) == 2 * LAYERS - FUSED_TOO.get(family, 0), text
    assert all(re.search(LEFT_UNFUSED[family], r) for r in reasons), text
    err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert err < 0.03, f"relative RMS error {err:.3g}"


@mpi
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"stablelm", "stablelm_qk_layernorm", *LEFT_UNFUSED}))
def test_fusion_fuses_every_all_reduce_tail(comm, family):
    c = commfuse.Communicator(comm.group)
    c.check_calls = False
    torch._dynamo.reset()
    ids = tokens(2)
    with torch.inference_mode():
        model = shard_decoder(tiny(family, torch.bfloat16)).to(c.device)
        ids = ids.to(c.device)
        moe = family in MOE_FAMILIES
        if moe:  # the combine as a sum over the top-k rows (the default loop's index_add_ is reported, not fused)
            model.config._experts_implementation = "batched_mm"
        want = model(ids, use_cache=False).logits.float()
        compiled = fusion.compile(model, c, backend="aot_eager")
        got = compiled(ids, use_cache=False).logits.float()
    reports = compiled.fusion_reports
    fused = sum(r.count("commfuse::fused_all_reduce") for r in reports)
    moe_fused = sum(r.count("commfuse::moe_all_reduce") for r in reports)
    text = "\n".join(map(str, reports))
    # Every one: o_proj's, and down_proj's in a dense MLP or the MoE block's (its combine with it).
    dense = 2 * LAYERS - moe_layers(model) - LINEAR_ATTENTION_LAYERS.get(family, 0)
    assert (fused, moe_fused) == (dense, moe_layers(model)), text
    assert moe_layers(model) == (0 if not moe else LAYERS - FAMILIES[family][2].get("first_k_dense_replace", 0)), text
    assert not any(s.what == "all-reduce" for r in reports for s in r.skipped), text
    # The fused norms round once where the model's round twice (docs/fusion.md, Tolerances).
    err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert err < 0.03, f"relative RMS error {err:.3g}"


@pytest.mark.mpi  # world 1 too: there as well each attention's query heads a key-value head serves are its own
def test_key_value_heads_differ_by_layer(comm):
    """MiMo-V2-Flash's sliding-window layers have twice the config's key-value heads: each attention is sharded by
    its own (its k_proj's), a rank keeping its share of them or, where they are fewer than the ranks, the one its
    queries read. The prompt's logits, and a decode step's, are the unsharded model's."""
    model_class("MiMoV2FlashForCausalLM")
    world = comm.world_size
    ids, step = tokens(), tokens(3)[:, :1]

    def run(model):
        prompt = model(ids, use_cache=True)
        return prompt.logits, model(step, past_key_values=prompt.past_key_values, use_cache=True).logits

    for kv in sorted({max(1, world // 2), world}):  # the full-attention layer's: fewer than the ranks, and as many
        # MiMo's attention has no sdpa path; sinks only in its sliding-window layers
        config = transformers.MiMoV2FlashConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4 * world, num_key_value_heads=kv, head_dim=16,
            v_head_dim=16, vocab_size=128, max_position_embeddings=64, intermediate_size=128 * world,
            moe_intermediate_size=32 * world, n_routed_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")

        def model():
            torch.manual_seed(0)  # the same weights on every rank
            m = transformers.MiMoV2FlashForCausalLM(config)
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if name.endswith("sinks"):
                        p.normal_(0.0, 0.5)
            return m.eval()

        with torch.inference_mode():
            want = run(model())
            sharded = shard_decoder(model())
            got = run(sharded)
        heads = [layer.self_attn.k_proj.out_features // 16 for layer in sharded.model.layers]
        assert heads == [max(1, 2 * kv // world), max(1, kv // world)], kv
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@mpi
def test_default_experts_combine_is_fused(comm):
    """transformers' default experts implementation (grouped_mm: the rows in expert order gathered back to
    token order) is the combine's finalize form: each MoE block's tail is fused with it."""
    c = commfuse.Communicator(comm.group)
    c.check_calls = False
    torch._dynamo.reset()
    with torch.inference_mode():
        model = shard_decoder(tiny("mixtral", torch.bfloat16)).to(c.device)
        compiled = fusion.compile(model, c, backend="aot_eager", dynamic=True)
        for i, n in enumerate((9, 13)):  # one graph for both token counts (t * k rows, arange(t * k) symbolic)
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)).to(c.device)
            want = model(ids, use_cache=False).logits.float()
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = compiled(ids, use_cache=False).logits.float()
            err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
            assert err < 0.03, f"{n} tokens: relative RMS error {err:.3g}"
    reports = compiled.fusion_reports
    text = "\n".join(map(str, reports))
    combines = [s for r in reports for s in r.skipped if s.what == "moe combine"]
    assert sum(r.count("commfuse::fused_all_reduce") for r in reports) == LAYERS, text
    assert sum(r.count("commfuse::moe_all_reduce") for r in reports) == LAYERS, text
    assert "[inv_perm]" in text and not combines, text


@mpi
def test_shard_decoder_errors(comm, monkeypatch):
    if comm.world_size < 2:
        pytest.skip("needs 2+ ranks")
    import types

    import torch.distributed as dist

    outside = object()  # a group this rank is not in: torch gives such a rank -1 and a world of -1
    with monkeypatch.context() as m:
        m.setattr(dist, "get_rank", lambda group=None, get=dist.get_rank: -1 if group is outside else get(group))
        m.setattr(dist, "get_world_size", lambda group=None, get=dist.get_world_size: -1 if group is outside else get(group))
        with pytest.raises(ValueError, match=r"^LlamaForCausalLM: this rank \([0-9]+\) is not a member of group"):
            shard_decoder(tiny("llama", torch.float32), outside)
    # The config's sizes are checked first; their errors, like the layers', start with the model's class name.
    w = comm.world_size
    model = tiny("llama", torch.float32)
    model.config.num_key_value_heads = w + 1
    with pytest.raises(ValueError, match=rf"^LlamaForCausalLM: model.config.num_key_value_heads = {w + 1} does not "
                                         rf"divide by the world size {w}, nor the world size by it$"):
        shard_decoder(model)
    model = tiny("llama", torch.float32)
    model.config.intermediate_size = 2 * w + 1
    with pytest.raises(ValueError, match=rf"^LlamaForCausalLM: model.config.intermediate_size = {2 * w + 1} does not "
                                         rf"divide by the world size {w}$"):
        shard_decoder(model)
    with pytest.raises(ValueError, match=r"^Linear: model.config has no num_attention_heads: not a decoder"):
        shard_decoder(torch.nn.Linear(4, 4))
    bare = torch.nn.Sequential(torch.nn.Linear(4, 4))
    bare.config = types.SimpleNamespace(num_attention_heads=2 * w, num_key_value_heads=w, intermediate_size=4 * w)
    with pytest.raises(ValueError, match=r"^Sequential: no attention .* layers found: not a decoder"):
        shard_decoder(bare)
    bare.append(torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4))]))  # a stack of unknown layers: named
    with pytest.raises(ValueError, match=r"^Sequential: no attention .* found \(1.0.0.weight is in none\): not a"):
        shard_decoder(bare)
    model = tiny("qwen3", torch.float32)  # StableLM's per-head norms are a list of norms, one a head
    model.model.layers[1].self_attn.k_layernorm = torch.nn.LayerNorm(16)
    with pytest.raises(ValueError, match=r"layers.1.self_attn.k_layernorm \(LayerNorm\) is not a list of [0-9]+ norms"):
        shard_decoder(model)
    model = tiny("qwen2_moe", torch.float32)
    model.model.layers[0].mlp.experts.is_transposed = True  # the weights' shapes are not transposed ones
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts hold gate_up_proj \([0-9, ]+\) and down_proj "
                                         r"\([0-9, ]+\): not the layout \[experts, h, 2 \* intermediate\]"):
        shard_decoder(model)
    model = tiny("qwen2_moe", torch.float32)
    model.model.layers[0].mlp.experts.has_post_expert_norm = True  # a norm of each expert's partial product
    with pytest.raises(ValueError, match="store their weights as"):
        shard_decoder(model)
    model = tiny("qwen3_moe", torch.float32)
    model.model.layers[1].mlp.zero_expert_num = 2  # LongcatFlash's experts that return the block's input
    with pytest.raises(ValueError, match=r"layers.1.mlp \(Qwen3MoeSparseMoeBlock\) has 2 zero experts"):
        shard_decoder(model)
    model = tiny("qwen2_moe", torch.float32)
    model.model.layers[1].mlp.experts.down_proj_scale = torch.nn.Parameter(torch.ones(4))  # e.g. a quantized one's
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts has \['down_proj_scale'\] beside"):
        shard_decoder(model)
    model = tiny("qwen2_moe", torch.float32)
    model.model.layers[0].mlp.shared_expert.sub_norm = torch.nn.RMSNorm(8)  # a norm of its whole intermediate
    with pytest.raises(ValueError, match=r"layers.0.mlp's shared expert \(Qwen2MoeMLP\) has \['sub_norm'\] beside"):
        shard_decoder(model)
    model = tiny("gpt_oss", torch.float32)
    model.model.layers[1].mlp.experts.down_proj_bias.data = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="MoE experts with biases"):
        shard_decoder(model)
    model = tiny("gpt_oss", torch.float32)
    model.model.layers[1].self_attn.sinks.data = torch.zeros(3)
    with pytest.raises(ValueError, match=r"layers.1.self_attn.sinks has shape \(3,\), not one logit per head"):
        shard_decoder(model)
    model = tiny("glm4_moe", torch.float32)
    model.model.layers[1].mlp.extra = torch.nn.Linear(4, 4)  # would be summed once per rank by the all-reduce
    with pytest.raises(ValueError, match=r"has \['extra'\] beside its router"):
        shard_decoder(model)
    odd, h = 2 * comm.world_size + 1, None
    for which in ("layout", "divides"):  # a down_proj of another width than gate_up_proj's; both of an odd one
        model = tiny("mixtral", torch.float32)
        experts, h = model.model.layers[1].mlp.experts, model.config.hidden_size
        experts.down_proj.data = torch.zeros(4, h, odd)
        if which == "divides":
            experts.gate_up_proj.data = torch.zeros(4, 2 * odd, h)
        before = [p.shape for p in model.parameters()]
        match = (rf"^MixtralForCausalLM: model.layers.1.mlp.experts hold gate_up_proj \(4, [0-9]+, {h}\) and down_proj "
                 rf"\(4, {h}, {odd}\): not the layout \[experts, 2 \* intermediate, h\]" if which == "layout" else
                 rf"^MixtralForCausalLM: model.layers.1.mlp.experts' intermediate size {odd} does not divide by the "
                 rf"world size {comm.world_size}$")
        with pytest.raises(ValueError, match=match):
            shard_decoder(model)
        assert [p.shape for p in model.parameters()] == before  # checked before anything is sharded
    # Olmo2's q_norm / k_norm normalise the whole projection: a rank's share of the heads would change them
    for family, match in (("olmo2", r"^Olmo2ForCausalLM: model.layers.0.self_attn.q_norm normalises [0-9]+ features, "
                                    r"not one head's 16"),
                          # Cohere's: a weight of its own for each head (one head's features, each its own)
                          ("cohere", r"^CohereForCausalLM: model.layers.0.self_attn.q_norm has a weight of its own "
                                     r"for each head \([0-9]+, 16\) \(Cohere's\)"),
                          ("diffllama", r"layers.0.self_attn \(DiffLlamaAttention\) has \['lambda_q1', 'lambda_k1', "
                                        r"'lambda_q2', 'lambda_k2'\] beside its projections"),
                          ("bitnet", r"layers.0.self_attn \(BitNetAttention\) has \['attn_sub_norm'\] beside"),
                          ("starcoder2", r"^Starcoder2ForCausalLM: model.layers.0.mlp.c_fc.weight is in no attention")):
        model = tiny(family, torch.float32)
        before = [p.shape for p in model.parameters()]
        with pytest.raises(ValueError, match=match):
            shard_decoder(model)
        assert [p.shape for p in model.parameters()] == before, family  # checked before anything is sharded
    model = tiny("qwen3", torch.float32)  # a norm per head: rank r would apply head i's to its head i
    model.model.layers[0].self_attn.q_norm = torch.nn.ModuleList(torch.nn.RMSNorm(16) for _ in range(4))
    with pytest.raises(ValueError, match=r"self_attn.q_norm normalises with 4 weights, not one head's 16"):
        shard_decoder(model)
    model = tiny("phi3", torch.float32)  # a qkv_proj's queries normalised whole, as Olmo2's q_proj's
    heads = model.config.num_attention_heads
    model.model.layers[1].self_attn.q_norm = torch.nn.RMSNorm(heads * 16)
    with pytest.raises(ValueError, match=rf"layers.1.self_attn.q_norm normalises {heads * 16} features, not one head's "
                                         r"16: .* \(a norm over the whole projection, as Olmo2's\)"):
        shard_decoder(model)
    # Each refused in the last layer (of a MoE model where it can): nothing, MoE blocks included, is sharded
    # before the checks.
    odd = 2 * comm.world_size + 1
    cases = [("qwen3_moe", lambda m: setattr(m.model.layers[1].self_attn, "extra", torch.nn.Linear(4, 4)),
              r"layers.1.self_attn \(Qwen3MoeAttention\) has \['extra'\] beside its projections"),
             ("qwen3_moe", lambda m: setattr(m.model.layers[1].self_attn, "num_heads", odd),
              rf"layers.1.self_attn.num_heads = {odd} does not divide"),
             ("qwen3_moe", lambda m: setattr(m.model.layers[1].self_attn, "o_proj",
                                             torch.nn.Linear(odd, m.config.hidden_size)),
              rf"layers.1.self_attn.o_proj has {odd} input features, which do not divide"),
             ("llama", lambda m: [setattr(m.model.layers[1].self_attn, n, torch.nn.Linear(m.config.hidden_size,
                                                                                         odd * 16))
                                  for n in ("k_proj", "v_proj")],  # key-value heads of its own, not the config's
              rf"^LlamaForCausalLM: model.layers.1.self_attn has {odd} key-value heads, which do not divide by the "
              rf"world size {comm.world_size}, nor the world size by them$"),
             ("llama", lambda m: setattr(m.model.layers[1], "extra", torch.nn.Linear(4, 4)),
              r"model.layers.1.extra.weight is in no attention, MLP \(up/down_proj or gate_up/down_proj\) or MoE"),
             ("llama", lambda m: setattr(m.model.layers[1].mlp, "activation_sparsity", 0.95),  # Gemma 3n's
              r"layers.1.mlp \(LlamaMLP\) keeps a top share of its intermediate features"),
             ("qwen3_moe", lambda m: setattr(m, "config", types.SimpleNamespace(  # Gemma 3n's sizes per layer
                 num_attention_heads=m.config.num_attention_heads, num_key_value_heads=m.config.num_key_value_heads,
                 intermediate_size=[128, 256])), r"model.config.intermediate_size = \[128, 256\] is not one int")]
    for family, change, match in cases:
        model = tiny(family, torch.float32)
        change(model)
        before = [p.shape for p in model.parameters()]
        with pytest.raises(ValueError, match=match):
            shard_decoder(model)
        assert [p.shape for p in model.parameters()] == before, match
    model = tiny("llama", torch.float32)
    model.model.layers[1].mlp.down_proj = type("QuantLinear", (torch.nn.Linear,), {})(4, 4)  # would lose its kind
    with pytest.raises(ValueError, match=r"layers.1.mlp.down_proj is a QuantLinear, not an nn.Linear"):
        shard_decoder(model)
    model = tiny("qwen3_moe", torch.float32)  # a weight of the block's own, summed once per rank by the all-reduce
    model.model.layers[1].mlp.out_bias = torch.nn.Parameter(torch.randn(model.config.hidden_size))
    with pytest.raises(ValueError, match=r"has \['out_bias'\] beside its router"):
        shard_decoder(model)
    # A model transformers' tp_plan parallelised already (DTensor weights) is refused before anything changes.
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    model = tiny("qwen3_moe", torch.float32)
    mesh = init_device_mesh(comm.device.type, (comm.world_size,))
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(distribute_tensor(o_proj.weight.detach(), mesh, [Replicate()]))
    before = [p.shape for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^Qwen3MoeForCausalLM: model.layers.1.self_attn.o_proj.weight is a DTensor: "
                                         "the model is parallelised"):
        shard_decoder(model)
    assert [p.shape for p in model.parameters()] == before


def test_bits_sum_is_exact_and_tells_a_reordering_apart(monkeypatch):
    """The weights' checksum: every element's bits as an integer, summed exactly (int64), and summed weighted by
    position modulo 2^31 - 1, whatever the element size (a 16-byte complex128 by its bytes) or layout, in chunks that
    bound the int64 temporaries. Swapped rows or a transposed square matrix differ (the plain sum alone let ranks
    whose weights were one another's reordering through)."""
    from commfuse import sharding

    monkeypatch.setattr(sharding, "_SUM_CHUNK", 7)  # several chunks and a short last one
    gen = torch.Generator().manual_seed(5)
    for t in (torch.randn(5, 9, generator=gen).to(torch.bfloat16), torch.randn(3, 11, generator=gen),
              torch.randn(4, 6, generator=gen)[:, ::2], torch.randn(10, generator=gen).to(torch.float8_e4m3fn),
              torch.randn(5, generator=gen, dtype=torch.complex128)):
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(t.element_size(), torch.uint8)
        bits = [int(b) for b in t.contiguous().view(-1).view(torch.uint8).view(ints).tolist()]
        want = [sum(bits), sum(b * (i + 1) for i, b in enumerate(bits)) % (2 ** 31 - 1)]
        assert sharding._bits_sum(t).tolist() == want, t.dtype
    flipped = torch.randn(5, 9, generator=gen)
    other = flipped.clone()
    other.view(torch.int32)[2, 3] ^= 1  # one bit of one element
    assert sharding._bits_sum(other).tolist() != sharding._bits_sum(flipped).tolist()
    square = torch.randn(6, 6, generator=gen).to(torch.bfloat16)
    swapped = square[[1, 0, 2, 3, 4, 5]]
    for reordered in (swapped, square.t()):
        assert int(sharding._bits_sum(reordered)[0]) == int(sharding._bits_sum(square)[0])  # the plain sum alike
        assert sharding._bits_sum(reordered).tolist() != sharding._bits_sum(square).tolist()


@mpi
@pytest.mark.parametrize("change", ["one element", "two rows swapped"])
def test_ranks_with_different_weights_are_refused(comm, change):
    """A model made by from_config on each rank without one seed holds each rank's own weights, which sharded
    would sum garbage: every rank raises, naming a parameter that differs, and leaves its model unsharded. So
    does a rank whose weight is a reordering of the others' (another row order loaded), which the checksum's
    plain sum took for the same."""
    if comm.world_size < 2:
        pytest.skip("needs 2+ ranks")
    import torch.distributed as dist

    model = tiny("llama", torch.float32)
    with torch.no_grad():  # on the last rank only
        if dist.get_rank() == comm.world_size - 1:
            up = model.model.layers[1].mlp.up_proj.weight
            if change == "one element":
                up[3, 5] += 1
            else:
                up[[0, 3]] = up[[3, 0]].clone()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM: the ranks hold different weights "
                                         rf"\(model.layers.1.mlp.up_proj.weight differs between group ranks 0 and "
                                         rf"{comm.world_size - 1}\)"):
        shard_decoder(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert shard_decoder(tiny("llama", torch.float32)) is not None  # the same weights: sharded


@mpi
def test_shard_decoder_shards_a_model_once(comm):
    """A second call is refused: on a model with dense layers (their RowParallelLinear) and on one whose only
    sharded layers are MoE blocks (Qwen3-Next's linear attention stays whole), whose experts it would halve
    again. A per-expert routing weight of the block's own (afmoe's expert_bias) is repeated on every rank.
    Qwen3-Next's gated full attention shards too."""
    model = tiny("qwen3_moe", torch.float32)
    shard_decoder(model)
    with pytest.raises(ValueError, match=r"^Qwen3MoeForCausalLM: model.layers.0.self_attn.o_proj is sharded already"):
        shard_decoder(model)
    kv = 2 * comm.world_size
    config = transformers.Qwen3NextConfig(hidden_size=2 * kv * 16, num_hidden_layers=2, layer_types=["linear_attention"] * 2,
                                          num_attention_heads=2 * kv, num_key_value_heads=kv, head_dim=16,
                                          vocab_size=128, intermediate_size=128 * kv, moe_intermediate_size=32 * kv,
                                          shared_expert_intermediate_size=32 * kv, num_experts=4, num_experts_per_tok=2,
                                          linear_num_value_heads=4, linear_num_key_heads=2)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    routing = torch.randn(4)
    model.model.layers[0].mlp.expert_bias = torch.nn.Parameter(routing.clone(), requires_grad=False)
    with torch.inference_mode():
        want = model(tokens(), use_cache=False).logits
        shard_decoder(model)
        assert torch.allclose(model(tokens(), use_cache=False).logits, want, atol=1e-5)
    assert torch.equal(model.model.layers[0].mlp.expert_bias, routing)
    shapes = [p.shape for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^Qwen3NextForCausalLM: model.layers.0.mlp is sharded already"):
        shard_decoder(model)
    assert [p.shape for p in model.parameters()] == shapes
    # Its full attention's q_proj also projects the output gate (twice the queries): the per-head q_norm is
    # read against the attention's own head_dim, and the model shards exactly.
    config.layer_types = ["full_attention", "linear_attention"]
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.inference_mode():
        want = model(tokens(), use_cache=False).logits
        shard_decoder(model)
        assert torch.allclose(model(tokens(), use_cache=False).logits, want, atol=1e-5)


# The error each refused family's tiny model raises (its class, then the weight it would leave whole).
PARTLY_WHOLE = {
    "minicpm5_moe": r"^MiniCPM5MoeForCausalLM: model.layers.0.self_attn.k_proj.weight is in no attention, MLP "
                    r"\(up/down_proj or gate_up/down_proj\) or MoE block that shard_decoder knows: every rank would "
                    r"keep all of it$",
    "deepseek_v4": r"^DeepseekV4ForCausalLM: model.layers.0.self_attn.q_a_proj.weight is in no attention, MLP "
                   r"\(up/down_proj or gate_up/down_proj\) or MoE block that shard_decoder knows",
    "nemotron_h": r"^NemotronHForCausalLM: model.layers.1.mixer.experts \(NemotronHExperts\) store their weights as "
                  r"\{'has_gate': False, 'has_post_expert_norm': False\}: shard_decoder knows gated experts",
    "ergo_moe": r"^ErgoForCausalLM: model.layers.1.mlp.experts \(ErgoExperts\) store their weights as "
                r"\{'has_gate': False, 'has_post_expert_norm': True\}: shard_decoder knows gated experts"}


@mpi
@pytest.mark.parametrize("family", sorted(PARTLY_WHOLE))
def test_families_it_would_leave_partly_whole_are_refused(comm, family):
    """A decoder layer's weights that shard_decoder does not know (an attention of another shape, beside an MLP or
    MoE block it knows; ungated experts) are refused before anything changes, rather than left whole on every
    rank."""
    model = tiny(family, torch.float32)
    before = [p.shape for p in model.parameters()]
    with pytest.raises(ValueError, match=PARTLY_WHOLE[family]):
        shard_decoder(model)
    assert [p.shape for p in model.parameters()] == before


@mpi
def test_gated_delta_linear_attention_stays_whole_in_each_family_that_has_it(comm):
    """Qwen3.5's linear attention (transformers' Qwen3_5GatedDeltaNet) stays whole on every rank as Qwen3-Next's
    does, its full attention and MLPs sharded: the logits are the unsharded model's."""
    model_class("Qwen3_5ForCausalLM")
    kv = 2 * comm.world_size
    config = transformers.Qwen3_5TextConfig(hidden_size=2 * kv * 16, num_hidden_layers=2, num_attention_heads=2 * kv,
                                            num_key_value_heads=kv, head_dim=16, vocab_size=128,
                                            intermediate_size=128 * kv, layer_types=["linear_attention",
                                                                                     "full_attention"])
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    whole = model.model.layers[0].linear_attn.out_proj.weight.shape
    with torch.inference_mode():
        want = model(tokens(), use_cache=False).logits
        shard_decoder(model)
        assert torch.allclose(model(tokens(), use_cache=False).logits, want, atol=1e-5)
    assert model.model.layers[0].linear_attn.out_proj.weight.shape == whole
    assert model.model.layers[1].mlp.down_proj.weight.shape[1] == 128 * kv // comm.world_size


_FRESH = """
import sys, torch, torch.distributed as dist, commfuse
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
try:
    commfuse.sharding.shard_decoder(torch.nn.Linear(4, 4))
except ValueError as e:
    print("ValueError:", e)
print("torch.distributed.tensor" in sys.modules)
dist.destroy_process_group()
"""


def test_import_commfuse_gives_sharding(tmp_path):
    """The documented snippet, `import commfuse` then `commfuse.sharding.shard_decoder(model)`, in a fresh process
    (no transformers, torch.distributed.tensor not imported): a model it does not know raises its ValueError."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX"))}  # not an MPI rank
    run = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["ValueError: Linear: model.config has no num_attention_heads: not a decoder "
                                       "shard_decoder knows", "False"], run.stdout


@mpi
def test_row_parallel_linear_adds_the_bias_once(comm, gen):
    """Every rank passes the unsharded layer's bias (the contract shard_decoder's layers keep); the sum holds it
    once."""
    import torch.distributed as dist

    rank, world = dist.get_rank(comm.group), comm.world_size
    full = torch.nn.Linear(8 * world, 16).eval()
    with torch.no_grad():
        full.weight.copy_(torch.randn(16, 8 * world, generator=gen))
        full.bias.copy_(torch.randn(16, generator=gen))
    full = full.to(comm.device)
    x = torch.randn(3, 8 * world, generator=gen).to(comm.device)
    layer = RowParallelLinear(full.weight.detach()[:, rank * 8:(rank + 1) * 8].clone(), full.bias.detach().clone(),
                              comm.group)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[:, rank * 8:(rank + 1) * 8]), full(x), rtol=1e-5, atol=1e-5)
