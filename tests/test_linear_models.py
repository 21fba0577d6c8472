"""GLA5, GDN2 and Mamba2 against the release's shapes and independent per-token references."""

import math
from dataclasses import replace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import model_registry
from canon_titan.config import ConfigError, load
from canon_titan.kernels.documents import Documents, document_boundaries
from conftest import REPO

FAMILIES = ("gla5", "gdn2", "mamba2")
CANON_SETS = ("", "A", "bb", "C", "D", "AbbCD")


def build(name, flavor="debug", device=None, seed=0, **overrides):
    spec = model_registry.model_spec(name, flavor, overrides)
    if device == "meta":
        with torch.device("meta"):
            return spec.model.build()
    torch.manual_seed(seed)
    model = spec.model.build()
    model.init_states()
    return model


# --- sizes ------------------------------------------------------------------------------------


def hand_count(name, args):
    """Parameters of the release's modules (spec 5.2-5.4, 5.6b) for canon_set 'AbbCD', kernel 4."""
    d, heads, vocab, hidden = args.dim, args.n_heads, args.vocab_size, args.hidden_dim
    block = 2 * d + 2 * 4 * d + 3 * d * hidden + 4 * 2 * hidden  # norms, Canon-A/C, MLP, Canon-D
    if (
        name == "gla5"
    ):  # q, k d->d; v d->2d; o 2d->d; gk d->16->d (+bias); g d->16->2d (+bias); convs; g_norm
        block += (
            6 * d * d
            + (16 * d + 16 * d + d)
            + (16 * d + 32 * d + 2 * d)
            + 4 * (d + d + 2 * d)
            + 2 * d // heads
        )
    elif name == "gdn2":  # as GLA5 without gk, plus b/a d->H, A_log, dt_bias
        block += (
            6 * d * d
            + 2 * d * heads
            + 2 * heads
            + (16 * d + 32 * d + 2 * d)
            + 4 * 4 * d
            + 2 * d // heads
        )
    else:  # in_proj d->[z|xBC|dt], conv1d (+bias) over xBC, dt_bias/A_log/D, gated norm, out_proj
        n, inner = args.state_size, 2 * d
        block += (
            d * (2 * inner + 2 * n + heads) + 5 * (inner + 2 * n) + 3 * heads + inner + inner * d
        )
    return 2 * vocab * d + d + args.n_layers * block


# spec 5.5: layers, d, vocab, mixer and MLP parameters per layer in units of d^2
PARITY = {
    "1B": (24, 2048, 32000, 6, 6),
    "3B": (26, 3072, 32000, 6, 6),
    "8B": (32, 4096, 128256, 6, 7),
}


@pytest.mark.parametrize("flavor", PARITY)
@pytest.mark.parametrize("name", FAMILIES)
def test_parameter_counts_match_the_release(name, flavor):
    n = sum(p.numel() for p in build(name, flavor, device="meta").parameters())
    assert n == hand_count(name, model_registry.model_args(name, flavor))
    layers, d, vocab, mixer, mlp = PARITY[flavor]
    parity = 2 * vocab * d + layers * (mixer + mlp) * d * d
    # The "6d^2 + 6d^2" split is rounded: gates, convolutions and Mamba2's B/C/dt columns of
    # in_proj add up to +1.14% (Mamba2-1B), MLP 9472 = 6.94 d^2 at 8B.
    assert abs(n / parity - 1) < 0.012, n / parity


