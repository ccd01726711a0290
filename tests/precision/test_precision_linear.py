"""MXLinear and convert(): accuracy of the three quantized GEMMs, the fused norm, checkpoints, conversion rules."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from torch import nn

import lightning_gem.precision.linear as mx_linear
from lightning_gem.precision import MXConfig, MXLinear, MXRMSNorm, convert, converted_layers, resolve_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["mx_emulated", "fp8_blockwise", "fp8_rowwise"]
IN, OUT = 512, 1024  # multiples of 512: cuBLAS's blockwise GEMMs take these widths (see ops.mx.gemm)


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected, actual = expected.detach().double(), actual.detach().double()
    return float(10 * torch.log10(expected.pow(2).sum() / (actual - expected).pow(2).sum()))


def _pair(config: MXConfig, norm: bool = True) -> tuple[nn.Module, nn.Module]:
    layers = [nn.RMSNorm(IN)] if norm else []
    reference = nn.Sequential(*layers, nn.Linear(IN, OUT)).to(DEVICE)
    return reference, convert(copy.deepcopy(reference), config)


def _run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return out.detach(), x.grad, model[-1].weight.grad, model[-1].bias.grad


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sqnr_against_fp32(backend: str, hadamard: bool) -> None:
    reference, model = _pair(MXConfig(backend=backend, hadamard=hadamard), norm=False)
    x = torch.randn(300, IN, device=DEVICE)
    grad = torch.randn(300, OUT, device=DEVICE)
    out, dx, dw, db = _run(model, x, grad)
    ref_out, ref_dx, ref_dw, ref_db = _run(reference, x, grad)
    assert sqnr_db(out, ref_out) >= 27 and sqnr_db(dx, ref_dx) >= 25 and sqnr_db(dw, ref_dw) >= 24
    torch.testing.assert_close(db, ref_db)  # the bias gradient is not quantized


@pytest.mark.parametrize("backend", ["mx_emulated", "fp8_blockwise"])
def test_fused_norm_is_the_unfused_computation(backend: str) -> None:
    reference, fused = _pair(MXConfig(backend=backend))
    unfused = convert(copy.deepcopy(reference), MXConfig(backend=backend, fuse_norm=False))
    assert isinstance(fused[0], MXRMSNorm) and type(unfused[0]) is nn.RMSNorm
    x, grad = torch.randn(200, IN, device=DEVICE) * 3, torch.randn(200, OUT, device=DEVICE)
    fused_out = _run(fused, x, grad)
    unfused_out = _run(unfused, x, grad)
    assert torch.equal(fused_out[0], unfused_out[0]), "same quantized operands: identical forward"
    for a, b in zip(fused_out[1:], unfused_out[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused[0].weight.grad, unfused[0].weight.grad, rtol=1e-4, atol=1e-5)


def _norm_kernels_can_run() -> bool:
    from lightning_gem.ops._launch import is_interpreted
    from lightning_gem.ops.pointwise.impl.triton.kernels import _norm_mul_bwd_kernel

    return torch.cuda.is_available() or is_interpreted(_norm_mul_bwd_kernel)


@pytest.mark.parametrize("norm", [nn.RMSNorm(96), nn.LayerNorm(96), nn.LayerNorm(96, bias=False)], ids=repr)
def test_fused_norm_backward_kernel_is_the_eager_formula(norm: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused norm's backward in one kernel pass (CUDA's path; on CPU under Triton's interpreter) gives the eager
    formula's gradients: input, weight and bias, an fp32 residual stream under a bf16 output."""
    import lightning_gem.precision.norm as mx_norm

    if not _norm_kernels_can_run():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.normal_()
        if getattr(norm, "bias", None) is not None:
            norm.bias.normal_()
    reference = nn.Sequential(norm, nn.Linear(96, 64)).to(DEVICE)
    x, grad = torch.randn(130, 96, device=DEVICE) * 3 + 1, torch.randn(130, 64, device=DEVICE)

    def grads() -> list[torch.Tensor]:
        model = convert(copy.deepcopy(reference), MXConfig(backend="mx_emulated"))
        assert isinstance(model[0], (mx_norm.MXRMSNorm, mx_norm.MXLayerNorm))
        xi = x.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = model(xi)
        out.float().backward(grad)
        return [xi.grad, *(p.grad for p in model[0].parameters())]

    monkeypatch.setattr(mx_norm, "_norm_kernels_run", lambda x: True)  # on CPU: the kernel under the interpreter
    kernel = grads()
    monkeypatch.setattr(mx_norm, "_norm_kernels_run", lambda x: False)
    for a, b in zip(kernel, grads(), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "eager"])
