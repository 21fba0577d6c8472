"""The llama model against independent references: hand formulas and slow re-implementations."""

import math

import pytest
import torch

import model_registry
from canon_titan.components.loss import squared_nll_loss
from canon_titan.models.common.rope import PartialRoPE


def build(flavor="debug", device=None, **overrides):
    spec = model_registry.model_spec("llama", flavor, overrides)
    if device == "meta":
        with torch.device("meta"):
            return spec.model.build()
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    return model


def hand_param_count(dim, layers, heads, kv_heads, hidden, vocab, qk_norm):
    head_dim = dim // heads
    attn = dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim
    norms = 2 * dim + (heads * head_dim + kv_heads * head_dim if qk_norm else 0)
    return 2 * vocab * dim + dim + layers * (attn + 3 * dim * hidden + norms)


@pytest.mark.parametrize(
    "flavor, shape, billions",
    [
        ("1B", (2048, 24, 32, 32, 5632, 32000, True), 1.36),
        ("3B", (3072, 26, 24, 24, 8192, 32000, True), 3.14),
        ("8B", (4096, 32, 32, 8, 14336, 128256, False), 8.03),
    ],
)
def test_parameter_counts_match_spec(flavor, shape, billions):
    model = build(flavor, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert n == hand_param_count(*shape)
    assert round(n / 1e9, 2) == billions


def test_registry_errors_list_choices():
    with pytest.raises(model_registry.UnknownModelError, match="available: llama"):
        model_registry.model_spec("gpt", "debug")
    with pytest.raises(model_registry.UnknownModelError, match="available: debug, 1B, 3B, 8B"):
        model_registry.model_spec("llama", "70B")


def test_init_follows_lingua():
    model = build("debug", n_layers=8, dim=256, n_heads=8, n_kv_heads=8, ffn_hidden_dim=1024)
    dim, hidden = 256, 1024
    ws = torch.cat([model.layers[str(i)].attention.wq.weight.flatten() for i in range(8)])
    w2 = torch.cat([model.layers[str(i)].feed_forward.w2.weight.flatten() for i in range(8)])
    # A normal truncated at 3 sigma has std 0.9866 sigma.
    assert ws.std().item() == pytest.approx(0.9866 * dim**-0.5, rel=0.02)
    assert ws.abs().max().item() <= 3 * dim**-0.5 + 1e-6
    assert w2.std().item() == pytest.approx(0.9866 * hidden**-0.5, rel=0.03)
    assert torch.equal(model.layers["0"].attention.q_norm.weight, torch.ones(256))


def complex_rope_reference(x, theta):
    """Full RoPE via complex multiplication on adjacent pairs (Lingua / Meta Llama layout)."""
    batch, seq, heads, head_dim = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    xc = torch.view_as_complex(x.float().reshape(batch, seq, heads, -1, 2))
    return torch.view_as_real(xc * cis).flatten(3)


def test_full_partial_rope_equals_complex_reference():
    torch.manual_seed(0)
    q, k = torch.randn(2, 10, 3, 16), torch.randn(2, 10, 3, 16)
    rope = PartialRoPE.Config(rope_dim=16, theta=500.0, max_seq_len=32).build()
    rq, rk = rope(q, k)
    torch.testing.assert_close(rq, complex_rope_reference(q, 500.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rk, complex_rope_reference(k, 500.0), rtol=1e-5, atol=1e-5)


def test_partial_rope_rotates_prefix_with_its_own_frequencies():
    torch.manual_seed(0)
    q = torch.randn(1, 7, 2, 16)
    rope = PartialRoPE.Config(rope_dim=4, theta=10000.0, max_seq_len=16).build()
    rq, _ = rope(q, q)
    assert torch.equal(rq[..., 4:], q[..., 4:])
    torch.testing.assert_close(
        rq[..., :4], complex_rope_reference(q[..., :4].contiguous(), 10000.0)
    )
    # Explicit positions give the same rotation as the implicit 0..T-1.
    pos = torch.arange(7)[None]
    torch.testing.assert_close(rope(q, q, pos)[0], rq)


def test_qk_norm_normalises_all_heads_jointly():
    model = build("debug")
    attn = model.layers["0"].attention
    x = torch.randn(2, 5, 128)
    q = attn.wq(x)
    expected = q / torch.sqrt(
        q.pow(2).mean(-1, keepdim=True) + 1e-5
    )  # one statistic over 4 heads x 32
    torch.testing.assert_close(attn.q_norm(q), expected, rtol=1e-5, atol=1e-6)
    per_head = q.view(2, 5, 4, 32)
    per_head = (per_head / torch.sqrt(per_head.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(2)
    assert not torch.allclose(attn.q_norm(q), per_head, atol=1e-3)


def test_attention_matches_naive_causal_gqa_attention():
    model = build("debug", qk_norm=False)
    attn = model.layers["1"].attention
    x = torch.randn(2, 9, 128)
    B, T, H, KV, D = 2, 9, 4, 2, 32
    q = attn.wq(x).view(B, T, H, D)
    k = attn.wk(x).view(B, T, KV, D)
    v = attn.wv(x).view(B, T, KV, D)
    q, k = complex_rope_reference(q, 10000.0), complex_rope_reference(k, 10000.0)
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).flatten(2)
    torch.testing.assert_close(attn(x), attn.wo(out), rtol=1e-4, atol=1e-5)


def test_model_is_causal():
    model = build("debug")
    tokens = torch.randint(0, 2048, (2, 24))
    changed = tokens.clone()
    changed[:, 13:] = torch.randint(0, 2048, (2, 11))
    out, out2 = model(tokens), model(changed)
    torch.testing.assert_close(out[:, :13], out2[:, :13])
    assert not torch.allclose(out[:, 13:], out2[:, 13:])


def test_z_loss_matches_hand_computation():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
    labels = torch.tensor([[0, 2]])
    l0 = -math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(-1)))
    l1 = -math.log(1 / (2 * math.exp(0.5) + 1))
    expected = (l0 + 1e-4 * l0**2) + (l1 + 1e-4 * l1**2)
    assert squared_nll_loss(logits, labels, 1e-4).item() == pytest.approx(expected, rel=1e-6)
    # Ignored labels contribute nothing.
    assert squared_nll_loss(logits, torch.tensor([[0, -100]]), 1e-4).item() == pytest.approx(
        l0 + 1e-4 * l0**2, rel=1e-6
    )


def test_flops_and_params_reported():
    spec = model_registry.model_spec("llama", "1B")
    with torch.device("meta"):
        model = spec.model.build()
    n, flops = spec.model.get_nparams_and_flops(model, 4096)
    embed = 32000 * 2048
    assert n == sum(p.numel() for p in model.parameters())
    assert flops == 6 * (n - embed) + 6 * 24 * 32 * 2 * 64 * 4096


@pytest.mark.parametrize("recipe, expected", [("tensorwise", True), ("rowwise", False)])
def test_float8_linears_get_torchaos_float8_tp_styles_with_tensorwise_scaling(recipe, expected):
    """The plan a float8 llama_canon block is tensor-parallelised with: torchao's float8 column- and
    row-wise styles (same layouts) on its tensorwise float8 linears, the plain styles otherwise."""
    import copy

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from canon_titan.components.float8 import float8_converter
    from canon_titan.models.common.parallelize import float8_styles

    spec = model_registry.model_spec("llama_canon", "debug", {})
    section = {
        "recipe_name": recipe,
        "emulate": True,
        "filter_fqns": ["lm_head"],
        "enable_fsdp_float8_all_gather": False,
    }
    model = float8_converter(section, False).convert(copy.deepcopy(spec.model)).build()
    block = model.layers["0"]
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "canonA": ColwiseParallel(),
    }  # not a linear: never float8
    styled = float8_styles(block, plan)
    assert isinstance(styled["attention.wq"], Float8ColwiseParallel) == expected
    assert isinstance(styled["attention.wo"], Float8RowwiseParallel) == expected
    assert styled["attention.wo"].output_layouts == (Shard(1),) and styled[
        "attention.wq"
    ].input_layouts == (Replicate(),)
    assert type(styled["canonA"]) is ColwiseParallel