RELEASE_1B_SHAPES = {  # spec 5.6b, ours <- release name; linear [out, in], convolutions [C, 1, 4]
    "gla5": {
        "mixer_norm.weight": [2048],
        "canonA.weight": [2048, 1, 4],  # attn_norm, canonA
        "mixer.q_proj.weight": [2048, 2048],
        "mixer.k_proj.weight": [2048, 2048],
        "mixer.v_proj.weight": [4096, 2048],
        "mixer.o_proj.weight": [2048, 4096],
        "mixer.g_proj.down.weight": [16, 2048],
        "mixer.g_proj.up.weight": [4096, 16],  # g_proj.0 / .1
        "mixer.g_proj.up.bias": [4096],
        "mixer.gk_proj.down.weight": [16, 2048],
        "mixer.gk_proj.up.weight": [2048, 16],
        "mixer.gk_proj.up.bias": [2048],
        "mixer.q_conv1d.weight": [2048, 1, 4],
        "mixer.k_conv1d.weight": [2048, 1, 4],
        "mixer.v_conv1d.weight": [4096, 1, 4],
        "mixer.g_norm.weight": [256],  # g_norm_swish_gate
        "ffn_norm.weight": [2048],
        "canonC.weight": [2048, 1, 4],  # mlp_norm
        "feed_forward.w1.weight": [4096, 2048],
        "feed_forward.w3.weight": [4096, 2048],  # gate_proj = [w1; w3]
        "feed_forward.canonD.weight": [8192, 1, 4],
        "feed_forward.w2.weight": [2048, 4096],  # down_proj
    },
    "gdn2": {
        "mixer_norm.weight": [2048],
        "canonA.weight": [2048, 1, 4],
        "mixer.q_proj.weight": [2048, 2048],
        "mixer.k_proj.weight": [2048, 2048],
        "mixer.v_proj.weight": [4096, 2048],
        "mixer.b_proj.weight": [16, 2048],
        "mixer.a_proj.weight": [16, 2048],
        "mixer.A_log": [16],
        "mixer.dt_bias": [16],
        "mixer.q_conv1d.weight": [2048, 1, 4],
        "mixer.k_conv1d.weight": [2048, 1, 4],
        "mixer.v_conv1d.weight": [4096, 1, 4],
        "mixer.g_proj.down.weight": [16, 2048],
        "mixer.g_proj.up.weight": [4096, 16],
        "mixer.g_proj.up.bias": [4096],
        "mixer.o_norm.weight": [256],
        "mixer.o_proj.weight": [2048, 4096],
        "ffn_norm.weight": [2048],
        "canonC.weight": [2048, 1, 4],
        "feed_forward.w1.weight": [4096, 2048],
        "feed_forward.w3.weight": [4096, 2048],  # both_proj = [w1; w3]
        "feed_forward.canonD.weight": [8192, 1, 4],
        "feed_forward.w2.weight": [2048, 4096],
    },
    "mamba2": {
        "mixer_norm.weight": [2048],
        "canonA.weight": [2048, 1, 4],  # norm, canonA
        "mixer.in_proj.weight": [8464, 2048],
        "mixer.conv1d.weight": [4352, 1, 4],
        "mixer.conv1d.bias": [4352],
        "mixer.dt_bias": [16],
        "mixer.A_log": [16],
        "mixer.D": [16],
        "mixer.norm.weight": [4096],
        "mixer.out_proj.weight": [2048, 4096],
        "ffn_norm.weight": [2048],
        "canonC.weight": [2048, 1, 4],  # pre_mlp_layernorm
        "feed_forward.w1.weight": [4096, 2048],
        "feed_forward.w3.weight": [4096, 2048],  # both_proj = [w1; w3]
        "feed_forward.canonD.weight": [8192, 1, 4],
        "feed_forward.w2.weight": [2048, 4096],
    },
}


@pytest.mark.parametrize("name", FAMILIES)
def test_1B_tensors_have_the_release_shapes(name):
    model = build(name, "1B", device="meta")
    layer = {k: list(v.shape) for k, v in model.layers["0"].state_dict().items()}
    assert layer == RELEASE_1B_SHAPES[name]
    top = {k: list(v.shape) for k, v in model.state_dict().items() if not k.startswith("layers.")}
    assert top == {
        "tok_embeddings.weight": [32000, 2048],
        "norm.weight": [2048],
        "lm_head.weight": [32000, 2048],
    }
    assert len(model.layers) == 24


def test_conv_baseline_has_only_the_short_convolutions():
    for name in FAMILIES:
        model = build(name, "debug", device="meta", canon_set="bb")
        names = [k for k, _ in model.named_parameters()]
        assert not any("canon" in k for k in names)
        assert any("conv1d" in k for k in names)
        names = [
            k for k, _ in build(name, "debug", device="meta", canon_set="AC").named_parameters()
        ]
        assert not any("conv1d" in k for k in names) and any("canonA" in k for k in names)


