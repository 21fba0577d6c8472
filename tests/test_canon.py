"""Canon layers and LlamaCanon against independent references (hand loops, plain Llama)."""

import math
import os

import pytest
import torch

import model_registry
from canon_titan.config import ConfigError, load
from canon_titan.models.common.canon import CanonConv
from conftest import REPO


def canon(channels=6, kernel=4, **kw):
    torch.manual_seed(0)
    layer = CanonConv.Config(channels=channels, kernel_size=kernel, **kw).build()
    layer.init_states()
    return layer


def hand_canon(x, weight, bias=None, residual=True, activation=False):
    """out[t, c] = sum_j w[c, 0, j] * x[t - (K-1) + j, c], zeros before the sequence start."""
    batch, seq, channels = x.shape
    kernel = weight.shape[-1]
    out = torch.zeros_like(x)
    for b in range(batch):
        for t in range(seq):
            for c in range(channels):
                acc = 0.0 if bias is None else float(bias[c])
                for j in range(kernel):
                    src = t - (kernel - 1) + j
                    if src >= 0:
                        acc += float(weight[c, 0, j]) * float(x[b, src, c])
                out[b, t, c] = acc
    if activation:
        out = torch.nn.functional.silu(out)
    return x + out if residual else out


@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize(
    "residual, activation, bias", [(True, False, False), (False, True, True), (True, True, False)]
)
def test_canon_conv_equals_hand_loop(kernel, residual, activation, bias):
    layer = canon(kernel=kernel, residual=residual, activation=activation, bias=bias)
    x = torch.randn(2, 7, 6)
    expected = hand_canon(
        x, layer.weight.detach(), layer.bias.detach() if bias else None, residual, activation
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [2, 4])
def test_canon_conv_equals_padded_nn_conv1d(kernel):
    """The reference's definition: nn.Conv1d(C, C, K, groups=C, padding=K-1), first T outputs."""
    layer = canon(channels=32, kernel=kernel, residual=False, bias=True)
    ref = torch.nn.Conv1d(32, 32, kernel, groups=32, padding=kernel - 1)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    x = torch.randn(3, 40, 32)
    expected = ref(x.transpose(1, 2))[..., :40].transpose(1, 2)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_canon_weight_index_k_minus_1_is_the_current_token():
    layer = canon(channels=1, kernel=4, residual=False)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[0, 0, 3] = 1.0
    x = torch.arange(1.0, 6.0).view(1, 5, 1)
    torch.testing.assert_close(layer(x), x)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[0, 0, 0] = 1.0  # three tokens back, zeros before the start
    assert layer(x).flatten().tolist() == [0.0, 0.0, 0.0, 1.0, 2.0]


def test_canon_init_is_pytorch_conv_default():
    layer = canon(channels=20000, kernel=4)
    w = layer.weight.detach()
    assert w.std().item() == pytest.approx(1 / math.sqrt(12), rel=0.02)  # U(-1/2, 1/2): std 0.2887
    assert w.abs().max().item() <= 0.5
    reference = torch.nn.Conv1d(20000, 20000, 4, groups=20000)
    assert reference.weight.shape == w.shape


def canon_model(canon_set="ABCD", flavor="debug", **kw):
    spec = model_registry.model_spec("llama_canon", flavor, {"canon_set": canon_set, **kw})
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    return model


@pytest.mark.parametrize("position", list("ABCD"))
def test_each_canon_position_is_causal(position):
    model = canon_model(position)
    tokens = torch.randint(0, 2048, (2, 20))
    changed = tokens.clone()
    changed[:, 11:] = (changed[:, 11:] + 7) % 2048
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :11], b[:, :11])
    assert not torch.allclose(a[:, 11:], b[:, 11:])


def llama_twin(canon_model_, rope_dim):
    """A plain `llama` model carrying the Canon model's non-Canon weights."""
    spec = model_registry.model_spec("llama", "debug", {"rope_dim": rope_dim})
    llama = spec.model.build()
    state = {k: v for k, v in canon_model_.state_dict().items() if "canon" not in k}
    llama.load_state_dict(state, strict=True)
    return llama


def test_empty_canon_set_is_exactly_llama():
    model = canon_model("")
    assert not [n for n, _ in model.named_parameters() if "canon" in n]
    llama = llama_twin(model, rope_dim=8)
    tokens = torch.randint(0, 2048, (2, 16))
    assert torch.equal(model(tokens), llama(tokens))


def test_zero_canon_weights_reduce_to_llama_at_every_position():
    model = canon_model("ABCD")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "canon" in name:
                p.zero_()
    tokens = torch.randint(0, 2048, (2, 16))
    torch.testing.assert_close(model(tokens), llama_twin(model, rope_dim=8)(tokens))
    with torch.no_grad():
        model.layers["2"].feed_forward.canonD.weight[5, 0, 3] = 0.5
    assert not torch.allclose(model(tokens), llama_twin(model, rope_dim=8)(tokens))


