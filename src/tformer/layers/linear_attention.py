"""Linear attention: Performer's FAVOR+ with positive orthogonal random features (Choromanski et al., 2021).

Softmax attention weighs value j for query i by exp(q_i . k_j / sqrt(D)). FAVOR+ writes that kernel as an
expectation over w ~ N(0, I),  exp(x . y) = E[exp(w . x - |x|^2 / 2) exp(w . y - |y|^2 / 2)],  and estimates it
with m random features phi(x) = exp(W x - |x|^2 / 2) / sqrt(m), the rows of W drawn orthogonal. Attention then
factorizes: out = phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1), which costs O(T m D) time and O(T m) memory
instead of O(T^2):
- non-causal: one sum phi(K)^T V (m x D) and one normalizer sum phi(K) (m) serve every query;
- causal: the same sums as prefix sums, S_t = sum_{j <= t} phi(k_j) v_j^T. They are computed by chunks of
  CHUNK queries: inside a chunk the (CHUNK x CHUNK) kernel matrix, masked causally; across chunks the state the
  earlier chunks left. No (T, m, D) tensor of every prefix is ever built.

`kernel_attention_quadratic` computes the same kernel with the (Tq x Tk) matrix phi(Q) phi(K)^T: the reference
the linear forms are tested against.
"""

from __future__ import annotations

import math

import torch

from tformer.config import ModelConfig
from tformer.errors import ConfigError
from tformer.layers.attention import Attention
from tformer.layers.masks import AttentionMask

CHUNK = 128  # queries per chunk of the causal form (docs/design-notes.md, "layers/linear_attention.py")
EPS = 1e-12  # added to the normalizer: a query that sees no real key gets 0, not NaN
DEFAULT_FEATURE_SEED = 0  # every layer starts from this draw, so a checkpoint needs no extra tensor