def test_flops_count_the_recurrence():
    spec = model_registry.model_spec("gla5", "1B")
    with torch.device("meta"):
        model = spec.model.build()
    n, flops = spec.model.get_nparams_and_flops(model, 4096)
    assert n == sum(p.numel() for p in model.parameters())
    assert (
        flops == 6 * (n - 32000 * 2048) + 12 * 24 * 16 * 128 * 256
    )  # state: heads x 128 x 256 = 256 d


# --- init -------------------------------------------------------------------------------------


def test_init_follows_the_release():
    gla = build("gla5", "debug", n_layers=8, dim=256)
    mixers = [gla.layers[str(i)].mixer for i in range(8)]
    q = torch.cat([m.q_proj.weight.flatten() for m in mixers])
    assert q.std().item() == pytest.approx(0.02, rel=0.03)
    gate = torch.cat(
        [m.g_proj.down.weight.flatten() for m in mixers]
        + [m.gk_proj.up.weight.flatten() for m in mixers]
    )
    assert gate.std().item() == pytest.approx(math.sqrt(0.02) / 2, rel=0.03)  # split init, rank 16
    assert torch.all(mixers[0].g_proj.up.bias == 0) and torch.all(mixers[0].g_norm.weight == 1)
    assert mixers[0].q_conv1d.weight.std().item() == pytest.approx(0.02, rel=0.1)  # b: N(0, 0.02)
    canon = gla.layers["0"].feed_forward.canonD.weight  # Canon: PyTorch's default, U(-1/2, 1/2)
    assert canon.abs().max().item() <= 0.5 and canon.std().item() == pytest.approx(
        0.5 / math.sqrt(3), rel=0.05
    )
    assert gla.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.02)

    gdn = build("gdn2", "debug", n_heads=64, dim=256).layers["0"].mixer
    A = gdn.A_log.exp()
    assert 0 < A.min() and A.max() < 16 and A.mean().item() == pytest.approx(8, abs=2)
    dt = F.softplus(gdn.dt_bias)
    assert 1e-3 <= dt.min() and dt.max() <= 0.1 + 1e-6

    mamba = build("mamba2", "debug", dim=256, n_heads=64)
    mixer = mamba.layers["0"].mixer
    assert (
        1 <= mixer.A_log.exp().min() and mixer.A_log.exp().max() <= 16 and torch.all(mixer.D == 1)
    )
    bound = 256**-0.5  # PyTorch's Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert mixer.in_proj.weight.abs().max().item() <= bound
    assert mixer.in_proj.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    assert mixer.conv1d.bias.abs().max().item() <= 0.5 and mixer.conv1d.bias.std().item() > 0.2
    assert mamba.tok_embeddings.weight.std().item() == pytest.approx(0.1, rel=0.02)


# --- causality, and every canon_set trains ----------------------------------------------------


@pytest.mark.parametrize("canon_set", CANON_SETS)
@pytest.mark.parametrize("name", FAMILIES)
def test_causal_and_trainable_with_every_canon_position(name, canon_set):
    """Mamba2 debug scans in chunks of 64: position 70 sits in the second chunk."""
    model = build(name, canon_set=canon_set)
    tokens = torch.randint(0, 2048, (2, 96), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 70] = (tokens[:, 70] + 1) % 2048
    out, out2 = model(tokens), model(changed)
    torch.testing.assert_close(out[:, :70], out2[:, :70], rtol=0, atol=1e-6)
    assert not torch.allclose(out[:, 70:], out2[:, 70:])
    out.float().logsumexp(-1).mean().backward()
    for fqn, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), fqn


DOCUMENTS = ((5, 1, 40, 24), (70,))
"""Documents of each row: shorter than the convolutions' taps, one token, across Mamba2's 64-token
chunk."""


