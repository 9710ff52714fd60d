"""The pure parts of ``Writer.attach``: reading the layer spec and expert layout from parameter
names, the FSDP mesh roles, and the refusal of a pair that disagrees with the live job. (The
real Megatron-Core / FSDP2 runs are engines/tests/train.)"""

import pytest

import awex
from awex import _attach, _awex


def names(*suffixes):
    return [f"decoder.layers.0.{s}" for s in suffixes]


def test_layer_spec_and_expert_layout_come_from_the_real_names():
    local = names("input_layernorm.weight", "self_attention.linear_qkv.weight", "pre_mlp_layernorm.weight",
                  "mlp.router.weight", "mlp.experts.local_experts.0.linear_fc1.weight")
    assert _attach._names_spec(local) == {"local_spec": 1, "grouped_gemm": 0}
    te = names("self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight",
               "mlp.experts.linear_fc1.weight0", "mlp.experts.linear_fc2.weight0")
    assert _attach._names_spec(te) == {"local_spec": 0, "grouped_gemm": 1}
    single = names("self_attention.linear_qkv.layer_norm_weight", "mlp.experts.linear_fc1.weight")
    assert _attach._names_spec(single) == {"local_spec": 0, "grouped_gemm": 1, "single_grouped_weight": 1}
    dense = names("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.weight")
    assert _attach._names_spec(dense) == {"local_spec": 0}

    # VPP chunks (`model{v}.`) and a dense layer beside the MoE ones
    vpp = ["model1." + n for n in names("input_layernorm.weight", "mlp.linear_fc1.weight")] + local
    assert _attach._names_spec(vpp) == {"local_spec": 1, "grouped_gemm": 0}


def test_fsdp_fused_experts_and_unknown_backends_are_answered_by_the_backend_crates():
    fused = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
             "model.layers.1.mlp.experts.down_proj"]
    assert _awex.options_from_names("fsdp", fused) == [("fused_experts", 1)]
    per_expert = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert _awex.options_from_names("fsdp", per_expert) == []
    with pytest.raises(ValueError, match=r"fsdq"):
        _awex.options_from_names("fsdq", fused)


def test_fsdp_transformers_release_comes_from_the_routers_dtype():
    """transformers 5.24 keeps DeepSeek-V2/V3, Kimi-K2 and GLM-4.5 routers in fp32 in a bf16 model:
    awex-fsdp reads the release's rules (``transformers=524``) from the live dtypes."""
    live = [("model.embed_tokens.weight", "bfloat16"), ("model.layers.1.mlp.gate.weight", "float32"),
            ("model.layers.1.mlp.experts.gate_up_proj", "bfloat16"), ("model.layers.1.mlp.experts.down_proj", "bfloat16"),
            ("model.layers.1.mlp.gate.e_score_correction_bias", "float32")]
    assert _awex.options_from_tensors("fsdp", live) == [("fused_experts", 1), ("transformers", 524)]
    bf16_router = [(n, "bfloat16" if n.endswith("gate.weight") else d) for n, d in live]
    assert _awex.options_from_tensors("fsdp", bf16_router) == [("fused_experts", 1)]
    # a dtype awex does not know says nothing; the names still decide the experts
    assert _awex.options_from_tensors("fsdp", [(n, "float8_e8m0fnu") for n, _ in live]) == [("fused_experts", 1)]
    # releases with the same rules resolve to one value
    assert _attach.resolved("fsdp", {"transformers": 525})["transformers"] == 524
    assert _attach.resolved("fsdp", {"transformers": 510})["transformers"] == 519
    assert _attach.resolved("fsdp", {})["transformers"] == 519