def test_fused_norm_takes_the_residual_gradient(kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``forward_residual``: ``x + linear(norm(x))`` with the residual taken from the norm's second output has the
    gradients of the unfused block (the residual's gradient added into the norm's ``dx`` by its backward), and a
    residual alone (the norm's output unused) passes its gradient through."""
    import lightning_gem.precision.norm as mx_norm

    if kernels and not _norm_kernels_can_run():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setattr(mx_norm, "_norm_kernels_run", lambda x: kernels)
    reference, fused = _pair(MXConfig(backend="mx_emulated"))
    unfused = convert(copy.deepcopy(reference), MXConfig(backend="mx_emulated", fuse_norm=False))
    x0 = torch.randn(120, IN, device=DEVICE) * 3

    def grads(model: nn.Module, residual_only: bool = False) -> list[torch.Tensor]:
        x = x0.clone().requires_grad_()
        norm, linear = model[0], model[1]
        h, r = norm.forward_residual(x) if hasattr(norm, "forward_residual") else (norm(x), x)
        out = r * 2 if residual_only else r + linear(h)[:, :IN]
        out.pow(2).sum().backward()
        return [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]

    for a, b in zip(grads(fused), grads(unfused), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads(copy.deepcopy(fused), True)[0], grads(unfused, True)[0])


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "eager"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fused_norm_writes_its_input_copy_for_quantized_saves(
    kind: str, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a saved-activation context the fused norm writes its input's MX copy from its own read (no quantize
    pass of its own), and its backward and the Linear's weight gradient read the copy (no dequantize pass): the
    gradients equal, bit for bit, those of the context quantizing and dequantizing the input itself."""
    import lightning_gem.ops.mx.api as mx_api
    import lightning_gem.ops.mx.saved as saved_module
    import lightning_gem.precision.norm as mx_norm
    from lightning_gem.ops.mx.saved import QuantizedSavedTensors

    if kernels and not _norm_kernels_can_run():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setattr(mx_norm, "_norm_kernels_run", lambda x: kernels)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.RMSNorm(96) if kind == "rms" else nn.LayerNorm(96), nn.Linear(96, 64)).to(DEVICE)
    x0, grad = torch.randn(130, 96, device=DEVICE) * 3 + 1, torch.randn(130, 96, device=DEVICE)
    quantized, restored = [], []
    quantize = mx_api.quantize
    monkeypatch.setattr(
        mx_api, "quantize", lambda x, layout, **kw: quantized.append(layout) or quantize(x, layout, **kw)
    )
    restore = saved_module._Quantized.restore
    monkeypatch.setattr(saved_module._Quantized, "restore", lambda self: restored.append(self.shape) or restore(self))

    def grads() -> tuple[list[torch.Tensor], int, int]:
        model = convert(copy.deepcopy(reference), MXConfig(backend="mx_emulated"))
        x = x0.clone().requires_grad_()
        quantized.clear()
        restored.clear()
        with QuantizedSavedTensors(min_elements=0) as saved, torch.autocast(DEVICE, dtype=torch.bfloat16):
            h, residual = model[0].forward_residual(x * 1)  # an activation (a leaf would count as a parameter)
            out = residual + model[1](h).float().repeat(1, 2)[:, :96]
        out.backward(grad)
        assert saved.stats.tensors >= 1
        return [x.grad, *(p.grad for p in model.parameters())], quantized.count("mx"), len(restored)

    written, mx_passes, written_reads = grads()
    monkeypatch.setattr(mx_norm, "saves_quantized", lambda x: None)  # the context quantizes x by itself
    hooked, hook_passes, hooked_reads = grads()
    assert hook_passes == mx_passes + 1  # x's copy came from the norm's kernel, not from a pass of its own
    # the norm's and the Linear's saves of x read back from the context (one dequantize pass), or neither: both
    # read the copy they saved
    assert (written_reads, hooked_reads) == (0, 2)
    for a, b in zip(written, hooked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_quantize_transposed_reads_an_input_copy_as_its_values(kind: str) -> None:
    """The weight gradient's operand rebuilt from the norm input's MX copy equals, bit for bit, the one rebuilt from
    the copy's values (the Triton kernel decoding the copy under the interpreter; the reference dequantizing it)."""
    from lightning_gem.ops.mx import dequantize, norm_quantize, norm_quantize_transposed

    x = torch.randn(150, 256) * 3 + 0.5
    weight, bias = torch.rand(256) + 0.5, torch.randn(256) if kind == "layer" else None
    out = norm_quantize(x, weight, bias, kind=kind, layout="1x128", save_input=True)
    values = dequantize(out.x_mx, torch.float32, impl="reference")
    for layout in ("1x128", "mx"):
        for impl in ("triton", "reference"):
            args = (out.rstd, out.mean, weight, bias)
            kwargs = dict(kind=kind, layout=layout, out_dtype=torch.bfloat16, impl=impl)
            got = norm_quantize_transposed(out.x_mx, *args, **kwargs)
            want = norm_quantize_transposed(values, *args, **kwargs)
            assert got.shape == want.shape == (256, 256 if layout == "1x128" else 160)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (layout, impl)
            assert torch.equal(got.scale, want.scale), (layout, impl)
    with pytest.raises(ValueError, match="out_dtype"):
        norm_quantize_transposed(out.x_mx, out.rstd, out.mean, weight, bias, kind=kind, layout="1x128")


def test_norm_quantize_writes_the_input_copy_the_mx_quantizer_writes() -> None:
    from lightning_gem.ops.mx import norm_quantize, quantize

    x = torch.randn(70, 160) * torch.logspace(-3, 3, 70)[:, None]
    x[3, 40] = float("inf")  # a block with a non-finite value: the copy marks it as the quantizer does
    expected = quantize(x, "mx", rounding="rceil", impl="reference")[0]
    for impl in ("triton", "reference"):
        for layout in ("1x128", "mx"):
            if layout == "1x128":
                xi = x[:, :128].contiguous()
                want = quantize(xi, "mx", rounding="rceil", impl="reference")[0]
            else:
                xi, want = x, expected
            out = norm_quantize(xi, torch.rand(xi.shape[1]), layout=layout, save_input=True, impl=impl)
            assert torch.equal(out.x_mx.data.view(torch.uint8), want.data.view(torch.uint8)), (impl, layout)
            assert torch.equal(out.x_mx.scale, want.scale), (impl, layout)
            assert norm_quantize(xi, layout=layout, impl=impl).x_mx is None
    with pytest.raises(ValueError, match="save_input"):
        norm_quantize(torch.randn(4, 48), layout="rowwise", save_input=True)


def test_fused_norm_output_read_elsewhere_stays_correct() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(64)
            self.proj = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            return self.proj(h * 2) + h  # the Linear reads another tensor: the handoff must not be used

    reference = Branchy().to(DEVICE)
    model = convert(copy.deepcopy(reference), MXConfig(backend="mx_emulated"))
    assert isinstance(model.norm, MXRMSNorm)
    x = torch.randn(50, 64, device=DEVICE)
    assert sqnr_db(model(x), reference(x)) > 27


def test_input_shapes_and_autocast() -> None:
    _, model = _pair(MXConfig(backend="mx_emulated"), norm=False)
    x = torch.randn(2, 7, IN, device=DEVICE)
    assert model(x).shape == (2, 7, OUT)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    empty = torch.randn(0, IN, device=DEVICE, requires_grad=True)
    model(empty).sum().backward()
    assert empty.grad.shape == (0, IN)


def test_saved_activations_fp8_or_high_precision_give_the_same_gradients() -> None:
    x, grad = torch.randn(100, IN, device=DEVICE), torch.randn(100, OUT, device=DEVICE)
    _, fp8 = _pair(MXConfig(backend="fp8_blockwise", quantize_saved_activations=True), norm=False)
    _, high = _pair(MXConfig(backend="fp8_blockwise", quantize_saved_activations=False), norm=False)
    high.load_state_dict(fp8.state_dict())
    for a, b in zip(_run(fp8, x, grad), _run(high, x, grad), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_round_trip() -> None:
    reference, model = _pair(MXConfig(recipe="mxfp8"))
    assert list(model.state_dict()) == list(reference.state_dict())  # same keys as the plain model
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = convert(nn.Sequential(nn.RMSNorm(IN), nn.Linear(IN, OUT)).to(DEVICE), MXConfig(recipe="mxfp8"))
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    x = torch.randn(20, IN, device=DEVICE)
    assert torch.equal(fresh(x), model(x))
    plain = nn.Sequential(nn.RMSNorm(IN), nn.Linear(IN, OUT)).to(DEVICE)
    plain.load_state_dict(model.state_dict())  # and back into an unconverted model
    assert torch.equal(plain(x), reference(x))


def test_conversion_rules(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(
        nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(48, 64), nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    )
    with caplog.at_level(logging.WARNING):
        convert(model, MXConfig(keep_bf16=("3.1",)))
    assert sorted(converted_layers(model)) == ["0", "3.0"]
    assert "2 layer(s) stay in high precision" in caplog.text and "1 (64->8)" in caplog.text
    convert(model, MXConfig(recipe="fp8-rowwise", keep_bf16=("3.1",)))  # idempotent; reconfigures
    assert sorted(converted_layers(model)) == ["0", "2", "3.0"]  # 48 is a multiple of rowwise's 16
    assert all(layer.mx_config.recipe == "fp8-rowwise" for layer in converted_layers(model).values())
    assert isinstance(model[0], nn.Linear) and isinstance(model[0], MXLinear)


def test_blockwise_dims_fall_back_at_run_time(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    monkeypatch.setattr(mx_linear, "_warned", set())
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64), nn.Linear(64, 96)).to(DEVICE)
    model = convert(model, MXConfig(backend="mx_emulated"))
    assert all(isinstance(layer, MXLinear) for layer in model)
    for layer in model:
        layer.mx_config = MXConfig(backend="fp8_blockwise")  # 64/96 are not multiples of 128
    with caplog.at_level(logging.WARNING):
        out = model(torch.randn(4, 64, device=DEVICE))
        model(torch.randn(4, 64, device=DEVICE))
    assert out.shape == (4, 96) and "layers stay in high precision under fp8_blockwise" in caplog.text
    # once per shape: Linear(64, 96) twice in the model and two forwards, Linear(96, 64) once
    assert caplog.text.count("Linear(64, 96) layers stay") == 1 and caplog.text.count("Linear(96, 64) layers") == 1


def test_plans(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    assert resolve_plan(MXConfig(recipe="mxfp8"), cpu).backend == "mx_emulated"
    assert resolve_plan(MXConfig(), cpu).gemm == "emulated"
    with caplog.at_level(logging.WARNING):
        plan = resolve_plan(MXConfig(recipe="fp8-blockwise"), cpu)
    assert (plan.act_layout, plan.weight_layout, plan.gemm) == ("1x128", "128x128", "emulated")
    assert "requested fp8-blockwise on cpu: running fp8-blockwise (emulated GEMMs)" in plan.description
    with pytest.raises(ValueError, match="sm_100"):
        resolve_plan(MXConfig(backend="mx_native"), cpu)
    with pytest.raises(ValueError, match="recipe"):
        MXConfig(recipe="fp4")


@pytest.mark.parametrize(
    ("capability", "recipe", "backend", "gemm"),
    [
        ((10, 0), "auto", "fp8_rowwise", "scaled_mm"),  # mx_native has not run on an sm_100 GPU: not a default
        ((10, 0), "mxfp8", "mx_native", "scaled_mm"),  # asked for by name, it runs
        ((12, 0), "auto", "fp8_rowwise", "scaled_mm"),
        ((9, 0), "auto", "fp8_blockwise", "scaled_mm"),
        ((8, 9), "auto", "fp8_rowwise", "scaled_mm"),
        ((8, 0), "auto", "mx_emulated", "emulated"),
    ],
)
def test_auto_picks_a_tested_path_for_each_device(
    capability: tuple[int, int], recipe: str, backend: str, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The device's capability as a CUDA device would report it, on any machine; plans and capabilities are cached
    # per device, so the caches are emptied around the faked devices.
    import lightning_gem.precision.config as config_module
    from lightning_gem.ops._device import device_capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    config_module._resolve.cache_clear()
    device_capability.cache_clear()
    try:
        plan = resolve_plan(MXConfig(recipe=recipe), torch.device("cuda", 0))
    finally:
        config_module._resolve.cache_clear()
        device_capability.cache_clear()
    assert (plan.backend, plan.gemm) == (backend, gemm)
    sm = f"sm_{capability[0]}{capability[1]}"
    assert plan.description.startswith(f"requested {recipe} on {sm}: running {backend.replace('_', '-')}")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("rows", [384, 1001])  # jagged token counts are any number
def test_native_gemms_match_emulated_ones_in_training(backend: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm + MLP under bf16 autocast with fp32 weights: cuBLAS's FP8 GEMMs vs the same operands in fp32."""
    import dataclasses

    import lightning_gem.precision.linear as linear_module
    import lightning_gem.precision.norm as norm_module

    torch.manual_seed(0)
    reference = nn.Sequential(nn.RMSNorm(512), nn.Linear(512, 1024), nn.SiLU(), nn.Linear(1024, 512)).cuda()
    native = convert(copy.deepcopy(reference), MXConfig(backend=backend))
    x, grad = torch.randn(rows, 512, device="cuda"), torch.randn(rows, 512, device="cuda")

    def step(model: nn.Module) -> list[torch.Tensor]:
        inputs = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(inputs)
        out.float().backward(grad)
        return [out.float(), inputs.grad, *(p.grad for p in model.parameters())]

    native_results = step(native)
    emulate = lambda config, device: dataclasses.replace(resolve_plan(config, device), gemm="emulated")
    monkeypatch.setattr(linear_module, "resolve_plan", emulate)
    monkeypatch.setattr(norm_module, "resolve_plan", emulate)
    emulated = convert(copy.deepcopy(reference), MXConfig(backend=backend))
    for a, b in zip(native_results, step(emulated), strict=True):
        assert bool(torch.isfinite(a).all())
        assert float((a - b).norm() / b.norm()) < 2e-2


def test_converted_layers_run_eagerly_inside_compiled_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.compile`` (dynamic shapes, as compiled HSTU layers use) the fused norm and the FP8 Linear
    run eagerly between graphs: the same outputs and gradients as without compiling, never traced."""
    from lightning_gem.precision import linear, norm

    traced = []
    for fn in (linear._MXLinearFn, norm._FusedNormFn):
        apply = fn.apply
        monkeypatch.setattr(
            fn, "apply", lambda *a, _apply=apply: traced.append(torch.compiler.is_compiling()) or _apply(*a)
        )
    torch.manual_seed(0)
    eager = convert(nn.Sequential(nn.RMSNorm(64), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 64)), MXConfig())
    compiled = copy.deepcopy(eager)
    compiled.compile(dynamic=True, backend="aot_eager")
    torch.compiler.reset()
    try:
        for rows in (48, 80):
            x = torch.randn(rows, 64)
            outs = []
            for model in (eager, compiled):
                model.zero_grad()
                out = model(x.clone().requires_grad_())
                out.square().sum().backward()
                outs.append((out.detach(), *(p.grad for p in model.parameters())))
            for a, b in zip(*outs, strict=True):
                torch.testing.assert_close(b, a)
    finally:
        torch.compiler.reset()
    assert len(traced) == 2 * 2 * 3 and not any(traced)  # 2 models x 2 batches x (norm, 2 linears), all eager


def test_fused_norms_pair_with_the_linear_they_feed() -> None:
    """Modules that declare their norm -> Linear pairs get those (the interaction registers its history norm right
    before the query projection, which reads the other norm); the attention norm of an HSTU layer feeds a gate
    product, so nothing quantizes for it."""
    from lightning_gem.components.encoder import HSTULayer
    from lightning_gem.components.interaction import GDPAInteraction

    interaction = convert(GDPAInteraction(128, 2, self_interaction=True, num_context_tokens=1), MXConfig())
    want = {"query_norm": "query", "history_norm": "key_value", "token_norm": "token_qkv", "mlp_norm": "mlp.0"}
    for norm_name, linear in want.items():
        norm = interaction.get_submodule(norm_name)
        assert isinstance(norm, MXRMSNorm) and norm._consumer() is interaction.get_submodule(linear), norm_name
    assert type(interaction.mix_norm) is not MXRMSNorm
    layer = convert(HSTULayer(128, 2, per_head_norm=False), MXConfig())
    assert layer.input_norm._consumer() is layer.uvqk
    assert not isinstance(layer.attention_norm, MXRMSNorm)