def document_positions(lengths) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def packed_and_alone(model, tokens, lengths, alone_model=None, **boundaries):
    """Logits and every parameter's gradient of a random linear function of them: the packed batch
    with its document positions (and ``boundaries``, as the loaders send them), and each document
    alone (no positions; on ``alone_model``, the same weights, if given), whose logits are put back
    in place and whose gradients add up."""
    weights = torch.randn(
        *tokens.shape,
        model.config.vocab_size,
        generator=torch.Generator().manual_seed(4),
        dtype=torch.float64,
    ).to(next(model.parameters()))

    def run(model, tokens, w, **kwargs):
        logits = model(tokens, **kwargs)
        grads = torch.autograd.grad((logits * w).sum(), list(model.parameters()), allow_unused=True)
        return logits.detach(), [
            torch.zeros_like(p) if g is None else g for g, p in zip(grads, model.parameters())
        ]

    packed = run(
        model,
        tokens,
        weights,
        positions=document_positions(lengths).to(tokens.device),
        **boundaries,
    )
    alone_model = alone_model or model
    logits, grads = (
        torch.zeros_like(packed[0]),
        [torch.zeros_like(p) for p in alone_model.parameters()],
    )
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            doc_logits, doc_grads = run(
                alone_model,
                tokens[b : b + 1, start : start + n],
                weights[b : b + 1, start : start + n],
            )
            logits[b : b + 1, start : start + n] = doc_logits
            grads = [g + d for g, d in zip(grads, doc_grads)]
            start += n
    return packed, (logits, grads)


def assert_packed_equals_alone(model, tokens, lengths, tol: float, alone_model=None, **boundaries):
    """Each tensor to ``tol`` of its largest entry."""
    (logits, grads), (want_logits, want_grads) = packed_and_alone(
        model, tokens, lengths, alone_model, **boundaries
    )
    for name, got, want in [
        ("logits", logits, want_logits),
        *zip(dict(model.named_parameters()), grads, want_grads),
    ]:
        error = (got - want).abs().max().item()
        assert error <= tol * want.abs().max().item(), (name, error, want.abs().max().item())


@pytest.mark.parametrize("canon_set", ["AbbCD", "AC"])
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents_equal_each_document_alone(name, canon_set):
    """With document positions (``[dataloader] document_masking``) each packed document starts from
    a zero recurrent state and its short convolutions' and Canon layers' taps stop at its first
    token: logits and every gradient equal each document's alone (the torch kernels, in float64 but
    for the RMSNorm fused into Canon-A/C, which the Canon op computes in float32: hence 1e-5 of each
    tensor's largest entry; a tap or a state reaching into the previous document is off by order 1.
    The Triton kernels: test_kernel_backends.py). Without positions the documents see each other."""
    model = build(name, canon_set=canon_set, kernel_backend="torch", canon_backend="torch").double()
    tokens = torch.randint(0, 2048, (2, 70), generator=torch.Generator().manual_seed(1))
    assert_packed_equals_alone(model, tokens, DOCUMENTS, 1e-5)
    with torch.no_grad():
        packed = model(tokens, document_positions(DOCUMENTS))
        assert not torch.allclose(model(tokens)[:, 5:], packed[:, 5:])


@pytest.mark.parametrize("name", FAMILIES)
def test_without_documents_the_code_path_is_unchanged(name):
    """One document a row: positions give the same bits as none (logits and gradients), so keeping
    documents apart adds only exact masks; and without positions no document code runs at all."""
    from canon_titan.kernels import documents

    model = build(name)
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(2))

    def logits_and_grads(**kwargs):
        model.zero_grad()
        logits = model(tokens, **kwargs)
        logits.float().logsumexp(-1).mean().backward()
        return [logits.detach()] + [p.grad.clone() for p in model.parameters()]

    one_each = logits_and_grads(positions=torch.arange(40).expand(2, -1))
    with mock.patch.object(
        documents, "separate", side_effect=AssertionError("document masks without documents")
    ):
        plain = logits_and_grads()
    assert all(torch.equal(a, b) for a, b in zip(plain, one_each))


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_decreases_on_a_fixed_batch(name):
    model = build(name)
    tokens = torch.randint(0, 2048, (4, 65), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(2048), abs=0.5)
    assert losses[-1] < losses[0] - 1.0, losses