@pytest.mark.parametrize("canon_backend", ["torch", "triton"])
def test_canon_document_reset_starts_the_canon_layers_at_each_document(canon_backend, caplog):
    """``[model] canon_document_reset``: with it, LlamaCanon-ABCD on packed documents (positions)
    equals each document alone, logits and every gradient (to 1e-5 of each tensor's largest entry:
    float32); without it (the default, as the release) attention stays inside the documents but the
    Canon layers reach across them, and the log says so."""
    from canon_titan.kernels.backends import triton_runs_here
    from test_linear_models import assert_packed_equals_alone

    if canon_backend == "triton" and not triton_runs_here():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    lengths = ((5, 1, 14), (20,))
    tokens = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(3))
    for reset in (True, False):
        with caplog.at_level("INFO"):
            spec = model_registry.model_spec(
                "llama_canon",
                "debug",
                {"canon_backend": canon_backend, "n_layers": 2, "canon_document_reset": reset},
            )
        torch.manual_seed(0)
        model = spec.model.build()
        model.init_states()
        if reset:
            assert_packed_equals_alone(model, tokens, lengths, 1e-5)
        else:
            with pytest.raises(AssertionError):
                assert_packed_equals_alone(model, tokens, lengths, 1e-3)
    said = (
        "their taps reach across document boundaries, as the release's (canon_document_reset false)"
    )
    assert said in caplog.text
