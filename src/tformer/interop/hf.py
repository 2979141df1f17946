"""Import and export of local Hugging Face model directories: config.json plus safetensors weights.

`from_hf(path)` reads GPT-2, LLaMA, Mistral, BERT and RoBERTa (masked LM, bare encoder, sequence or token
classifier, extractive QA), Longformer (masked LM or bare encoder), BART, Marian, T5, mT5 and umT5 checkpoints (and
the decoder families docs/models.md lists), in one model.safetensors or in shards listed by
model.safetensors.index.json, into a tformer model.
`to_hf(model, path)` writes a directory that `transformers.AutoModel*.from_pretrained` loads. What each architecture
means is data in `hf_decoders`, `hf_encoders`, `hf_longformer` and `hf_t5`; this module reads and writes files and
checks them.

Nothing is ever unpickled: a directory with only pytorch_model.bin is refused with a way to convert it.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tformer.config import ConfigError, ModelConfig
from tformer.files import read_mapping, write_atomically
from tformer.interop.hf_decoders import GPT2, GPT2_BARE, LLAMA, MISTRAL, PHI3, QWEN2, QWEN3
from tformer.interop.hf_encoders import (
    BART,
    BERT_MLM,
    BERT_MODEL,
    BERT_QA,
    BERT_SEQUENCE,
    BERT_TOKEN,
    MARIAN,
    ROBERTA_MLM,
    ROBERTA_MODEL,
    ROBERTA_QA,
    ROBERTA_SEQUENCE,
    ROBERTA_TOKEN,
)
from tformer.interop.hf_files import WEIGHTS, WEIGHTS_INDEX, Weights, listed, open_weights
from tformer.interop.hf_gemma import GEMMA2, GEMMA3, GEMMA3_MULTIMODAL
from tformer.interop.hf_longformer import LONGFORMER_MLM, LONGFORMER_MODEL
from tformer.interop.hf_moe import MIXTRAL, QWEN3_MOE
from tformer.interop.hf_spec import COPY, SAME, Entry, Family, HFFields, Table, Transform, UnsupportedHFConfig
from tformer.interop.hf_t5 import MT5, T5, UMT5
from tformer.models import CheckpointError, TransformerModel, assign_weights, build_model

CONFIG_JSON = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "source.spm",
    "target.spm",
    "chat_template.jinja",
)
NOT_COMPARED = ("dropout", "attn_dropout", "init", "init_std")  # training settings, kept by export where it can
# fields config.json may leave implicit (n_experts: a dense family reads back 0, so it never holds experts)
DERIVED = ("n_kv_heads", "head_dim", "attention", "n_experts")
# fields newer families set, which every other family reads back at their defaults (so never holds otherwise)
DERIVED += (
    "attn_out_bias",
    "qk_norm",
    "layer_types",
    "attn_logit_softcap",
    "final_logit_softcap",
    "attention_scale_dim",
    "rope_local_theta",
    "round_embed_scale",
)

FAMILIES: dict[str, Family] = {
    family.architecture: family
    for family in (
        GPT2,
        GPT2_BARE,
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        PHI3,
        GEMMA2,
        GEMMA3,
        GEMMA3_MULTIMODAL,
        MIXTRAL,
        QWEN3_MOE,
        BERT_MLM,
        BERT_MODEL,
        BERT_SEQUENCE,
        BERT_TOKEN,
        BERT_QA,
        ROBERTA_MLM,
        ROBERTA_MODEL,
        ROBERTA_SEQUENCE,
        ROBERTA_TOKEN,
        ROBERTA_QA,
        LONGFORMER_MLM,
        LONGFORMER_MODEL,
        BART,
        MARIAN,
        T5,
        MT5,
        UMT5,
    )
}
# the architecture read when config.json names only a model_type
MODEL_TYPES: dict[str, str] = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "bert": "BertForMaskedLM",
    "roberta": "RobertaForMaskedLM",
    "longformer": "LongformerModel",
    "bart": "BartForConditionalGeneration",
    "marian": "MarianMTModel",
    "t5": "T5ForConditionalGeneration",
    "mt5": "MT5ForConditionalGeneration",
    "umt5": "UMT5ForConditionalGeneration",
}
# what `to_hf` tries, in order, for each tformer family: the first that holds the config exactly is written
EXPORTS: dict[str, tuple[str, ...]] = {
    "decoder": (
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",  # after LlamaForCausalLM, which holds the same models: only `architecture` picks it
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    ),
    "encoder": (
        "BertForMaskedLM",
        "BertModel",
        "BertForSequenceClassification",
        "BertForTokenClassification",
        "BertForQuestionAnswering",
        "RobertaForMaskedLM",
        "RobertaModel",
        "RobertaForSequenceClassification",
        "RobertaForTokenClassification",
        "RobertaForQuestionAnswering",
        "LongformerForMaskedLM",
        "LongformerModel",
    ),
    "encoder-decoder": (
        "BartForConditionalGeneration",
        "MarianMTModel",
        "T5ForConditionalGeneration",
        "MT5ForConditionalGeneration",  # T5 v1.1's layout: written when asked for by name
        "UMT5ForConditionalGeneration",
    ),
}


class DroppedWeightsWarning(UserWarning):
    """A checkpoint held weights tformer has no place for (BERT's pooler); they were left out."""


# ---- import -------------------------------------------------------------------------------------------------------


def from_hf(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> TransformerModel:
    """Loads a Hugging Face model directory (config.json + safetensors) as a tformer model in eval mode.

    Weights load in `dtype`, memory-mapped when the file holds them in that dtype.
    Raises CheckpointError naming the file and the problem when the directory cannot be read exactly.
    """
    path = Path(path)
    hf_config = read_hf_config(path)
    family = family_of(hf_config, path / CONFIG_JSON)
    with open_weights(path) as weights:
        if family.complete_config is not None:
            hf_config = family.complete_config(hf_config, weights.names)
        config = config_from_hf(family, hf_config, path / CONFIG_JSON)
        model = build_model(config, initialize=False).to(dtype)  # free on the meta device
        base, head = family.tensors(config)
        table = {_base_prefix(family, base, weights.names) + name: entry for name, entry in base.items()} | head
        check_tensors(weights, table, family, model, path)
        state = read_state(weights, table, family, model)
        dropped = sorted(name for name in weights.names if _matches(name, family.dropped))
    load_state(model, state, family, path)
    if dropped:
        warnings.warn(f"{path}: left out {listed(dropped)}. {family.dropped_note}", DroppedWeightsWarning, stacklevel=2)
    return model.to(device).eval()


def read_hf_config(path: Path) -> dict[str, Any]:
    """The parsed config.json of a model directory, or a CheckpointError saying what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; from_hf reads a Hugging Face model directory")
    file = path / CONFIG_JSON
    if not file.is_file():
        raise CheckpointError(
            f"{path} has no {CONFIG_JSON}, so it is not a Hugging Face model directory; "
            f"pass the directory that save_pretrained wrote (config.json next to model.safetensors)"
        )
    return read_mapping(file, CheckpointError, "config fields", fix="restore the file from the original model")


def family_of(hf_config: dict[str, Any], source: Path) -> Family:
    """The Family for config.json's first `architectures` entry, or for its model_type when there is none."""
    architectures = hf_config.get("architectures") or []
    name = architectures[0] if architectures else MODEL_TYPES.get(hf_config.get("model_type", ""))
    if name in FAMILIES:
        return FAMILIES[name]
    what = f"architecture '{architectures[0]}'" if architectures else f"model_type {hf_config.get('model_type')!r}"
    raise CheckpointError(
        f"{source}: unsupported {what}; tformer reads the architectures {', '.join(FAMILIES)} "
        f"(or model_type {', '.join(MODEL_TYPES)} without an architectures entry)"
    )


def hf_fields(family: Family, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields for a config.json of `family`; UnsupportedHFConfig names a field tformer lacks."""
    for key, value in family.required.items():
        if key in hf_config and hf_config[key] != value:
            raise UnsupportedHFConfig(f"{key}={hf_config[key]!r} has no tformer equivalent (only {value!r} does)")
    merged = HFFields({**family.defaults, **hf_config})
    fields = {
        **family.fixed,
        **{ours: merged[theirs] for ours, theirs in family.renames.items()},
        **family.extra_in(merged),
    }
    pad = hf_config.get("pad_token_id")
    if isinstance(pad, int) and 0 <= pad < fields["vocab_size"]:
        fields["pad_token_id"] = pad
    return fields


def config_from_hf(family: Family, hf_config: dict[str, Any], source: Path) -> ModelConfig:
    """The ModelConfig for a config.json; the error names the file and the field tformer cannot represent."""
    try:
        return ModelConfig(**hf_fields(family, hf_config))
    except UnsupportedHFConfig as err:
        raise UnsupportedHFConfig(f"{source}: {err}") from None
    except ConfigError as err:
        raise UnsupportedHFConfig(f"{source}: tformer cannot represent this {family.architecture}: {err}") from None


def check_tensors(weights: Weights, table: Table, family: Family, model: TransformerModel, path: Path) -> None:
    """Raises CheckpointError for missing, unexpected or wrongly shaped tensors, naming them."""
    files = ", ".join(sorted({file.name for file in weights.file_of.values()}))
    required = {name for name, entry in table.items() if not _optional(name, entry, family)}
    missing = sorted(required - weights.names)
    if missing:
        raise CheckpointError(
            f"{path} ({files}): missing tensors {listed(missing)}, which the {family.architecture} described by "
            f"{CONFIG_JSON} needs; use the {CONFIG_JSON} saved with these weights"
        )
    unknown = sorted(n for n in weights.names - table.keys() if not _matches(n, family.ignored + family.dropped))
    if unknown:
        raise CheckpointError(
            f"{path} ({files}): unexpected tensors {listed(unknown)}: the {family.architecture} described by "
            f"{CONFIG_JSON} has no such weights; check that {CONFIG_JSON} (its architectures entry, layer counts) "
            f"belongs to these weights"
        )
    expected = expected_shapes(model, table)
    for name in sorted(table.keys() & weights.names):
        if weights.shape(name) != expected[name]:
            raise CheckpointError(
                f"{weights.file_of[name]}: tensor {name} has shape {weights.shape(name)}, but {CONFIG_JSON} implies "
                f"{expected[name]}; use the {CONFIG_JSON} saved with these weights"
            )


def expected_shapes(model: TransformerModel, table: Table) -> dict[str, tuple[int, ...]]:
    """The shape of each checkpoint tensor, found by exporting `model`'s tensors on the meta device."""
    state = model.state_dict()
    shapes = {}
    for name, entry in table.items():
        ours, transform = _unpack(entry)
        shapes[name] = tuple(transform.save([state[n].to("meta") for n in ours]).shape)
    return shapes


def read_state(weights: Weights, table: Table, family: Family, model: TransformerModel) -> dict[str, torch.Tensor]:
    """tformer's tensors from the checkpoint's; optional tensors that are absent become zeros."""
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, entry in table.items():
        ours, transform = _unpack(entry)
        if transform is COPY:
            continue
        if name in weights.names:
            values = transform.load(weights.get(name))
        else:
            values = [torch.zeros(shapes[n]) for n in ours]
        state.update(zip(ours, values, strict=True))
    return state


def load_state(model: TransformerModel, state: dict[str, torch.Tensor], family: Family, path: Path) -> None:
    """Makes `state` the weights of `model` (built uninitialized); every tensor must be set (tied ones once)."""
    unset, unexpected, mismatched = assign_weights(model, state)
    if unset or unexpected or mismatched:
        raise CheckpointError(
            f"{path}: the {family.architecture} tables in tformer.interop left {listed(unset)} unset, "
            f"produced unknown {listed(unexpected)} and misshaped {listed(mismatched)}; this is a bug in "
            "tformer, please report it"
        )


# ---- export -------------------------------------------------------------------------------------------------------


def to_hf(
    model: TransformerModel,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    extra_config: dict[str, Any] | None = None,
    architecture: str | None = None,
) -> None:
    """Writes `model` as a Hugging Face model directory: config.json and model.safetensors (each atomically).

    The architecture is the first in EXPORTS that represents the config exactly (or `architecture`, when given,
    e.g. "Phi3ForCausalLM" for a model LlamaForCausalLM also holds); CheckpointError lists, for each
    candidate, the fields it cannot hold. tformer's config has no bos/eos/decoder-start ids (they belong to the
    tokenizer): pass them in `extra_config`, which is merged into config.json last. Tokenizer files found in
    `tokenizer_dir` are copied. An encoder without a head becomes a BertModel without pooler weights, which
    transformers initializes at random (its last_hidden_state is exact; its pooler_output means nothing).
    """
    path = Path(path)
    family, fields = export_family(model.config, architecture)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    hf_config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **fields,
        "dtype": dtype,
        **(extra_config or {}),
    }
    base, head = family.tensors(model.config)
    tensors = export_tensors(model, {family.prefixes[0] + name: entry for name, entry in base.items()} | head)
    tokenizer_files = [] if tokenizer_dir is None else find_tokenizer_files(Path(tokenizer_dir))
    if (path / WEIGHTS_INDEX).exists():
        raise CheckpointError(f"{path} holds a sharded checkpoint ({WEIGHTS_INDEX}); write to an empty directory")
    path.mkdir(parents=True, exist_ok=True)
    write_atomically(path / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    write_atomically(path / CONFIG_JSON, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    for file in tokenizer_files:
        write_atomically(path / file.name, lambda tmp, file=file: shutil.copyfile(file, tmp))


def config_to_hf(family: Family, config: ModelConfig) -> dict[str, Any]:
    """The config.json fields (without architectures and model_type) for `config` as a `family` model."""
    fields = {theirs: getattr(config, ours) for ours, theirs in family.renames.items()}
    return {**fields, **family.extra_out(config), "pad_token_id": config.pad_token_id}


def export_family(config: ModelConfig, architecture: str | None = None) -> tuple[Family, dict[str, Any]]:
    """The first architecture that holds `config` exactly (only `architecture` when given), with its config.json
    fields."""
    reasons = []
    names = EXPORTS[config.family]
    if architecture is not None:
        if architecture not in names:
            raise CheckpointError(
                f"to_hf writes a {config.family} model as one of {', '.join(names)}, not {architecture!r}"
            )
        names = (architecture,)
    for name in names:
        family = FAMILIES[name]
        try:
            fields = config_to_hf(family, config)
            problems = round_trip_problems(family, config, fields)
        except CheckpointError as err:
            problems = [str(err)]
        if not problems:
            return family, fields
        reasons.append(f"{name}: {'; '.join(problems)}")
    raise CheckpointError(
        "no Hugging Face architecture holds this model exactly, so to_hf would change it:\n  "
        + "\n  ".join(reasons)
        + "\nchange those config fields, or keep tformer's own checkpoint format (model.save)"
    )


def round_trip_problems(family: Family, config: ModelConfig, fields: dict[str, Any]) -> list[str]:
    """The model fields that would change if `fields` were read back as a `family` config.json."""
    back_fields = hf_fields(family, fields)
    try:
        back = ModelConfig(**back_fields)
    except ConfigError as err:
        return [str(err)]
    keys = (set(back_fields) | set(DERIVED)) - set(NOT_COMPARED) - set(family.loose)
    return [
        f"{key} is {getattr(config, key)!r}, but a {family.architecture} has {getattr(back, key)!r}"
        for key in sorted(keys)
        if getattr(config, key) != getattr(back, key)
    ]


def export_tensors(model: TransformerModel, table: Table) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, contiguous on the CPU; a tensor written twice gets its own copy."""
    state = model.state_dict()
    tensors, storages = {}, set()
    for name, entry in table.items():
        ours, transform = _unpack(entry)
        tensor = transform.save([state[n] for n in ours]).detach().cpu().contiguous()
        if tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


def find_tokenizer_files(source: Path) -> list[Path]:
    """The Hugging Face tokenizer files in directory `source`; CheckpointError when there are none."""
    if not source.is_dir():
        raise CheckpointError(f"tokenizer_dir {source} is not a directory")
    files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not files:
        raise CheckpointError(f"{source} holds no tokenizer files; looked for {', '.join(TOKENIZER_FILES)}")
    return files


# ---- helpers ------------------------------------------------------------------------------------------------------


def _unpack(entry: Entry) -> tuple[tuple[str, ...], Transform]:
    return ((entry,), SAME) if isinstance(entry, str) else entry


def _base_prefix(family: Family, base: Table, names: set[str]) -> str:
    """The prefix the checkpoint puts before base-model tensors ('transformer.' or none for GPT-2, ...)."""
    probe = next(iter(base))
    return next((prefix for prefix in family.prefixes if prefix + probe in names), family.prefixes[0])


def _optional(name: str, entry: Entry, family: Family) -> bool:
    return _unpack(entry)[1] is COPY or _matches(name, family.optional)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
