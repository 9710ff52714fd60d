"""`awex.vllm`'s landing tensors and `load_landed` against vLLM 0.33.0's own layerwise reload
(`vllm/model_executor/model_loader/reload/`), on a one-layer model whose post-load step replaces
its weight, as vLLM's CPU platform does to every unquantised linear layer
(`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`, `model_executor/layers/utils.py`).

The model is built the way vLLM's `initialize_model` leaves one (`record_metadata_for_reloading`
right after the constructor) and loaded the way its loader does (weights, then
`process_weights_after_loading`)."""

from __future__ import annotations

import types

import pytest
import torch

from test_plugin import load_plugin

W0 = torch.arange(12, dtype=torch.float32).reshape(4, 3)
W1 = -torch.arange(12, dtype=torch.float32).reshape(4, 3) - 0.5


def tp_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Stands for a parameter's own loader, which cuts a checkpoint tensor to the rank (never a
    shard the receiver already holds): here it takes the first half of the rows."""
    param.data.copy_(loaded_weight[: param.shape[0]])


def model(fail: bool = False, scale: float | None = None, vllm_parameter: bool = False) -> torch.nn.Module:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    class Prepack(QuantizeMethodBase):
        """The post-load step of vLLM's CPU platform, in effect: the kernel keeps a packed copy
        (a plain attribute, as `layer.cpu_linear`'s closure is) and `weight` becomes empty."""

        def create_weights(self, layer, *args, **kwargs):  # noqa: ANN001
            pass

        def apply(self, layer, x, bias=None):  # noqa: ANN001
            return x @ layer.packed.t()

        fails = False

        def process_weights_after_loading(self, layer) -> None:  # noqa: ANN001
            if self.fails:
                raise RuntimeError("the post-load step failed")
            if scale is not None:
                # a post-load step that transforms the loaded weight in place first (as
                # quantised methods rescale theirs)
                layer.weight.data.mul_(scale)
            layer.packed = layer.weight.detach().clone()
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)

    class Proj(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if vllm_parameter:
                # vLLM's own parameter class (its linear layers' weights): the loader is a
                # property, kept in `_weight_loader` (`vllm/model_executor/parameter.py`)
                from vllm.model_executor.parameter import BasevLLMParameter

                self.weight = BasevLLMParameter(data=torch.empty(4, 3), weight_loader=tp_loader)
            else:
                self.weight = torch.nn.Parameter(torch.empty(4, 3), requires_grad=False)
                self.weight.weight_loader = tp_loader
            self.quant_method = Prepack()

    m = torch.nn.Module()
    m.proj = Proj()
    record_metadata_for_reloading(m)
    m.proj.weight.data.copy_(W0)
    m.proj.quant_method.process_weights_after_loading(m.proj)
    m.proj.quant_method.fails = fail  # from the next load on
    return m


LAYOUT = [{"name": "proj.weight", "shape": [4, 3], "dtype": "f32", "placements": []}]
CONFIG = types.SimpleNamespace(dtype=torch.float32)


def test_in_place_receive_meets_an_empty_weight_where_the_post_load_step_replaced_it() -> None:
    # what awex's engine registered before it received through the reload: the live parameter
    plugin = load_plugin()
    assert dict((n, tuple(t.shape)) for n, t in plugin.named_tensors(model())) == {"proj.weight": (0,)}


def test_landing_tensors_take_the_shape_vllm_loads_in_and_start_zeroed() -> None:
    plugin = load_plugin()
    landing = plugin.landing_tensors(LAYOUT, model(), "cpu")
    assert tuple(landing["proj.weight"].shape) == (4, 3) and not landing["proj.weight"].any()


def test_landing_tensors_refuse_a_layout_that_differs_from_what_vllm_loads() -> None:
    plugin = load_plugin()
    wrong = [dict(LAYOUT[0], shape=[2, 3])]
    with pytest.raises(ValueError, match=r"vLLM loads `proj.weight` as torch.float32 \[4, 3\], but the pair's layout says torch.float32 \[2, 3\]"):
        plugin.landing_tensors(wrong, model(), "cpu")
    with pytest.raises(ValueError, match="`proj.bias`, which is not a parameter of the served model"):
        plugin.landing_tensors([dict(LAYOUT[0], name="proj.bias")], model(), "cpu")


@pytest.mark.parametrize("vllm_parameter", [False, True], ids=["parameter", "vllm-parameter"])
def test_load_landed_reruns_the_post_load_step_into_the_live_layer_and_keeps_its_loader(
        vllm_parameter: bool, monkeypatch) -> None:  # noqa: ANN001
    plugin = load_plugin()
    # BasevLLMParameter asks the TP group for its rank; one rank here, no group
    monkeypatch.setattr("vllm.model_executor.parameter.get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr("vllm.model_executor.parameter.get_tensor_model_parallel_world_size", lambda: 1)
    m = model(vllm_parameter=vllm_parameter)
    live = m.proj.weight
    landing = plugin.landing_tensors(LAYOUT, m, "cpu")
    landing["proj.weight"].copy_(W1)
    plugin.load_landed(m, CONFIG, landing)
    assert torch.equal(m.proj.packed, W1)  # what the kernel computes with is the new version
    assert m.proj.weight is live and tuple(live.shape) == (0,)  # the live parameter object stays
    # a second version goes the same way
    landing["proj.weight"].copy_(W1 * 2)
    plugin.load_landed(m, CONFIG, landing)
    assert torch.equal(m.proj.packed, W1 * 2)
    # vLLM's own reload from a checkpoint still cuts with the parameter's own loader afterwards
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(m)
    m.proj.weight.weight_loader(m.proj.weight, torch.cat([W0, W1]))
    finalize_layerwise_reload(m, CONFIG)
    assert torch.equal(m.proj.packed, W0)


def test_load_landed_only_reads_the_landing_tensors_so_they_hold_the_version_received() -> None:
    # delta updates apply to the landing tensors against the version they held after the last
    # update (awex.vllm's Reader takes deltas): vLLM's reload must copy out of them, never alias
    # or transform them, even where the post-load step changes the loaded weight in place
    plugin = load_plugin()
    m = model(scale=2.0)
    landing = plugin.landing_tensors(LAYOUT, m, "cpu")
    landing["proj.weight"].copy_(W1)
    plugin.load_landed(m, CONFIG, landing)
    assert torch.equal(m.proj.packed, W1 * 2)  # the post-load step ran on the new version
    assert torch.equal(landing["proj.weight"], W1)  # and the landing tensor still holds it
    ptr = landing["proj.weight"].data_ptr()
    assert all(t.data_ptr() != ptr for t in [*m.parameters(), *m.buffers(), m.proj.packed])
    # a delta against it (one element changed) lands as the full version would
    landing["proj.weight"][2, 1] = 42.0
    plugin.load_landed(m, CONFIG, landing)
    want = W1.clone()
    want[2, 1] = 42.0
    assert torch.equal(m.proj.packed, want * 2) and torch.equal(landing["proj.weight"], want)


def test_the_deltas_setting_is_read_from_the_environment(monkeypatch) -> None:  # noqa: ANN001
    plugin = load_plugin()
    monkeypatch.delenv("AWEX_VLLM_DELTAS", raising=False)
    assert plugin._deltas_from_env() is True
    monkeypatch.setenv("AWEX_VLLM_DELTAS", "0")
    assert plugin._deltas_from_env() is False
    monkeypatch.setenv("AWEX_VLLM_DELTAS", "yes")
    with pytest.raises(RuntimeError, match=r"AWEX_VLLM_DELTAS='yes': 1 \(take delta updates, the default\) or 0"):
        plugin._deltas_from_env()


def test_load_landed_leaves_no_layer_on_the_meta_device_when_the_post_load_step_fails() -> None:
    plugin = load_plugin()
    m = model(fail=True)
    landing = plugin.landing_tensors(LAYOUT, m, "cpu")
    with pytest.raises(RuntimeError, match="the post-load step failed"):
        plugin.load_landed(m, CONFIG, landing)
    assert not any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
    assert torch.equal(m.proj.packed, W0)  # still the version it served


def fp8_model() -> torch.nn.Module:
    """A block-FP8 linear layer as vLLM's ``Fp8LinearMethod.create_weights`` leaves one
    (``weight`` e4m3, fp32 ``weight_scale_inv`` of 16 x 16 blocks), recorded for reloading."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    m = torch.nn.Module()
    m.proj = torch.nn.Module()
    m.proj.weight = torch.nn.Parameter(torch.zeros(32, 16, dtype=torch.float8_e4m3fn), requires_grad=False)
    m.proj.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 1), requires_grad=False)
    record_metadata_for_reloading(m)
    return m


FP8_LAYOUT = [{"name": "proj.weight", "shape": [32, 16], "dtype": "f8e4m3", "placements": []},
              {"name": "proj.weight_scale_inv", "shape": [2, 1], "dtype": "f32", "placements": []}]


def test_landing_tensors_hold_vllm_s_fp8_weights_and_scales() -> None:
    plugin = load_plugin()
    landing = plugin.landing_tensors(FP8_LAYOUT, fp8_model(), "cpu")
    assert landing["proj.weight"].dtype == torch.float8_e4m3fn and tuple(landing["proj.weight"].shape) == (32, 16)
    assert landing["proj.weight_scale_inv"].dtype == torch.float32


def test_landing_tensors_refuse_a_pair_whose_fp8_encoding_differs_from_the_served_model() -> None:
    plugin = load_plugin()
    # a bf16 pair against an FP8 server
    plain = [dict(FP8_LAYOUT[0], dtype="bf16")]
    with pytest.raises(ValueError, match=r"the served model is block FP8\), but the pair's layout says torch.bfloat16 .*infer_config="):
        plugin.landing_tensors(plain, fp8_model(), "cpu")
    # an FP8 pair against a bf16 server: its scales name no parameter
    m = torch.nn.Module()
    m.proj = torch.nn.Module()
    m.proj.weight = torch.nn.Parameter(torch.zeros(32, 16, dtype=torch.bfloat16), requires_grad=False)
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    record_metadata_for_reloading(m)
    with pytest.raises(ValueError, match=r"FP8 block scales `proj.weight_scale_inv`, but the served model holds no such parameter"):
        plugin.landing_tensors(FP8_LAYOUT, m, "cpu")
    # another block size: the scales' shape
    other = [FP8_LAYOUT[0], dict(FP8_LAYOUT[1], shape=[1, 1])]
    with pytest.raises(ValueError, match="block size differs from the served checkpoint's weight_block_size"):
        plugin.landing_tensors(other, fp8_model(), "cpu")


# A CPU MoE layer: vLLM's own `UnquantizedFusedMoEMethod` (its `process_weights_after_loading`
# and `_setup_kernel`, `fused_moe/unquantized_fused_moe_method.py`) with CPU experts whose
# post-load step stands in for `CPUUnquantizedExperts.process_weights_after_loading`
# (`fused_moe/experts/cpu_moe.py`: `cpu_prepack_moe_weight`, a same-shaped tensor in the
# grouped-gemm kernel's element order; the op itself is in vLLM's CPU build only). The kernel
# object is what `_init_moe_kernel` leaves, reduced to the `fused_experts` the method reads.
E, I, H = 2, 4, 3
W13_0 = torch.arange(E * 2 * I * H, dtype=torch.float32).reshape(E, 2 * I, H)
W2_0 = torch.arange(E * H * I, dtype=torch.float32).reshape(E, H, I) + 0.5


def prepacked(w: torch.Tensor) -> torch.Tensor:
    """The stand-in prepack: another element order, the same shape."""
    return w.flip(-1).contiguous()


def moe_model() -> torch.nn.Module:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.utils import replace_parameter

    class Experts(CPUUnquantizedExperts):
        def __init__(self) -> None:  # the modular kernel's config is not needed here
            pass

        def process_weights_after_loading(self, layer) -> None:  # noqa: ANN001
            replace_parameter(layer, "w13_weight", prepacked(layer.w13_weight))
            replace_parameter(layer, "w2_weight", prepacked(layer.w2_weight))

    class Method(UnquantizedFusedMoEMethod):
        def __init__(self) -> None:  # the CPU backend, as select_unquantized_moe_backend picks on CPU
            torch.nn.Module.__init__(self)
            self.unquantized_backend = UnquantizedMoeBackend.CPU
            self.moe_kernel = None

        def _init_moe_kernel(self, layer) -> None:  # noqa: ANN001
            self.moe_kernel = types.SimpleNamespace(fused_experts=Experts())

    class RoutedExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
            self.w2_weight = torch.nn.Parameter(torch.empty(E, H, I), requires_grad=False)
            self.moe_config = None
            self.quant_method = Method()

    m = torch.nn.Module()
    m.experts = RoutedExperts()
    record_metadata_for_reloading(m)
    m.experts.w13_weight.data.copy_(W13_0)
    m.experts.w2_weight.data.copy_(W2_0)
    m.experts.quant_method.process_weights_after_loading(m.experts)  # the first load
    return m


MOE_LAYOUT = [{"name": "experts.w13_weight", "shape": [E, 2 * I, H], "dtype": "f32", "placements": []},
              {"name": "experts.w2_weight", "shape": [E, H, I], "dtype": "f32", "placements": []}]


def test_vllm_own_reload_leaves_a_cpu_moe_layer_unpacked() -> None:
    # the engine's fault awex.vllm works around: on a reload `_setup_kernel` sees a kernel and
    # skips the experts' step, so plain weights land in the storage the kernel reads as packed
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    m = moe_model()
    assert torch.equal(m.experts.w13_weight, prepacked(W13_0))  # the first load packs
    initialize_layerwise_reload(m)
    m.experts.w13_weight.weight_loader(m.experts.w13_weight, W13_0 * 2)
    m.experts.w2_weight.weight_loader(m.experts.w2_weight, W2_0 * 2)
    finalize_layerwise_reload(m, CONFIG)
    assert torch.equal(m.experts.w13_weight, W13_0 * 2), (
        "vLLM's reload now packs the CPU experts: awex.vllm._experts_post_load_on_update no longer runs "
        "the step (it runs it only where the engine did not), and docs/vllm.md's note on the fault can go")


def test_load_landed_runs_the_cpu_experts_post_load_step_that_vllm_skips_on_a_reload() -> None:
    plugin = load_plugin()
    m = moe_model()
    live13, live2 = m.experts.w13_weight, m.experts.w2_weight
    qm = m.experts.quant_method
    experts = qm.moe_kernel.fused_experts
    landing = plugin.landing_tensors(MOE_LAYOUT, m, "cpu")
    for v in (1, 2):  # a second update goes the same way
        landing["experts.w13_weight"].copy_(W13_0 * (v + 1))
        landing["experts.w2_weight"].copy_(W2_0 * (v + 1))
        plugin.load_landed(m, CONFIG, landing)
        assert torch.equal(m.experts.w13_weight, prepacked(W13_0 * (v + 1)))
        assert torch.equal(m.experts.w2_weight, prepacked(W2_0 * (v + 1)))
        # into the live storage, with the same kernel; the landing tensors keep the plain version
        assert m.experts.w13_weight is live13 and m.experts.w2_weight is live2
        assert qm.moe_kernel.fused_experts is experts
        assert torch.equal(landing["experts.w13_weight"], W13_0 * (v + 1))
        # nothing of the fix stays on the method after the update
        assert "_setup_kernel" not in qm.__dict__ and "process_weights_after_loading" not in experts.__dict__


def test_load_landed_does_not_pack_twice_where_the_engine_runs_the_experts_step_on_a_reload() -> None:
    # a vLLM that runs the experts' step on updates too: awex.vllm leaves it to the engine
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    plugin = load_plugin()
    m = moe_model()
    qm = m.experts.quant_method

    def setup_kernel_fixed(self, layer, w13, w2) -> None:  # noqa: ANN001
        UnquantizedFusedMoEMethod._setup_kernel(self, layer, w13, w2)
        self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    type(qm)._setup_kernel = setup_kernel_fixed
    landing = plugin.landing_tensors(MOE_LAYOUT, m, "cpu")
    landing["experts.w13_weight"].copy_(W13_0 * 3)
    landing["experts.w2_weight"].copy_(W2_0 * 3)
    plugin.load_landed(m, CONFIG, landing)
    assert torch.equal(m.experts.w13_weight, prepacked(W13_0 * 3))
    assert torch.equal(m.experts.w2_weight, prepacked(W2_0 * 3))