# --- one mixer against a token-by-token recurrence (float64) ----------------------------------


def conv_loop(x, weight, bias=None):
    """Causal depthwise conv: out[t] = sum_j w[:, 0, j] * x[t - (K-1) + j], zeros before the
    start."""
    kernel, out = weight.shape[-1], torch.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(kernel):
            if t - (kernel - 1) + j >= 0:
                out[:, t] += weight[:, 0, j] * x[:, t - (kernel - 1) + j]
    return out if bias is None else out + bias


def linear(x, layer):
    return F.linear(x, layer.weight, layer.bias)


def short_conv(x, conv):
    return F.silu(conv_loop(x, conv.weight, conv.bias)) if conv is not None else F.silu(x)


def rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def slow_gla5(m, x):
    q, k, v = (
        short_conv(linear(x, p), c)
        for p, c in ((m.q_proj, m.q_conv1d), (m.k_proj, m.k_conv1d), (m.v_proj, m.v_conv1d))
    )
    gk = F.logsigmoid(linear(linear(x, m.gk_proj.down), m.gk_proj.up)) / 16
    g = linear(linear(x, m.g_proj.down), m.g_proj.up)
    kd, vd = m.head_k_dim, m.head_v_dim
    heads = q.shape[-1] // kd
    outs = []
    for h in range(heads):
        qs, ks, gs = (t[..., h * kd : (h + 1) * kd] for t in (q, k, gk))
        vs, gate = v[..., h * vd : (h + 1) * vd], g[..., h * vd : (h + 1) * vd]
        state, o = x.new_zeros(x.shape[0], kd, vd), []
        for t in range(x.shape[1]):
            state = gs[:, t].exp()[:, :, None] * state + ks[:, t, :, None] * vs[:, t, None, :]
            o.append(kd**-0.5 * torch.einsum("bk,bkv->bv", qs[:, t], state))
        o = torch.stack(o, 1)
        outs.append(rms(o, m.g_norm.eps) * m.g_norm.weight * F.silu(gate))
    return linear(torch.cat(outs, -1), m.o_proj)


def l2norm(x):
    """fla's l2norm (use_qk_l2norm_in_kernel): eps 1e-6 inside the square root."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def slow_gdn2(m, x):
    q, k, v = (
        short_conv(linear(x, p), c)
        for p, c in ((m.q_proj, m.q_conv1d), (m.k_proj, m.k_conv1d), (m.v_proj, m.v_conv1d))
    )
    beta = torch.sigmoid(linear(x, m.b_proj))
    decay = -m.A_log.exp() * F.softplus(linear(x, m.a_proj) + m.dt_bias)
    g = linear(linear(x, m.g_proj.down), m.g_proj.up)
    kd, vd = m.head_dim, m.head_v_dim
    outs = []
    for h in range(q.shape[-1] // kd):
        qs, ks = (l2norm(t[..., h * kd : (h + 1) * kd]) for t in (q, k))
        vs, gate = v[..., h * vd : (h + 1) * vd], g[..., h * vd : (h + 1) * vd]
        state, o = x.new_zeros(x.shape[0], kd, vd), []
        for t in range(x.shape[1]):
            state = decay[:, t, h, None, None].exp() * state
            u = beta[:, t, h, None] * (vs[:, t] - torch.einsum("bk,bkv->bv", ks[:, t], state))
            state = state + ks[:, t, :, None] * u[:, None, :]
            o.append(kd**-0.5 * torch.einsum("bk,bkv->bv", qs[:, t], state))
        outs.append(rms(torch.stack(o, 1), m.o_norm.eps) * m.o_norm.weight * F.silu(gate))
    return linear(torch.cat(outs, -1), m.o_proj)


def slow_mamba2(m, x):
    inner, n, heads, p = m.d_inner, m.state_size, m.A_log.shape[0], m.head_dim
    z, xbc, dt = linear(x, m.in_proj).split([inner, inner + 2 * n, heads], -1)
    if m.conv1d is not None:
        xbc = short_conv(xbc, m.conv1d)
    xs, B, C = xbc.split([inner, n, n], -1)
    dt = F.softplus(dt + m.dt_bias)
    A = -m.A_log.exp()
    state, ys = x.new_zeros(x.shape[0], heads, p, n), []
    for t in range(x.shape[1]):
        xt = xs[:, t].unflatten(-1, (heads, p))
        decay = (dt[:, t] * A).exp()[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * xt)[..., None] * B[:, t, None, None]
        ys.append((torch.einsum("bhpn,bn->bhp", state, C[:, t]) + m.D[:, None] * xt).flatten(1))
    y = torch.stack(ys, 1)
    return linear(rms(y * F.silu(z), m.norm.eps) * m.norm.weight, m.out_proj)


SLOW = {"gla5": slow_gla5, "gdn2": slow_gdn2, "mamba2": slow_mamba2}


@pytest.mark.parametrize("canon_set", ["AbbCD", "AC"])
@pytest.mark.parametrize("name", FAMILIES)
def test_mixer_equals_token_by_token_recurrence(name, canon_set):
    """The chunked torch kernel inside the mixer (70 tokens: a partial second chunk) against a
    loop over tokens written from the release's equations, with and without the short conv b."""
    mixer = build(name, canon_set=canon_set, kernel_backend="torch").layers["1"].mixer.double()
    x = torch.randn(2, 70, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), SLOW[name](mixer, x), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", FAMILIES)
