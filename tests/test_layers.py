"""Layer tests: norms, residual placements, feed-forward networks, attention and masks, each against its formula
written out by hand. Positions (sinusoidal, ALiBi, RoPE) are in test_positions.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config
from torch import nn

from tformer.config import ATTENTION_BACKEND_NAMES, NORM_PLACEMENTS
from tformer.layers import RESIDUALS, Attention, AttentionMask, build_mask, make_ffn, make_norm

# ---- norms ------------------------------------------------------------------------------------------------------


def layer_norm(x: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LN(x) = (x - mean) / sqrt(var + eps) * g + b, with the biased variance."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps) * gain
    return out if bias is None else out + bias


def randomize(module: nn.Module) -> nn.Module:
    """Random values in every parameter, so that a gain of 1 or a bias of 0 cannot hide a mistake."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    return module


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_from_the_config_matches_formula(eps: float) -> None:
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g; a LayerNorm picked by mistake would subtract the mean."""
    config = tiny_config("tiny-llama", norm_eps=eps)
    assert config.norm == "rmsnorm"
    norm = randomize(make_norm(config))
    x = torch.randn(3, 5, config.d_model) * 3 + 1
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * norm.weight
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm_bias", [True, False])
def test_layernorm_matches_formula(norm_bias: bool) -> None:
    config = tiny_config(norm="layernorm", norm_bias=norm_bias, norm_eps=1e-3)
    norm = randomize(make_norm(config))
    x = torch.randn(3, 5, config.d_model) * 3 + 1
    bias = norm.bias if norm_bias else None
    torch.testing.assert_close(norm(x), layer_norm(x, norm.weight, bias, 1e-3), atol=1e-5, rtol=1e-5)


# ---- residual connections (norm placement) -----------------------------------------------------------------------


def sublayer() -> nn.Module:
    """A simple non-linear F(x), so that F(LN(x)) and LN(F(x)) differ."""
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh())


def norm_of(module: nn.Module):
    """Hand-written LN with `module`'s own gain and bias."""
    return lambda h: layer_norm(h, module.weight, module.bias, module.eps)


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_residual_matches_formula(placement: str) -> None:
    config = tiny_config("tiny-transformer", norm_placement=placement, n_decoder_layers=18)
    alpha = config.deepnorm_coefficients("decoder")[0] if placement == "deepnorm" else 1.0
    residual = randomize(RESIDUALS[placement](config, alpha)).eval()
    f = sublayer()
    x = torch.randn(2, 7, 32)
    if placement == "post":  # LN(x + F(x))
        expected = norm_of(residual.norm)(x + f(x))
    elif placement == "pre":  # x + F(LN(x))
        expected = x + f(norm_of(residual.norm)(x))
    elif placement == "sandwich":  # x + LN(F(LN(x))), two different norms
        expected = x + norm_of(residual.norm_out)(f(norm_of(residual.norm_in)(x)))
    else:  # LN(alpha * x + F(x))
        assert alpha > 1
        expected = norm_of(residual.norm)(alpha * x + f(x))
    torch.testing.assert_close(residual(x, f), expected, atol=1e-5, rtol=1e-5)


# DeepNet (Wang et al., 2022), Table 1 / Figure 2, written out for concrete depths.
DEEPNET_CASES = [
    # decoder-only, M = 18: alpha = (2M)^(1/4) = sqrt(6), beta = (8M)^(-1/4) = 1/sqrt(12)
    ("decoder", dict(n_decoder_layers=18), "decoder", math.sqrt(6), 1 / math.sqrt(12)),
    # encoder-only, N = 8: alpha = (2N)^(1/4) = 2, beta = (8N)^(-1/4) = 2^(-3/2)
    ("encoder", dict(n_encoder_layers=8), "encoder", 2.0, 2**-1.5),
    # encoder-decoder, N = M = 16: encoder alpha = 0.81 (N^4 M)^(1/16) = 0.81 * 2^(5/4), beta = 0.87 * 2^(-5/4)
    ("encoder-decoder", dict(n_encoder_layers=16, n_decoder_layers=16), "encoder", 0.81 * 2**1.25, 0.87 * 2**-1.25),
    # ... decoder N = M = 12: alpha = (3M)^(1/4) = sqrt(6), beta = (12M)^(-1/4) = 1/sqrt(12)
    ("encoder-decoder", dict(n_encoder_layers=12, n_decoder_layers=12), "decoder", math.sqrt(6), 1 / math.sqrt(12)),
]


@pytest.mark.parametrize(("family", "layers", "stack", "alpha", "beta"), DEEPNET_CASES)
def test_deepnorm_coefficients_match_deepnet(family: str, layers: dict, stack: str, alpha: float, beta: float) -> None:
    config = tiny_config(family, norm_placement="deepnorm", **layers)
    assert config.deepnorm_coefficients(stack) == pytest.approx((alpha, beta), rel=1e-12)