def test_check_tensors_names_every_tensor_whose_dtype_or_shape_differs():
    np = pytest.importorskip("numpy")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    layout = [
        {"name": "model.embed_tokens.weight", "shape": [50, 64], "dtype": "bf16"},
        {"name": "model.layers.1.mlp.gate.weight", "shape": [8, 64], "dtype": "bf16"},
        {"name": "model.layers.2.mlp.gate.weight", "shape": [8, 64], "dtype": "bf16"},
    ]
    tensors = [("model.embed_tokens.weight", np.zeros((50, 64), bf16)),
               ("model.layers.1.mlp.gate.weight", np.zeros((8, 64), np.float32)),
               ("model.layers.2.mlp.gate.weight", np.zeros((8, 64), np.float32))]
    live = {"dp": 2, "replicate": 1, "tp": 1, "transformers": 524}
    f = dict(found(live, "fsdp", "bfloat16"), tensors=tensors)
    with pytest.raises(awex.LayoutError) as e:
        _attach.check_tensors(f, "rl", "fsdp:dp=2", layout)
    assert str(e.value) == (
        "2 live tensors of this rank disagree with pair `rl`'s training layout (`fsdp:dp=2`): "
        "`model.layers.1.mlp.gate.weight` is float32 [8, 64] here but the layout needs bf16 [8, 64]; "
        "`model.layers.2.mlp.gate.weight` is float32 [8, 64] here but the layout needs bf16 [8, 64]; "
        "the live dtypes follow the rules of transformers=524 (the release the fsdp key `transformers` names, "
        "major * 100 + minor), the pair's layout those of transformers=519: "
        'connect the pair with train="fsdp:dp=2,replicate=1,tp=1,transformers=524"'
    )
    # the layout of that spec agrees
    fp32 = [dict(t, dtype="f32") if "gate" in t["name"] else t for t in layout]
    _attach.check_tensors(f, "rl", "fsdp:dp=2,transformers=524", fp32)
    # a shape is named too, without a release hint when the releases agree
    f["tensors"] = tensors[:1] + [("model.layers.1.mlp.gate.weight", np.zeros((4, 64), np.float32))]
    with pytest.raises(awex.LayoutError) as e:
        _attach.check_tensors(f, "rl", "fsdp:dp=2,transformers=524", fp32)
    assert str(e.value) == (
        "1 live tensor of this rank disagrees with pair `rl`'s training layout (`fsdp:dp=2,transformers=524`): "
        "`model.layers.1.mlp.gate.weight` is float32 [4, 64] here but the layout needs f32 [8, 64]"
    )


def test_a_transformers_release_is_no_parallel_difference():
    """check_pair leaves `transformers` to check_tensors: a model without routers is laid out
    the same under every release."""
    fs = {"dp": 2, "replicate": 1, "tp": 1, "transformers": 524}
    _attach.check_pair(found(fs, "fsdp", "bfloat16"), "rl", "fsdp:dp=2", "bf16", moe=False)


def test_mesh_roles_from_names_or_placements():
    assert _attach._mesh_roles(["replicate", "shard"], [{"R"}, {"S0"}]) == ["replicate", "dp"]
    assert _attach._mesh_roles(["dp", "tp"], [{"S0"}, {"S0", "S1", "R"}]) == ["dp", "tp"]
    assert _attach._mesh_roles([], [{"R"}, {"S0"}]) == ["replicate", "dp"]
    assert _attach._mesh_roles([], [{"S0"}, {"S0", "S1"}]) == ["dp", "tp"]
    assert _attach._mesh_roles([], [{"S0"}]) == ["dp"]


def found(parallel, backend="megatron", dtype="float32"):
    spec = backend + ":" + ",".join(f"{k}={v}" for k, v in parallel.items())
    return {"backend": backend, "parallel": parallel, "dtype": dtype, "spec": spec}


def test_a_pair_agreeing_after_defaults_is_accepted():
    live = {"tp": 2, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "etp": 2, "vpp": 1, "local_spec": 1}
    _attach.check_pair(found(live), "rl", "megatron:tp=2,local_spec=1", "f32", moe=False)
    moe = dict(live, ep=2, dp=2, etp=2, grouped_gemm=0)
    _attach.check_pair(found(moe), "rl", "megatron:tp=2,dp=2,ep=2,local_spec=1", "f32", moe=True)
    fs = {"dp": 2, "replicate": 1, "tp": 1, "fused_experts": 1}
    _attach.check_pair(found(fs, "fsdp"), "rl", "fsdp:dp=2,fused_experts=1", "f32", moe=True)