def test_blocks_compile_without_graph_breaks(name):
    """Also with documents (one graph, ``fullgraph``), equal to the eager block."""
    import torch._dynamo

    block = build(name, n_layers=1).layers["0"]
    x = torch.randn(2, 40, 128, generator=torch.Generator().manual_seed(7))
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0
    positions = document_positions(((9, 31), (40,)))
    documents = Documents(positions, **document_boundaries(positions))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, documents, positions), block(x, documents, positions))


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_debug_configs_resolve(name):
    run = load(REPO / "train_configs" / f"{name}_debug.toml", environment=False)
    assert run["model"]["canon_set"] == "AbbCD" and run["model"]["kernel_backend"] == "auto"
    assert (
        load(
            REPO / "train_configs" / f"{name}_debug.toml",
            ["--model.canon_set", "bb"],
            environment=False,
        ).model_args.canon_set
        == "bb"
    )


@pytest.mark.parametrize(
    "name, key, value, message",
    [
        ("gla5", "canon_set", '"ABCD"', "Canon-B is not available for GLA5"),
        ("gdn2", "canon_set", '"AAb"', "distinct letters"),
        ("mamba2", "canon_set", '"bbb"', "distinct letters"),
        ("gla5", "kernel_backend", '"mamba_ssm"', "must be one of 'auto', 'torch', 'fla' for GLA5"),
        (
            "mamba2",
            "kernel_backend",
            '"fla"',
            "must be one of 'auto', 'torch', 'mamba_ssm' for Mamba2",
        ),
        ("gdn2", "n_heads", "3", "must divide dim (128)"),
        ("mamba2", "n_heads", "3", "must divide the inner width"),
    ],
)
def test_invalid_options_are_config_errors(name, key, value, message):
    with pytest.raises(ConfigError) as e:
        load(
            REPO / "train_configs" / f"{name}_debug.toml",
            [f"--model.{key}", value],
            environment=False,
        )
    assert e.value.key == f"[model] {key}" and message in e.value.message


def test_mamba2_refuses_tensor_parallelism():
    from torchtitan.config import ParallelismConfig

    class Job:
        parallelism = ParallelismConfig(tensor_parallel_degree=2)

    config = model_registry.model_spec("mamba2", "debug").model
    with pytest.raises(ValueError, match="Mamba2 has no tensor-parallel plan"):
        config.update_from_config(config=Job())
    model_registry.model_spec("gla5", "debug").model.update_from_config(config=Job())
    with pytest.raises(ValueError, match=r"must divide model.n_heads \(4\)"):
        Job.parallelism = replace(Job.parallelism, tensor_parallel_degree=3)
        model_registry.model_spec("gdn2", "debug").model.update_from_config(config=Job())