def test_deepnorm_blocks_use_their_stacks_alpha() -> None:
    from tformer.models.stack import TransformerStack

    config = tiny_config("tiny-transformer", norm_placement="deepnorm", n_encoder_layers=3, n_decoder_layers=5)
    tokens = nn.Embedding(config.vocab_size, config.d_model)
    for stack in ("encoder", "decoder"):
        built = TransformerStack(config, stack, tokens, cross_attention=stack == "decoder")
        alphas = {r.alpha for layer in built.layers for r in (layer.norm_attn, layer.norm_cross, layer.norm_ffn) if r}
        assert alphas == {config.deepnorm_coefficients(stack)[0]}


# ---- feed-forward networks ----------------------------------------------------------------------------------------


def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.maximum(torch.zeros(()), x)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x W + b with W stored (out, in) as torch does."""
    out = x @ layer.weight.T
    return out if layer.bias is None else out + layer.bias


@pytest.mark.parametrize("name", ["relu", "gelu", "gelu-tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_formula(name: str, bias: bool) -> None:
    config = tiny_config(ffn=name, ffn_bias=bias)
    ffn = randomize(make_ffn(config))
    x = torch.randn(2, 5, config.d_model)
    hidden = linear(x, ffn.up_proj)
    act = {"relu": relu, "gelu": gelu_exact, "gelu-tanh": gelu_tanh, "silu": silu}[name]
    expected = linear(act(hidden), ffn.down_proj)  # max(0, x W1 + b1) W2 + b2 for ReLU
    torch.testing.assert_close(ffn(x), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("name", "act"), [("swiglu", silu), ("geglu", gelu_exact)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_ffn_matches_formula(name: str, act, bias: bool) -> None:
    config = tiny_config(ffn=name, ffn_bias=bias)
    ffn = randomize(make_ffn(config))
    x = torch.randn(2, 5, config.d_model)
    expected = linear(act(linear(x, ffn.gate_proj)) * linear(x, ffn.up_proj), ffn.down_proj)  # (act(xW) * xV) W2
    torch.testing.assert_close(ffn(x), expected, atol=1e-4, rtol=1e-5)


# ---- multi-head attention -----------------------------------------------------------------------------------------


def multi_head_reference(attn: Attention, x: torch.Tensor, context: torch.Tensor, causal: bool) -> torch.Tensor:
    """Concat(head_1..head_h) W^O with head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i, one head at a time."""
    d_k = attn.head_dim
    heads = []
    for i in range(attn.n_heads):
        rows = slice(i * d_k, (i + 1) * d_k)
        q = x @ attn.q_proj.weight[rows].T + attn.q_proj.bias[rows]  # (B, T, d_k)
        k = context @ attn.k_proj.weight[rows].T + attn.k_proj.bias[rows]  # (B, S, d_k)
        v = context @ attn.v_proj.weight[rows].T + attn.v_proj.bias[rows]  # (B, S, d_k)
        scores = q @ k.transpose(1, 2) / math.sqrt(d_k)
        if causal:
            future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(heads, dim=-1) @ attn.out_proj.weight.T + attn.out_proj.bias


@pytest.mark.parametrize("backend", ATTENTION_BACKEND_NAMES)
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
def test_attention_matches_multi_head_formula(backend: str, kind: str) -> None:
    cross = kind == "cross"
    attn = randomize(Attention(tiny_config("tiny-transformer", attention_backend=backend), cross=cross)).eval()
    with torch.no_grad():  # keep scores moderate so the softmax is not one-hot
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.mul_(0.2)
    x = torch.randn(2, 6, 32)
    context = torch.randn(2, 9, 32) if kind == "cross" else x
    mask = AttentionMask(is_causal=kind == "causal")
    out = attn(x, mask, context=context if kind == "cross" else None)
    expected = multi_head_reference(attn, x, context, causal=kind == "causal")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_head_bias", [False, True])
def test_single_query_attention_in_low_precision_matches_the_math_backend(dtype, per_head_bias: bool) -> None:
    """The decode-step path of the sdpa backend (one query per row, bf16/fp16, CPU): GQA 6 query heads on 2 KV
    heads, rows of different lengths (padding bias), optionally a per-head bias as ALiBi gives."""
    from tformer.layers.attention import math_attention, sdpa_attention, single_query_attention

    B, H, Hkv, Tk, D = 3, 6, 2, 11, 8
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, Hkv, Tk, D), torch.randn(B, Hkv, Tk, D)
    padding = torch.arange(Tk)[None] < torch.tensor([[11], [4], [7]])  # (B, Tk): real keys per row
    bias = torch.zeros(B, H if per_head_bias else 1, 1, Tk)
    if per_head_bias:
        bias -= torch.rand(1, H, 1, 1) * (Tk - 1 - torch.arange(Tk))  # -slope * distance
    mask = AttentionMask(bias=bias.masked_fill(~padding[:, None, None], torch.finfo(torch.float32).min))
    expected, _ = math_attention(q, k, v, mask, 0.0)  # fp32 reference
    low = AttentionMask(bias=mask.bias.to(dtype))
    out, _ = sdpa_attention(q.to(dtype), k.to(dtype), v.to(dtype), low, 0.0)  # B > 1: the single-query path
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    out32 = single_query_attention(q, k, v, mask)  # exact arithmetic apart from rounding
    torch.testing.assert_close(out32, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [24, 300])
def test_sdpa_backend_trains_in_bf16_like_fp32(T: int) -> None:
    """CPU bf16 training: up to 256 keys the sdpa backend takes the math path (faster there), beyond it torch's
    kernel. Either way its output and gradients must match the fp32 formula within bf16 rounding."""
    from tformer.layers.attention import math_attention, sdpa_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, T, 16) for _ in range(3))
    padding = torch.arange(T)[None] < torch.tensor([[T], [T // 2], [T - 3]])
    bias = torch.zeros(3, 1, 1, T).masked_fill(~padding[:, None, None], torch.finfo(torch.float32).min)
    grads = []
    for dtype, backend in ((torch.float32, math_attention), (torch.bfloat16, sdpa_attention)):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out, _ = backend(*leaves, AttentionMask(bias=bias.to(dtype)), 0.0)
        (out.float() * torch.linspace(-1, 1, 16)).sum().backward()
        grads.append([out.float()] + [t.grad.float() for t in leaves])
    for got, expected in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, expected, atol=4e-2 * expected.abs().max().item(), rtol=0)


def test_cpu_dropout_drops_p_and_keeps_the_expectation() -> None:
    """The cheap CPU mask (16-bit draws) against the definition: each element zeroed with probability p, the
    rest scaled by 1 / (1 - p); masks independent of position; reproducible from the seed; identity in eval."""
    from tformer.layers import Dropout

    layer = Dropout(0.1)
    x = torch.ones(400, 1000)
    torch.manual_seed(5)
    out = layer(x)
    dropped = out == 0
    n = x.numel()
    assert abs(dropped.float().mean().item() - 0.1) < 4 * math.sqrt(0.1 * 0.9 / n)  # 4 standard errors
    for part in (dropped[:, :500], dropped[:, 500:], dropped[::2], dropped[1::2], dropped.view(-1)[0::4]):
        assert abs(part.float().mean().item() - 0.1) < 4 * math.sqrt(0.1 * 0.9 / part.numel())
    assert abs(out.mean().item() - 1.0) < 4 * math.sqrt(0.1 / 0.9 / n)  # E[out] = x
    kept = out[~dropped]
    torch.testing.assert_close(kept, torch.full_like(kept, 65536 / (65536 - round(0.1 * 65536))))
    torch.manual_seed(5)
    assert torch.equal(layer(x), out)
    w = torch.randn(400, 1000, requires_grad=True)
    torch.manual_seed(5)
    layer(w).sum().backward()  # d out / d w is the same mask and scale
    torch.testing.assert_close(w.grad, out)
    assert torch.equal(layer.eval()(x), x) and torch.equal(Dropout(0.0)(x), x)
    few = torch.ones(100)  # p that rounds to 1 in 16 bits goes to torch's dropout instead of dividing by zero
    assert not Dropout(1.0)(few).any() and not Dropout(1 - 1e-6)(few).any()
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)


def test_math_backend_keeps_softmax_weights() -> None:
    attn = randomize(Attention(tiny_config("tiny-transformer", attention_backend="math"))).eval()
    attn.keep_weights = True
    x = torch.randn(1, 4, 32)
    attn(x, AttentionMask(is_causal=True))
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).view(1, 4, 4, 8).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).view(1, 4, 4, 8).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(attn.last_weights, scores.softmax(-1), atol=1e-6, rtol=1e-5)


# ---- masks --------------------------------------------------------------------------------------------------------


def test_sliding_window_mask_allows_the_last_w_positions() -> None:
    mask = build_mask(n_queries=5, n_keys=5, causal=True, dtype=torch.float32, device=torch.device("cpu"), window=2)
    allowed = (mask.bias[0, 0] == 0).int()
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.int
    )
    assert torch.equal(allowed, expected)


def test_padding_mask_blocks_padded_keys_and_never_gives_nan() -> None:
    padding = torch.tensor([[0, 1, 1], [1, 1, 0]])  # left- and right-padded rows
    mask = build_mask(
        n_queries=3, n_keys=3, causal=True, dtype=torch.float32, device=torch.device("cpu"), key_padding=padding
    )
    allowed = (mask.bias[:, 0] == 0).int()
    expected = torch.tensor([[[0, 0, 0], [0, 1, 0], [0, 1, 1]], [[1, 0, 0], [1, 1, 0], [1, 1, 0]]], dtype=torch.int)
    assert torch.equal(allowed, expected)
    q = torch.randn(2, 1, 3, 4)
    for backend in ATTENTION_BACKEND_NAMES:
        attn = Attention(tiny_config(attention_backend=backend))
        out, _ = attn.backend(q, q, q, mask, 0.0)
        assert torch.isfinite(out).all()