def test_a_disagreeing_pair_is_refused_naming_every_difference():
    live = {"tp": 2, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "etp": 2, "vpp": 1, "local_spec": 1}
    with pytest.raises(awex.LayoutError) as e:
        _attach.check_pair(found(live), "rl", "megatron:dp=2,local_spec=1", "f32", moe=False)
    assert str(e.value) == (
        "the live megatron job disagrees with pair `rl` (`megatron:dp=2,local_spec=1`): "
        "dp=1 here but dp=2 in the pair; tp=2 here but tp=1 in the pair; "
        'connect the pair with train="megatron:tp=2,pp=1,dp=1,cp=1,ep=1,etp=2,vpp=1,local_spec=1"'
    )
    with pytest.raises(awex.LayoutError, match=r"grouped_gemm=0 here but grouped_gemm=1 in the pair"):
        _attach.check_pair(found(dict(live, local_spec=0, grouped_gemm=0)), "rl", "megatron:tp=2", "f32", moe=True)
    with pytest.raises(awex.LayoutError, match=r"fused_experts=0 here but fused_experts=1 in the pair"):
        _attach.check_pair(found({"dp": 2}, "fsdp"), "rl", "fsdp:dp=2,fused_experts=1", "f32", moe=True)


def test_another_backend_or_dtype_is_refused():
    with pytest.raises(awex.LayoutError) as e:
        _attach.check_pair(found({"dp": 2}, "fsdp"), "rl", "megatron:tp=2", "f32", moe=False)
    assert str(e.value) == (
        "this process runs a fsdp model, but pair `rl` describes its training side as `megatron:tp=2`; "
        'connect the pair with train="fsdp:dp=2"'
    )
    live = {"tp": 1, "local_spec": 1}
    with pytest.raises(awex.LayoutError) as e:
        _attach.check_pair(found(live), "rl", "megatron:local_spec=1", "bf16", moe=False)
    assert str(e.value) == (
        "the live parameters are float32 but pair `rl`'s training layout needs bf16 "
        "(fp32=1 says the trainer keeps fp32 parameters of a lower-precision model)"
    )


def test_attach_needs_torch_distributed():
    torch = pytest.importorskip("torch")
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        awex.Writer.attach(torch.nn.Linear(2, 2), "http://127.0.0.1:1", "rl")


# ---- DeepSeek-V3 (multi-latent attention) on the training side ----

DEEPSEEK_TINY = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


class _Mod:
    def __init__(self, params, buffers):
        self._params, self._buffers, self._non_persistent_buffers_set = params, buffers, set()

    def named_parameters(self, recurse=True):
        return iter(self._params.items())


class _Tree:
    """A torch-like module tree holding exactly `names` (``expert_bias`` as a buffer)."""

    def __init__(self, names):
        self._mods = {}
        for n in names:
            prefix, leaf = n.rsplit(".", 1)
            params, buffers = self._mods.setdefault(prefix, ({}, {}))
            (buffers if leaf == "expert_bias" else params)[leaf] = n

    def named_modules(self):
        return ((p, _Mod(params, buffers)) for p, (params, buffers) in self._mods.items())

    def named_parameters(self):
        for p, (params, _) in self._mods.items():
            for leaf, v in params.items():
                yield f"{p}.{leaf}", v


@pytest.mark.parametrize("local_spec", [1, 0])
def test_megatron_attach_finds_every_deepseek_tensor_awex_lays_out(gateway, pair_name, local_spec):
    """Every name of a Megatron rank's DeepSeek-V3 layout (from the Rust backend, MLA's
    projections and latent norms, the router's expert_bias buffer) is found by
    ``megatron.named_tensors`` in the layout's order, and the names read back the layer spec
    (MLA's input_layernorm is a module under Transformer Engine too)."""
    train = f"megatron:tp=2,ep=2,etp=1,local_spec={local_spec}"
    ctl = awex.Controller(gateway)
    ctl.connect(pair_name, model=DEEPSEEK_TINY, train=train, infer="megatron:tp=1,local_spec=1", transport="shm")
    try:
        for rank in range(2):
            with awex.Writer(gateway, pair_name, rank) as w:
                names = [t["name"] for t in w.layout()]
            assert "decoder.layers.1.mlp.router.expert_bias" in names
            assert any(n.endswith("self_attention.linear_kv_up_proj.weight") for n in names)
            found = [n for n, _ in awex.megatron.named_tensors(_Tree(names))]
            assert found == names
            assert _attach._names_spec(names) == {"local_spec": local_spec, "grouped_gemm": 1 - local_spec}
    finally:
        ctl.disconnect()
