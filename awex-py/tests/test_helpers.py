"""Engine helpers (names as each awex backend expects them), specs, detection."""

from __future__ import annotations

import numpy as np

import pytest

import awex


class Module:
    """A stand-in for torch.nn.Module: named_parameters() over a dict."""

    def __init__(self, params: dict[str, object]) -> None:
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())


class DTensorLike:
    """A stand-in for a DTensor parameter: to_local() is this rank's shard."""

    def __init__(self, local: np.ndarray) -> None:
        self._local = local

    def to_local(self) -> np.ndarray:
        return self._local


def test_megatron_strips_wrapper_prefixes_and_prefixes_vpp_chunks():
    a, b, c = np.zeros(1), np.zeros(2), np.zeros(3)
    wrapped = Module({"module.module.decoder.layers.0.input_layernorm.weight": a,
                      "module.module.embedding.word_embeddings.weight": b})
    assert awex.megatron.named_tensors(wrapped) == [
        ("decoder.layers.0.input_layernorm.weight", a),
        ("embedding.word_embeddings.weight", b),
    ]
    chunks = [Module({"module.decoder.layers.0.mlp.linear_fc1.weight": a}),
              Module({"module.decoder.layers.0.mlp.linear_fc1.weight": c})]
    assert awex.megatron.named_tensors(chunks) == [
        ("model0.decoder.layers.0.mlp.linear_fc1.weight", a),
        ("model1.decoder.layers.0.mlp.linear_fc1.weight", c),
    ]
    # a single chunk in a list is a plain model
    assert awex.megatron.named_tensors([wrapped])[0][0] == "decoder.layers.0.input_layernorm.weight"


def test_fsdp_takes_local_shards_under_hf_names():
    shard = np.zeros((3, 4))
    plain = np.zeros(4)
    m = Module({"model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight": DTensorLike(shard),
                "_orig_mod.model.norm.weight": plain})
    out = awex.fsdp.named_tensors(m)
    assert [n for n, _ in out] == ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    assert out[0][1] is shard and out[1][1] is plain


class Tree:
    """A stand-in for a torch module tree: named_modules() over (prefix, module), each module
    with its own named_parameters(recurse=False), torch's ``_buffers`` and
    ``_non_persistent_buffers_set``; named_parameters() over the whole tree."""

    def __init__(self, modules: dict[str, tuple[dict, dict, set]]) -> None:
        self._mods = []
        for prefix, (params, buffers, skip) in modules.items():
            m = Module(params)
            m.named_parameters = lambda recurse=True, params=params: iter(params.items())
            m._buffers = buffers
            m._non_persistent_buffers_set = skip
            self._mods.append((prefix, m))

    def named_modules(self):
        return iter(self._mods)

    def named_parameters(self):
        for prefix, m in self._mods:
            for name, p in m.named_parameters(recurse=False):
                yield (f"{prefix}.{name}" if prefix else name), p


def test_fsdp_adds_the_persistent_buffers_a_checkpoint_stores_after_their_module():
    w, s, bias, inv, norm = np.zeros((8, 4)), np.zeros((2, 4)), np.zeros(8, np.float32), np.zeros(2), np.zeros(4)
    m = Tree({
        "": ({}, {}, set()),
        "_orig_mod.model.rotary_emb": ({}, {"inv_freq": inv, "original_inv_freq": None}, {"inv_freq"}),
        "model.layers.1.mlp.gate": ({"weight": DTensorLike(w)}, {"e_score_correction_bias": bias}, set()),
        "model.layers.1.mlp.shared_experts.gate_proj": ({"weight": s}, {}, set()),
        "model.norm": ({"weight": norm}, {}, set()),
    })
    out = awex.fsdp.named_tensors(m)
    assert [n for n, _ in out] == [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.norm.weight",
    ]
    assert out[0][1] is w and out[1][1] is bias


def test_megatron_adds_the_routers_expert_bias_buffer_after_its_weight():
    w, fc1, bias, other = np.zeros((8, 4)), np.zeros((4, 4)), np.zeros(8, np.float32), np.zeros(8)
    m = Tree({
        "module.decoder.layers.1.mlp.router": ({"weight": w}, {"expert_bias": bias, "local_tokens_per_expert": other},
                                               {"local_tokens_per_expert"}),
        "module.decoder.layers.1.mlp.shared_experts.linear_fc1": ({"weight": fc1}, {}, set()),
    })
    out = awex.megatron.named_tensors([m, Module({})])
    assert out == [("model0.decoder.layers.1.mlp.router.weight", w),
                   ("model0.decoder.layers.1.mlp.router.expert_bias", bias),
                   ("model0.decoder.layers.1.mlp.shared_experts.linear_fc1.weight", fc1)]


def test_sglang_accepts_the_model_or_its_runner():
    w = np.zeros(2)
    model = Module({"model.layers.0.self_attn.qkv_proj.weight": w})

    class Runner:
        def __init__(self, model):
            self.model = model

    assert awex.sglang.named_tensors(model) == [("model.layers.0.self_attn.qkv_proj.weight", w)]
    assert awex.sglang.named_tensors(Runner(model)) == [("model.layers.0.self_attn.qkv_proj.weight", w)]
    try:
        awex.sglang.named_tensors(object())
    except TypeError as e:
        assert "expected an SGLang model" in str(e)
    else:
        raise AssertionError("an object without parameters was accepted")


def test_spec_formats_backend_and_parallel_keys():
    assert awex.spec("megatron", tp=2, pp=2) == "megatron:tp=2,pp=2"
    assert awex.spec("sglang", {"tp": 4}, engines=2) == "sglang:tp=4,engines=2"
    assert awex.spec("fsdp") == "fsdp"


def test_spec_refuses_an_unknown_backend_like_the_cli():
    with pytest.raises(awex.LayoutError) as e:
        awex.spec("megatorn", tp=2)
    assert str(e.value) == (
        "no backend named `megatorn`; registered: training fsdp, megatron; inference megatron, sglang, vllm"
    )


def test_detect_scores_every_linked_backend():
    report = awex.detect()
    assert sorted(v["backend"] for v in report["training"]) == ["fsdp", "megatron"]
    assert sorted(v["backend"] for v in report["inference"]) == ["sglang", "vllm"]
    for v in report["training"] + report["inference"]:
        assert 0.0 <= v["score"] <= 1.0
        assert isinstance(v["evidence"], list)
        assert isinstance(v["not_found"], list)  # what it looked for and did not find
    assert any(v["not_found"] for v in report["training"])


def test_package_exports_its_api():
    for name in ["Writer", "Reader", "Controller", "detect", "LayoutError", "UpdateFailed",
                 "Disconnected", "GatewayError", "AwexError", "megatron", "fsdp", "sglang", "vllm"]:
        assert hasattr(awex, name), name
    assert issubclass(awex.LayoutError, awex.AwexError) and issubclass(awex.LayoutError, ValueError)
    assert awex.__version__ == "0.1.0"
