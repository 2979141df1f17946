"""ModelConfig: one serializable dataclass from which every Transformer family is built.

`ConfigBase` gives it (and the training and LoRA configs) typed fields read from and written to YAML or JSON, with
errors that name the key."""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from tformer.errors import ConfigError
from tformer.files import read_mapping

FAMILIES = ("encoder-decoder", "decoder", "encoder", "ssm", "lstm-encoder-decoder", "conv-encoder-decoder")
POSITION_NAMES = ("sinusoidal", "learned", "rope", "alibi", "t5", "none")
SINUSOIDAL_LAYOUT_NAMES = ("interleaved", "split")
ROPE_SCALINGS = ("none", "linear", "dynamic-ntk", "yarn", "llama3")
FFN_NAMES = ("relu", "gelu", "gelu-tanh", "silu", "swiglu", "geglu", "geglu-tanh")
NORM_NAMES = ("layernorm", "rmsnorm", "rmsnorm-plus-one")
NORM_PLACEMENTS = ("post", "pre", "sandwich", "deepnorm")
ATTENTION_BACKEND_NAMES = ("sdpa", "math")
ATTENTION_NAMES = ("softmax", "longformer", "performer", "strided", "fixed", "linear")
# what each decoder layer's self-attention sees (config.layer_types); a table, not a registry: the stack reads it
# through ModelConfig.layer_windows
LAYER_TYPES = {"sliding": "the last sliding_window keys", "full": "every earlier key"}
INIT_NAMES = ("xavier", "gpt2", "normal")
# how a mixture of experts turns router logits into the top-k experts' weights (layers/ffn.py, ROUTERS)
MOE_ROUTER_NAMES = ("topk-softmax", "softmax-topk")
ENCODER_HEAD_NAMES = ("mlm", "none", "sequence-classification", "token-classification", "question-answering")
# the encoder heads that take num_labels (a frozenset, not a tuple: test_registries pairs every name tuple)
CLASSIFICATION_HEADS = frozenset({"sequence-classification", "token-classification"})