def test_canon_b_acts_before_rope_and_after_qk_norm():
    """Canon-B's input is exactly the QK-normed q/k/v: with Canon-B as identity-doubling
    (current-token weight 1, residual) q, k and v are doubled before RoPE."""
    model = canon_model("B", qk_norm=True)
    attn = model.layers["0"].attention
    with torch.no_grad():
        attn.canonB.weight.zero_()
        attn.canonB.weight[:, 0, 3] = 1.0
    x = torch.randn(1, 5, 128)
    captured = {}
    hook = attn.rope.register_forward_pre_hook(
        lambda m, args: captured.update(q=args[0], k=args[1])
    )
    attn(x)
    hook.remove()
    q = attn.q_norm(attn.wq(x)).view(1, 5, 4, 32)
    torch.testing.assert_close(captured["q"], 2 * q)


@pytest.mark.parametrize(
    "flavor, billions, canon_params",
    [("1B", 1.37, 24 * 86016), ("3B", 3.14, 26 * 126976), ("8B", 8.04, 32 * 172032)],
)
def test_llama_canon_parameter_counts(flavor, billions, canon_params):
    with torch.device("meta"):
        canon_model_ = model_registry.model_spec("llama_canon", flavor).model.build()
        plain = model_registry.model_spec("llama", flavor).model.build()
    n = sum(p.numel() for p in canon_model_.parameters())
    assert n - sum(p.numel() for p in plain.parameters()) == canon_params  # spec 1.3 table, K=4
    assert round(n / 1e9, 2) == billions


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("canon_set", '"AX"', "distinct letters"),
        ("canon_set", '"AA"', "distinct letters"),
        ("canon_kernel", "7", "must be 2, 3 or 4"),
        ("rope_dim", "9", "even number"),
        ("rope_dim", "64", "even number in [2, head_dim=32]"),
        ("canon_backend", '"cuda"', "must be one of 'auto', 'torch', 'triton'"),
        ("canon_backend", '"causal_conv1d"', "'causal_conv1d' was removed"),
    ],
)
def test_invalid_canon_options_are_config_errors(key, value, message):
    with pytest.raises(ConfigError) as e:
        load(REPO / "train_configs" / "llama_canon_debug.toml", [f"--model.{key}", value])
    assert e.value.key == f"[model] {key}" and message in e.value.message


@pytest.mark.parametrize("interpret, ok", [(True, True), (False, False)])
def test_triton_backend_needs_a_gpu_or_the_interpreter(interpret, ok, monkeypatch, capsys):
    """Without a GPU, canon_backend = "triton" is valid only with Triton's interpreter on
    (``TRITON_INTERPRET=1``, which Triton reads as the kernels are imported: ``INTERPRETED``), as
    ``canon-titan config validate`` checks it."""
    import triton

    from canon_titan import cli
    from canon_titan.kernels import backends

    if torch.cuda.is_available():
        pytest.skip("a GPU makes the Triton backend valid either way")
    assert (
        backends.INTERPRETED
        == triton.knobs.runtime.interpret
        == (os.environ["TRITON_INTERPRET"] == "1")
    )
    monkeypatch.setattr(backends, "INTERPRETED", interpret)
    # this machine's, as a fresh process finds it
    backends.KernelEnvironment._this_machine.cache_clear()
    try:
        code = cli.main(
            [
                "config",
                "validate",
                str(REPO / "train_configs" / "llama_canon_debug.toml"),
                "--model.canon_backend",
                "triton",
            ]
        )
    finally:
        monkeypatch.undo()
        backends.KernelEnvironment._this_machine.cache_clear()
    err = capsys.readouterr().err
    if ok:
        assert code == 0, err
    else:
        assert code == 2
        assert (
            "[model] canon_backend: canon backend 'triton' runs Triton kernels, which "
            "need a CUDA GPU" in err
        )
        assert "TRITON_INTERPRET=1" in err


def test_auto_backend_is_torch_without_a_gpu_even_with_the_interpreter():
    from canon_titan.kernels.backends import resolve_backend

    assert resolve_backend("auto", op="canon")[0] == (
        "triton" if torch.cuda.is_available() else "torch"
    )
    assert resolve_backend("torch", op="canon") == ("torch", None)


def test_canon_compiles_without_graph_breaks():
    import torch._dynamo

    layer = canon(channels=8)
    explanation = torch._dynamo.explain(layer)(torch.randn(2, 9, 8))
    assert explanation.graph_break_count == 0