def orthogonal_random_features(n_features: int, head_dim: int, seed: int) -> torch.Tensor:
    """W (n_features, head_dim): blocks of head_dim orthogonal rows, each row scaled to a Gaussian vector's norm.

    Orthogonal rows keep each row's marginal N(0, I) (so the kernel estimate stays unbiased) while lowering its
    variance (Performer's ORF, `scaling=0`). Drawn in float64 on the CPU from `seed` alone, so the same seed gives
    the same features on any device.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(math.ceil(n_features / head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        q = q * torch.sign(torch.diagonal(r))  # Haar-distributed rotation, not QR's sign convention
        blocks.append(q.T)
    rows = torch.cat(blocks)[:n_features]  # (m, D) unit rows
    norms = torch.randn(n_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return (rows * norms[:, None]).float()


def query_features(q: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """phi(q) (..., T, m) in fp32, up to a per-query constant that the normalization cancels.

    Performer subtracts each row's largest w . q before exp; the -|q|^2 / 2 term is a per-row constant too, so it
    goes with it: the largest feature of every query is then exactly 1 / sqrt(m), whatever the query's norm.
    """
    x = q.float() * q.shape[-1] ** -0.25  # q' . k' = q . k / sqrt(D)
    exponent = x @ projection.float().T  # (..., T, m)
    stabilizer = exponent.amax(dim=-1, keepdim=True).detach() + math.log(projection.shape[0]) / 2  # 1 / sqrt(m)
    return torch.exp(exponent - stabilizer)


def key_features(k: torch.Tensor, projection: torch.Tensor, key_padding: torch.Tensor | None) -> torch.Tensor:
    """phi(k) (B, Hkv, 1, T, m) in fp32 from k (B, Hkv, 1, T, D); padded keys get features of exactly 0.

    Each key's -|k|^2 / 2 matters, so the stabilizer is one constant per (batch, head): the largest exponent over
    every real key and feature (Performer's max over the length and feature axes). It cancels in the normalization.
    """
    x = k.float() * k.shape[-1] ** -0.25
    exponent = x @ projection.float().T - x.square().sum(dim=-1, keepdim=True) / 2  # (B, Hkv, 1, T, m)
    if key_padding is not None:
        exponent = exponent.masked_fill(~key_padding[:, None, None, :, None], float("-inf"))
    stabilizer = exponent.amax(dim=(-2, -1), keepdim=True).detach()
    stabilizer = stabilizer.clamp_min(torch.finfo(exponent.dtype).min)  # all keys padded: features stay 0, not NaN
    return torch.exp(exponent - (stabilizer + math.log(projection.shape[0]) / 2))  # the 1 / sqrt(m) inside exp


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, H, Tq, D) queries over (B, Hkv, Tk, D) keys -> (B, Hkv, G, Tq, D) and (B, Hkv, 1, Tk, D): GQA groups.

    Query heads h*G .. (h+1)*G-1 read KV head h, as `repeat_kv` pairs them; KV heads are never copied.
    """
    B, H, Tq, D = q.shape
    n_kv = k.shape[1]
    return q.reshape(B, n_kv, H // n_kv, Tq, D), k[:, :, None], v[:, :, None].float()


def _causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) True where query i (at slot Tk - Tq + i, the last Tq slots) may see key j."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(n_keys - n_queries)


def kernel_attention_quadratic(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: torch.Tensor,
    causal: bool,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FAVOR+ kernel with its (Tq x Tk) matrix A = phi(Q) phi(K)^T: out = A V / (A 1 + EPS).

    The reference for `favor_attention`; O(T^2) memory. Shapes and meaning as in `favor_attention`.
    """
    with torch.autocast(q.device.type, enabled=False):
        qg, kg, vg = _grouped(q, k, v)
        qf, kf = query_features(qg, features), key_features(kg, features, key_padding)
        allowed = _causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
        out = _quadratic(qf, kf, vg, allowed)
    return out.reshape(q.shape).to(q.dtype)


def _quadratic(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """A V / (A 1 + EPS) with A = phi(Q) phi(K)^T (B, Hkv, G, Tq, Tk), zero where `allowed` is False."""
    scores = qf @ kf.transpose(-2, -1)
    if allowed is not None:
        scores = scores * allowed
    return (scores @ v) / (scores.sum(dim=-1, keepdim=True) + EPS)


def favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: torch.Tensor,
    causal: bool,
    key_padding: torch.Tensor | None = None,
    query_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """FAVOR+ attention in linear time and memory: q (B, H, Tq, D) over k, v (B, Hkv, Tk, D) -> (B, H, Tq, D).

    `features` is the random projection W (m, D). `key_padding` (B, Tk) is True for real keys. Under `causal`,
    the queries are the last Tq of the Tk slots (a decoding step after cached keys sees every earlier key), or,
    with `query_slots` (B|1, Tq), each sits at its own slot (an engine batch of sequences at different lengths):
    that case multiplies the (Tq x Tk) kernel matrix, linear in Tk for the few queries of a decoding step.
    Features and sums are computed in fp32 (autocast off); the output comes back in q's dtype.
    """
    with torch.autocast(q.device.type, enabled=False):
        if causal and query_slots is not None:  # keys past a row's last query are not that row's (stale slots)
            key_padding = _visible_keys(query_slots, key_padding, k.shape[0], k.shape[2])
        qg, kg, vg = _grouped(q, k, v)
        qf, kf = query_features(qg, features), key_features(kg, features, key_padding)
        if causal and query_slots is not None:
            slots = query_slots[:, None, None, :, None]  # (B|1, 1, 1, Tq, 1)
            out = _quadratic(qf, kf, vg, torch.arange(k.shape[2], device=k.device) <= slots)
        elif causal:
            num, den = _causal_sums(qf, kf, vg)
            out = num / (den + EPS)
        else:
            num = qf @ (kf.transpose(-2, -1) @ vg)  # (B, Hkv, G, Tq, m) @ (B, Hkv, 1, m, D)
            den = qf @ kf.sum(dim=-2)[..., None]  # (B, Hkv, G, Tq, 1)
            out = num / (den + EPS)
    return out.reshape(q.shape).to(q.dtype)


def _visible_keys(query_slots: torch.Tensor, key_padding: torch.Tensor | None, batch: int, n_keys: int) -> torch.Tensor:
    """(B, Tk) True for the real keys at or before each row's last query slot."""
    visible = torch.arange(n_keys, device=query_slots.device) <= query_slots.amax(dim=1, keepdim=True)
    visible = visible.expand(batch, n_keys)
    return visible if key_padding is None else visible & key_padding


def _causal_sums(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator (B, Hkv, G, Tq, D) and normalizer (..., Tq, 1) of causal attention by prefix sums.

    Keys before the last Tq slots (a cache's earlier tokens) form the starting state; the last Tq keys, aligned
    with the queries, go by chunks.
    """
    n_queries, n_prefix = qf.shape[-2], kf.shape[-2] - qf.shape[-2]
    k_prefix, kf = kf[..., :n_prefix, :], kf[..., n_prefix:, :]
    v_prefix, v = v[..., :n_prefix, :], v[..., n_prefix:, :]
    state = k_prefix.transpose(-2, -1) @ v_prefix  # (B, Hkv, 1, m, D)
    normalizer = k_prefix.sum(dim=-2)  # (B, Hkv, 1, m)
    n_chunks = math.ceil(n_queries / CHUNK)
    pad = n_chunks * CHUNK - n_queries  # zero features add nothing to any sum

    def chunks(x: torch.Tensor) -> torch.Tensor:  # (..., T, c) -> (..., n_chunks, CHUNK, c)
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        return x.unflatten(-2, (n_chunks, CHUNK))

    qc, kc, vc = chunks(qf), chunks(kf), chunks(v)
    states = _exclusive_cumsum(kc.transpose(-2, -1) @ vc) + state[..., None, :, :]  # (B, Hkv, 1, n, m, D)
    normalizers = _exclusive_cumsum(kc.sum(dim=-2)) + normalizer[..., None, :]  # (B, Hkv, 1, n, m)
    scores = (qc @ kc.transpose(-2, -1)) * _causal_mask(CHUNK, CHUNK, qf.device)  # (B, Hkv, G, n, C, C)
    num = qc @ states + scores @ vc  # (B, Hkv, G, n, C, D)
    den = qc @ normalizers[..., None] + scores.sum(dim=-1, keepdim=True)  # (B, Hkv, G, n, C, 1)
    return num.flatten(-3, -2)[..., :n_queries, :], den.flatten(-3, -2)[..., :n_queries, :]


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Sums over the chunks before each one along dim 3 (the chunk axis): 0, x0, x0 + x1, ..."""
    total = x.cumsum(dim=3)
    return torch.cat([torch.zeros_like(total[:, :, :, :1]), total[:, :, :, :-1]], dim=3)


class PerformerAttention(Attention):
    """Self- or cross-attention with the FAVOR+ kernel in place of softmax; same projections as `Attention`.

    The weights are Attention's (q_proj, k_proj, v_proj, out_proj), so a softmax checkpoint loads into it and back.
    The random projection `features` (performer_features x head_dim) is a non-persistent buffer derived from
    `feature_seed`: a checkpoint stays exactly the softmax model's tensors, and `load` rebuilds the same features.
    `redraw_features` draws new ones (Performer redraws them during training); the seed is not saved, so a model
    reloaded after a redraw is back on DEFAULT_FEATURE_SEED unless you redraw with the same seed again.

    From the mask it reads `is_causal`, `key_padding` and `query_slots` (never a bias: there is no score matrix to
    add one to). Attention dropout does not apply (there are no probabilities to drop); `last_weights` stays None.
    """

    def __init__(self, config: ModelConfig, cross: bool = False) -> None:
        super().__init__(config, cross)
        self.feature_seed = DEFAULT_FEATURE_SEED
        projection = orthogonal_random_features(config.performer_features, self.head_dim, self.feature_seed)
        self.register_buffer("features", projection.to(torch.get_default_device()), persistent=False)

    def redraw_features(self, seed: int | None = None) -> int:
        """Draws a new random projection from `seed` (or from torch's global generator); returns the seed used."""
        if seed is None:
            seed = int(torch.randint(2**62, ()).item())
        self.feature_seed = seed
        projection = orthogonal_random_features(self.features.shape[0], self.head_dim, seed)
        self.features = projection.to(device=self.features.device, dtype=self.features.dtype)
        return seed

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[torch.Tensor, None]:
        """FAVOR+ over q (B, H, Tq, D) and k, v (B, Hkv, Tk, D): causal queries sit at mask.query_slots, or else
        are the last Tq of the Tk slots."""
        if mask.prefix_lengths is not None:
            raise ConfigError(
                "attention 'performer' sums keys in one direction only, so it cannot give a prefix two-way attention "
                "(prefix_lengths, a prefix LM); train it with the plain causal objective or use attention 'softmax'"
            )
        return favor_attention(q, k, v, self.features, mask.is_causal, mask.key_padding, mask.query_slots), None


# ---- the Linear Transformer (Katharopoulos et al., 2020): feature map elu(x) + 1 -------------------------------------


def elu_features(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 in fp32: positive, so every normalizer phi(q) . sum phi(k) is positive."""
    return torch.nn.functional.elu(x.float()) + 1


def elu_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    key_padding: torch.Tensor | None = None,
    query_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """out_i = phi(q_i) S / (phi(q_i) z) with phi = elu + 1, S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j).

    Shapes and the meaning of `causal`, `key_padding` and `query_slots` as in `favor_attention`; the same three
    forms serve (one sum for every query, prefix sums by chunks, the masked matrix for queries at their own slots).
    The paper scales nothing by sqrt(D): the feature map replaces exp(q . k / sqrt(D)) altogether.
    """
    with torch.autocast(q.device.type, enabled=False):
        if causal and query_slots is not None:
            key_padding = _visible_keys(query_slots, key_padding, k.shape[0], k.shape[2])
        qg, kg, vg = _grouped(q, k, v)
        qf, kf = elu_features(qg), elu_features(kg)
        if key_padding is not None:
            kf = kf * key_padding[:, None, None, :, None]
        if causal and query_slots is not None:
            slots = query_slots[:, None, None, :, None]
            out = _quadratic(qf, kf, vg, torch.arange(k.shape[2], device=k.device) <= slots)
        elif causal:
            num, den = _causal_sums(qf, kf, vg)
            out = num / (den + EPS)
        else:
            num = qf @ (kf.transpose(-2, -1) @ vg)
            den = qf @ kf.sum(dim=-2)[..., None]
            out = num / (den + EPS)
    return out.reshape(q.shape).to(q.dtype)


def elu_linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The causal form as the paper's RNN, one token at a time: S_i = S_{i-1} + phi(k_i) v_i^T, z_i likewise.

    q, k, v (B, H, T, D) with as many heads -> (B, H, T, D). O(T) steps of O(D^2) each; the reference that the
    chunked prefix sums are tested against, and what a decoder with a fixed-size state would compute.
    """
    qf, kf, vf = elu_features(q), elu_features(k), v.float()
    state = torch.zeros(*q.shape[:2], q.shape[-1], v.shape[-1], device=q.device)  # (B, H, D, Dv)
    normalizer = torch.zeros(*q.shape[:2], q.shape[-1], device=q.device)  # (B, H, D)
    outputs = []
    for t in range(q.shape[2]):
        state = state + kf[:, :, t, :, None] * vf[:, :, t, None, :]
        normalizer = normalizer + kf[:, :, t]
        num = (qf[:, :, t, None, :] @ state).squeeze(-2)  # (B, H, Dv)
        den = (qf[:, :, t] * normalizer).sum(dim=-1, keepdim=True)
        outputs.append(num / (den + EPS))
    return torch.stack(outputs, dim=2).to(q.dtype)


class LinearAttention(Attention):
    """Self- or cross-attention with the Linear Transformer's kernel elu(x) + 1 in place of softmax.

    Attention's projections, so a softmax checkpoint loads into it and back; no extra tensor. From the mask it
    reads `is_causal`, `key_padding` and `query_slots`, as `PerformerAttention`. With a KV cache, each step sums
    over the cached keys again (linear in their number); `elu_linear_attention_recurrent` is the constant-size
    state form. There are no probabilities, so attention dropout does not apply and `last_weights` stays None.
    """

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[torch.Tensor, None]:
        """elu + 1 linear attention over q (B, H, Tq, D) and k, v (B, Hkv, Tk, D)."""
        if mask.prefix_lengths is not None:
            raise ConfigError(
                "attention 'linear' sums keys in one direction only, so it cannot give a prefix two-way attention "
                "(prefix_lengths, a prefix LM); train it with the plain causal objective or use attention 'softmax'"
            )
        return elu_linear_attention(q, k, v, mask.is_causal, mask.key_padding, mask.query_slots), None