class ConfigBase:
    """Typed dataclass fields with YAML/JSON round trips; subclasses validate in `__post_init__`.

    A file may hold this config at top level or under `section` (a recipe has `model:` and `train:`).
    """

    section = ""

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            allowed = _allowed_types(hints[f.name])
            if float in allowed and not isinstance(value, (bool, float)):
                value = _as_float(value)
                setattr(self, f.name, value)
            if not any(_is_instance(value, t) for t in allowed):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise ConfigError(f"{f.name} must be {names}, got {value!r} ({type(value).__name__})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> Self:
        """Builds a config from plain data, naming `source` in errors about unknown keys."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                hint = difflib.get_close_matches(str(key), known, n=1)
                suggestion = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(known)}"
                raise ConfigError(f"{source}: unknown config key '{key}'{suggestion}")
        try:
            return cls(**data)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """Reads a YAML file, or JSON for a .json suffix."""
        data = read_config_file(path)
        if cls.section and isinstance(data.get(cls.section), dict):
            data = data[cls.section]
        return cls.from_dict(data, source=str(path))

    def to_file(self, path: str | Path) -> None:
        """Writes JSON for a .json suffix, YAML otherwise; the write is atomic."""
        path = Path(path)
        if path.suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            import yaml  # here, not at the top: commands that never write a config skip its import

            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML or JSON file, or a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    return read_mapping(path, ConfigError, "config keys")


def _is_instance(value: Any, kind: type) -> bool:
    if kind is type(None):
        return value is None
    if kind is int and isinstance(value, bool):
        return False
    if typing.get_origin(kind) is list:
        return isinstance(value, list)
    return isinstance(value, kind)


def _allowed_types(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _as_float(value: Any) -> Any:
    """Ints widen to float; so do strings like '1e-5', which YAML 1.1 (PyYAML) reads as text."""
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(value, choices, n=1)
        suggestion = f"did you mean '{hint[0]}'? " if hint else ""
        raise ConfigError(f"unknown {key} '{value}'; {suggestion}choose one of: {', '.join(choices)}")


@dataclass
class ModelConfig(ConfigBase):
    """Everything needed to build a model. Variants are names resolved through registries.

    The defaults are the base model of "Attention Is All You Need" (Vaswani et al., 2017).
    """

    # family and sizes
    family: str = "encoder-decoder"
    vocab_size: int = 37000
    tgt_vocab_size: int | None = None  # encoder-decoder target vocabulary; None: same as vocab_size
    d_model: int = 512
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: n_heads (MHA); 1: MQA; in between: GQA
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int = 2048
    max_seq_len: int = 1024
    type_vocab_size: int = 0  # BERT's segment embeddings; 0 disables them
    # position 'learned': position p reads row p + position_offset of the table (RoBERTa: pad_token_id + 1)
    position_offset: int = 0
    pad_token_id: int = 0

    # dropout: on embeddings + positions and each sublayer output; on attention probabilities
    dropout: float = 0.1
    attn_dropout: float = 0.0

    # positions
    position: str = "sinusoidal"
    sinusoidal_base: float = 10000.0
    sinusoidal_layout: str = "interleaved"  # "interleaved": sin, cos per pair (the paper); "split": sines, then cosines
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_len: int | None = None  # context the model was trained on; None: max_seq_len
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # rope_scaling 'llama3': wavelengths above original / low_freq_factor are divided by rope_factor, those below
    # original / high_freq_factor kept, those between blended (Llama 3.1)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_local_theta: float | None = None  # the RoPE base of "sliding" layers (Gemma 3); None: rope_theta
    relative_attention_buckets: int = 32  # position 't5': buckets of relative distance, each a learned bias per head
    relative_attention_max_distance: int = 128  # position 't5': distances from here on share the last bucket
    relative_attention_per_layer: bool = False  # position 't5': a bucket table in every layer (umT5), not one a stack

    # sublayers
    ffn: str = "relu"
    ffn_bias: bool = True
    attn_bias: bool = True
    attn_out_bias: bool | None = None  # the output projection's bias; None: attn_bias (Qwen2: q/k/v biases only)
    qk_norm: bool = False  # a norm (of kind `norm`) on each head's queries and keys before RoPE (Qwen3, Gemma 3)
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True
    norm_placement: str = "post"
    embedding_norm: bool = False  # BERT normalizes the embedding sum

    # embeddings and output head
    scale_embeddings: bool = True  # multiply token embeddings by sqrt(d_model)
    round_embed_scale: bool = False  # Gemma: sqrt(d_model) rounded to the weights' dtype first (bf16: 48.0 for 2304)
    tie_embeddings: bool = True  # output projection shares the (target) token embedding
    share_embeddings: bool = True  # encoder-decoder: source and target share one embedding
    lm_head_bias: bool = False
    final_logit_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap); None: none
    scale_decoder_output: bool = False  # T5 (tied head): decoder output * d_model**-0.5 before the output projection
    encoder_head: str = "mlm"  # family 'encoder': "mlm" outputs vocabulary logits, "none" the hidden states
    num_labels: int | None = None  # classification heads: the number of classes (models/heads.py)
    label_names: list[str] | None = None  # classification heads, optional: the name of each class, in id order
    lstm_hidden: int | None = None  # family 'lstm-encoder-decoder': LSTM width, even (bidirectional); None: d_model
    conv_hidden: int | None = None  # family 'conv-encoder-decoder' (ConvS2S): conv channels; None: d_model
    conv_kernel: int | None = None  # family 'conv-encoder-decoder': kernel width, odd; None: 3 (the paper's)

    # attention
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per decoder layer, "sliding" or "full"; None: all "sliding" under a window
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap) before the mask
    attention_scale_dim: int | None = None  # scores are q.k / sqrt(attention_scale_dim); None: head_dim (Gemma)
    attention_backend: str = "sdpa"
    scale_attention: bool = True  # scores q.k / sqrt(head_dim); T5 leaves them unscaled (folded into its init)
    attention: str = "softmax"  # self-attention: "softmax", "longformer" (local window + global tokens), "performer",
    # "strided" and "fixed" (Sparse Transformer), "linear" (elu + 1 linear attention)
    attention_window: int = 512  # longformer: each token sees attention_window // 2 neighbours on each side
    performer_features: int = 256  # performer: random features approximating the softmax kernel (FAVOR+)
    sparse_stride: int = 64  # strided (Sparse Transformer): the last `sparse_stride` keys and every stride-th one;
    # fixed: the block length l (a query sees its own block so far)
    sparse_summary: int = 8  # fixed: the last `sparse_summary` keys of every earlier block (the paper's c)
    activation_checkpointing: bool = False

    # family 'ssm' (Mamba): state size N per channel, causal conv width, inner width = ssm_expand * d_model
    ssm_state_size: int = 16
    ssm_conv_width: int = 4
    ssm_expand: int = 2

    # mixture of experts (Mixtral, Qwen3-MoE): each FFN becomes n_experts FFNs of kind `ffn` and a router that
    # sends each token to n_experts_per_token of them (layers/ffn.py); 0 experts: a dense FFN
    n_experts: int = 0
    n_experts_per_token: int = 2
    moe_d_ff: int | None = None  # each expert's hidden width; None: d_ff (which moe_dense_layers keep)
    moe_router: str = "topk-softmax"  # "topk-softmax": softmax over the top-k logits; "softmax-topk": over all
    moe_dense_layers: list[int] | None = None  # layer indices (from 0) that keep a dense FFN of width d_ff
    router_aux_loss_coef: float = 0.01  # training: weight of the load-balancing loss (Switch Transformer)

    # initialization
    init: str = "xavier"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self._check_types()
        self._check_values()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.d_model // self.n_heads
        if self.n_experts and self.moe_d_ff is None:  # resolved, so that null and d_ff compare equal
            self.moe_d_ff = self.d_ff
        if self.tgt_vocab_size is None:
            self.tgt_vocab_size = self.vocab_size
        if self.family == "conv-encoder-decoder" and self.conv_kernel is None:
            self.conv_kernel = 3
        if self.rope_original_max_len is None:
            self.rope_original_max_len = self.max_seq_len
        self._check_derived()

    # ---- derived quantities -------------------------------------------------------------
    @property
    def has_encoder(self) -> bool:
        return self.family in ("encoder-decoder", "encoder")

    @property
    def is_seq2seq(self) -> bool:
        """Whether the model maps a source to a target (translation): the Transformer's or the LSTM's."""
        return self.family in ("encoder-decoder", "lstm-encoder-decoder", "conv-encoder-decoder")

    @property
    def has_decoder(self) -> bool:
        return self.family in ("encoder-decoder", "decoder")

    @property
    def final_norm(self) -> bool:
        """Pre- and sandwich-norm stacks end with a norm; post-norm ones already did."""
        return self.norm_placement in ("pre", "sandwich")

    def deepnorm_coefficients(self, stack: str) -> tuple[float, float]:
        """DeepNet's (alpha, beta) for the 'encoder' or 'decoder' stack (Wang et al., 2022, Table 1)."""
        n, m = self.n_encoder_layers, self.n_decoder_layers
        if self.family == "encoder":
            return (2 * n) ** 0.25, (8 * n) ** -0.25
        if self.family == "decoder":
            return (2 * m) ** 0.25, (8 * m) ** -0.25
        if stack == "encoder":
            return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
        return (3 * m) ** 0.25, (12 * m) ** -0.25

    # ---- validation ---------------------------------------------------------------------
    def _check_values(self) -> None:
        check_choice("family", self.family, FAMILIES)
        check_choice("position", self.position, POSITION_NAMES)
        check_choice("sinusoidal_layout", self.sinusoidal_layout, SINUSOIDAL_LAYOUT_NAMES)
        check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        check_choice("ffn", self.ffn, FFN_NAMES)
        check_choice("norm", self.norm, NORM_NAMES)
        check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKEND_NAMES)
        check_choice("attention", self.attention, ATTENTION_NAMES)
        check_choice("init", self.init, INIT_NAMES)
        check_choice("encoder_head", self.encoder_head, ENCODER_HEAD_NAMES)
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("n_kv_heads", "head_dim", "tgt_vocab_size", "sliding_window", "rope_original_max_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1 (or null for the default), got {value}")
        if self.has_encoder and self.n_encoder_layers < 1:
            raise ConfigError(f"family '{self.family}' needs n_encoder_layers >= 1, got {self.n_encoder_layers}")
        if self.has_decoder and self.n_decoder_layers < 1:
            raise ConfigError(f"family '{self.family}' needs n_decoder_layers >= 1, got {self.n_decoder_layers}")
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"change one of them, or set head_dim explicitly"
            )
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}): each KV head "
                f"serves a whole group of query heads; pick n_kv_heads from the divisors of {self.n_heads}"
            )
        if self.sliding_window is not None and self.family == "encoder":
            raise ConfigError(
                "sliding_window applies to causal self-attention, but family 'encoder' is bidirectional; "
                "remove sliding_window or use family 'decoder'"
            )
        self._check_attention()
        self._check_ssm()
        self._check_recurrent()
        self._check_convolutional()
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.sinusoidal_base <= 1 or self.rope_theta <= 1:
            raise ConfigError("sinusoidal_base and rope_theta must be greater than 1 (the paper uses 10000)")
        self._check_relative_buckets()
        self._check_layer_types()
        self._check_experts()
        if self.relative_attention_per_layer and self.position != "t5":
            raise ConfigError(
                f"relative_attention_per_layer gives each layer its own T5 bucket table, so it needs position 't5', "
                f"got '{self.position}'; remove relative_attention_per_layer"
            )
        if self.position_offset < 0 or (self.position_offset and self.position != "learned"):
            raise ConfigError(
                f"position_offset ({self.position_offset}) skips rows of a learned position table, so it must be "
                f"at least 0 and needs position 'learned' (got '{self.position}'); remove position_offset"
            )

    def _check_experts(self) -> None:
        check_choice("moe_router", self.moe_router, MOE_ROUTER_NAMES)
        if self.n_experts == 0:
            return
        if self.n_experts < 0 or not 1 <= self.n_experts_per_token <= self.n_experts:
            raise ConfigError(
                f"a mixture of experts needs n_experts >= 1 and 1 <= n_experts_per_token <= n_experts, got "
                f"n_experts={self.n_experts}, n_experts_per_token={self.n_experts_per_token} (0 experts: dense FFNs)"
            )
        if self.family not in ("decoder", "encoder", "encoder-decoder"):
            raise ConfigError(f"n_experts replaces Transformer FFNs, but family '{self.family}' has none")
        if self.moe_d_ff is not None and self.moe_d_ff < 1:
            raise ConfigError(f"moe_d_ff must be at least 1 (or null for d_ff), got {self.moe_d_ff}")
        n_layers = max(self.n_encoder_layers, self.n_decoder_layers)
        if any(not 0 <= i < n_layers for i in self.moe_dense_layers or []):
            raise ConfigError(f"moe_dense_layers {self.moe_dense_layers} must be layer indices in [0, {n_layers})")
        if self.init == "gpt2":
            raise ConfigError(
                "init 'gpt2' scales each layer's single down_proj, which a mixture of experts does not have; "
                "use init 'normal' (the same draws without that scaling)"
            )
        if self.router_aux_loss_coef < 0:
            raise ConfigError(f"router_aux_loss_coef must be at least 0, got {self.router_aux_loss_coef}")

    def _check_layer_types(self) -> None:
        """Per-layer windows, RoPE bases, soft caps and score scales (Gemma 2/3, Qwen2)."""
        for kind in self.layer_types or []:
            check_choice("layer_types", kind, LAYER_TYPES)
        if self.layer_types is not None:
            if self.family != "decoder" or len(self.layer_types) != self.n_decoder_layers:
                raise ConfigError(
                    f"layer_types names each decoder layer's attention, so family 'decoder' needs one entry per "
                    f"layer ({self.n_decoder_layers}), got {len(self.layer_types)} for family '{self.family}'"
                )
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ConfigError("layer_types has 'sliding' layers but sliding_window is null; set sliding_window")
        for name in ("attn_logit_softcap", "final_logit_softcap", "attention_scale_dim", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive (or null for none), got {value}")
        if self.attn_logit_softcap is not None and self.attention != "softmax":
            raise ConfigError(
                f"attn_logit_softcap caps softmax attention's scores, which attention '{self.attention}' never "
                "forms; use attention 'softmax' or remove attn_logit_softcap"
            )
        if self.rope_local_theta is not None and self.position != "rope":
            raise ConfigError(f"rope_local_theta sets RoPE's base, but position is '{self.position}'; remove it")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(
                f"rope_scaling 'llama3' needs 0 < rope_low_freq_factor < rope_high_freq_factor (Llama 3.1: 1 and 4), "
                f"got {self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
            )

    @property
    def shared_window(self) -> int | None:
        """The sliding window every decoder layer has, or None when some layer sees every earlier key (layer_types):
        what rolling caches and the engine's block reads and releases may rely on."""
        return self.sliding_window if self.layer_types is None or "full" not in self.layer_types else None

    def layer_windows(self) -> list[int | None]:
        """Each decoder layer's sliding window (None: it sees every earlier key)."""
        kinds = self.layer_types or ["sliding"] * self.n_decoder_layers
        return [self.sliding_window if kind == "sliding" else None for kind in kinds]

    def _check_attention(self) -> None:
        if self.attention == "longformer":
            if self.family != "encoder":
                raise ConfigError(
                    f"attention 'longformer' gives global tokens two-way attention, which a causal stack cannot have; "
                    f"it applies to family 'encoder', got '{self.family}' (use sliding_window for a causal local "
                    f"window)"
                )
            if self.attention_window < 2 or self.attention_window % 2:
                raise ConfigError(
                    f"attention_window must be a positive even number (each token sees attention_window // 2 "
                    f"neighbours on each side), got {self.attention_window}"
                )
            if self.position in ("alibi", "t5"):
                bias = "ALiBi's" if self.position == "alibi" else "T5's relative"
                raise ConfigError(
                    f"attention 'longformer' computes banded scores without a bias matrix, so it cannot add {bias} "
                    "bias; use position 'learned', 'sinusoidal' or 'rope'"
                )
            if not self.scale_attention:
                raise ConfigError(
                    "attention 'longformer' always scales its scores by 1/sqrt(head_dim); set scale_attention: true"
                )
        if self.attention in ("strided", "fixed", "linear"):
            self._check_strided_or_linear()
        if self.attention == "performer":
            if self.position in ("alibi", "t5") or self.sliding_window is not None:
                raise ConfigError(
                    "attention 'performer' approximates softmax attention without a score matrix, so it cannot add "
                    "ALiBi's or T5's bias or a sliding window; use position 'rope' or 'sinusoidal' and no "
                    "sliding_window"
                )
            if self.performer_features < 1:
                raise ConfigError(f"performer_features must be at least 1, got {self.performer_features}")
            if self.attn_dropout > 0:
                raise ConfigError(
                    f"attention 'performer' never forms attention probabilities, so attn_dropout "
                    f"({self.attn_dropout}) has nothing to drop; set attn_dropout: 0 (dropout still applies)"
                )

    def _check_strided_or_linear(self) -> None:
        name = self.attention
        if self.position in ("alibi", "t5") or self.sliding_window is not None:
            raise ConfigError(
                f"attention '{name}' adds no bias matrix and has its own sparsity, so it cannot add ALiBi's or T5's "
                "bias or a sliding window; use position 'rope', 'learned' or 'sinusoidal' and no sliding_window"
            )
        if name in ("strided", "fixed"):
            if self.family != "decoder":
                raise ConfigError(
                    f"attention '{name}' is the Sparse Transformer's causal pattern, so it applies to family "
                    f"'decoder', got '{self.family}'; use attention 'linear' or 'softmax' there"
                )
            if self.sparse_stride < 1:
                raise ConfigError(
                    f"sparse_stride must be at least 1 (about sqrt(context) is usual), got {self.sparse_stride}"
                )
            if name == "fixed" and not 1 <= self.sparse_summary <= self.sparse_stride:
                raise ConfigError(
                    f"attention 'fixed' lets later blocks see the last sparse_summary keys of each block of "
                    f"sparse_stride, so 1 <= sparse_summary <= sparse_stride is needed, got {self.sparse_summary} "
                    f"and {self.sparse_stride} (the paper: 8 to 32 of 128)"
                )
        elif self.attn_dropout > 0:
            raise ConfigError(
                f"attention 'linear' never forms attention probabilities, so attn_dropout ({self.attn_dropout}) has "
                "nothing to drop; set attn_dropout: 0 (dropout still applies)"
            )

    def _check_ssm(self) -> None:
        for name in ("ssm_state_size", "ssm_conv_width", "ssm_expand"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1 (Mamba uses 16, 4 and 2), got {getattr(self, name)}")
        if self.family == "ssm" and self.n_decoder_layers < 1:
            raise ConfigError(f"family 'ssm' stacks n_decoder_layers Mamba blocks; got {self.n_decoder_layers}")

    def _check_recurrent(self) -> None:
        """An LSTM ignores the Transformer-only keys (heads, d_ff, positions, norms) but refuses what it cannot do."""
        if self.family != "lstm-encoder-decoder":
            if self.lstm_hidden is not None:
                raise ConfigError(f"lstm_hidden applies to family 'lstm-encoder-decoder' only, not '{self.family}'")
            return
        if self.n_encoder_layers < 1 or self.n_decoder_layers < 1 or (self.lstm_hidden or self.d_model) % 2:
            raise ConfigError(
                "family 'lstm-encoder-decoder' needs n_encoder_layers and n_decoder_layers >= 1 and an even "
                "lstm_hidden (or d_model when lstm_hidden is null): the bidirectional encoder halves it per direction"
            )
        wrong = {"sliding_window": self.sliding_window is not None, "attention": self.attention != "softmax"}
        wrong |= {"activation_checkpointing": self.activation_checkpointing, "type_vocab_size": self.type_vocab_size}
        if keys := [key for key, value in wrong.items() if value]:
            raise ConfigError(
                f"family 'lstm-encoder-decoder' has no self-attention layers, so {', '.join(keys)} cannot apply; "
                f"remove {', '.join(keys)} (defaults: none, softmax, false, 0) or use family 'encoder-decoder'"
            )

    def _check_convolutional(self) -> None:
        """ConvS2S ignores the Transformer-only keys (heads, d_ff, norms) but refuses what it cannot do."""
        family = "conv-encoder-decoder"
        if self.family != family:
            if keys := [key for key in ("conv_hidden", "conv_kernel") if getattr(self, key) is not None]:
                raise ConfigError(f"{', '.join(keys)} applies to family '{family}' only, not '{self.family}'")
            return
        if self.n_encoder_layers < 1 or self.n_decoder_layers < 1:
            raise ConfigError(f"family '{family}' needs n_encoder_layers and n_decoder_layers >= 1")
        if self.conv_kernel is not None and (self.conv_kernel < 1 or self.conv_kernel % 2 == 0):
            raise ConfigError(
                f"conv_kernel must be odd and at least 1 (the encoder's kernel is centred on each token; the "
                f"paper uses 3), got {self.conv_kernel}"
            )
        if self.conv_hidden is not None and self.conv_hidden < 1:
            raise ConfigError(f"conv_hidden must be at least 1 (or null for d_model), got {self.conv_hidden}")
        if self.position != "learned":
            raise ConfigError(
                f"family '{family}' adds learned position embeddings to its tokens (as ConvS2S does), got position "
                f"'{self.position}'; set position: learned"
            )
        wrong = {"sliding_window": self.sliding_window is not None, "attention": self.attention != "softmax"}
        wrong |= {"activation_checkpointing": self.activation_checkpointing, "type_vocab_size": self.type_vocab_size}
        if keys := [key for key, value in wrong.items() if value]:
            raise ConfigError(
                f"family '{family}' has no self-attention layers, so {', '.join(keys)} cannot apply; remove "
                f"{', '.join(keys)} (defaults: none, softmax, false, 0) or use family 'encoder-decoder'"
            )

    def _check_relative_buckets(self) -> None:
        buckets, distance = self.relative_attention_buckets, self.relative_attention_max_distance
        if buckets < 4 or distance <= buckets // 2:
            raise ConfigError(
                f"relative_attention_buckets must be at least 4 and relative_attention_max_distance above half of "
                f"them (exact buckets come first, then log-spaced ones up to the distance); got {buckets} and "
                f"{distance} (T5 uses 32 and 128)"
            )
        if self.scale_decoder_output and not self.has_decoder:
            raise ConfigError(f"scale_decoder_output scales a decoder's output, but family '{self.family}' has none")

    def _check_derived(self) -> None:
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"RoPE rotates pairs of dimensions, so head_dim must be even, got {self.head_dim}; "
                f"change d_model/n_heads or head_dim"
            )
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"sinusoidal positions pair sin and cos, so d_model must be even, got {self.d_model}")
        if self.rope_scaling != "none":
            if self.position != "rope":
                raise ConfigError(f"rope_scaling '{self.rope_scaling}' needs position 'rope', got '{self.position}'")
            if self.rope_factor < 1.0:
                raise ConfigError(f"rope_factor must be >= 1 (context extension factor), got {self.rope_factor}")
        if self.is_seq2seq and self.share_embeddings and self.tgt_vocab_size != self.vocab_size:
            raise ConfigError(
                f"share_embeddings needs one joint vocabulary, but vocab_size={self.vocab_size} and "
                f"tgt_vocab_size={self.tgt_vocab_size}; set share_embeddings: false or use a joint vocabulary"
            )
        if self.encoder_head != "mlm" and self.family != "encoder":
            raise ConfigError(
                f"encoder_head '{self.encoder_head}' applies to family 'encoder' only, but family is '{self.family}'; "
                f"remove encoder_head"
            )
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id ({self.pad_token_id}) must be a token id below vocab_size")
        self._check_labels()

    def _check_labels(self) -> None:
        if self.encoder_head not in CLASSIFICATION_HEADS:
            if self.num_labels is not None or self.label_names is not None:
                raise ConfigError(
                    f"num_labels and label_names apply to the classification heads, but encoder_head is "
                    f"'{self.encoder_head}'; remove them or set encoder_head to one of "
                    f"{', '.join(sorted(CLASSIFICATION_HEADS))}"
                )
            return
        if self.num_labels is None or self.num_labels < 1:
            raise ConfigError(
                f"encoder_head '{self.encoder_head}' needs num_labels, the number of classes (at least 1), got "
                f"{self.num_labels}; set model.num_labels"
            )
        if self.label_names is not None and (
            len(self.label_names) != self.num_labels or not all(isinstance(n, str) for n in self.label_names)
        ):
            raise ConfigError(
                f"label_names must be {self.num_labels} strings (one per class, num_labels), got {self.label_names!r}"
            )

    # ---- construction -------------------------------------------------------------------
    section = "model"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        """Like ConfigBase.from_dict; a `preset` key starts from that preset and the other keys override it."""
        if isinstance(data, dict) and "preset" in data:
            data = dict(data)
            name = data.pop("preset")
            if not isinstance(name, str) or name not in _presets():
                raise ConfigError(f"{source}: {_unknown_preset(str(name))}")
            data = {**_presets()[name], **data}
        return super().from_dict(data, source)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named configuration from `tformer.presets`, with optional field overrides."""
        if name not in _presets():
            raise ConfigError(_unknown_preset(name))
        return cls.from_dict({**_presets()[name], **overrides}, source=f"preset '{name}'")


def _presets() -> dict[str, dict[str, Any]]:
    from tformer.presets import PRESETS  # presets are data that name config fields, so they import late

    return PRESETS


def _unknown_preset(name: str) -> str:
    hint = difflib.get_close_matches(name, _presets(), n=1)
    suggestion = f"did you mean '{hint[0]}'? " if hint else ""
    return f"unknown preset '{name}'; {suggestion}presets: {', '.join(_presets())}"
