"""Hugging Face import/export of bad checkpoints: each error names the file, the tensor or the config field, and
what to do about it; nothing is written when export must fail.

Every checkpoint is built by transformers from a config with random weights (nothing is downloaded), saved with
save_pretrained, then damaged; the reference is the message a user needs to fix it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_model, tiny_config
from safetensors.torch import load_file, save_file

from tformer import CheckpointError
from tformer.interop.hf import from_hf, to_hf

pytest.importorskip("transformers")  # the reference checkpoints are built by transformers


# ---- bad input ------------------------------------------------------------------------------------------------------


@pytest.fixture
def gpt2_dir(checkpoint, tmp_path: Path) -> Path:
    """A writable copy of the gpt2 case's directory."""
    _, path = checkpoint("gpt2")
    return Path(shutil.copytree(path, tmp_path / "gpt2"))


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_directory_without_config_json(gpt2_dir: Path) -> None:
    (gpt2_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"gpt2 has no config.json, so it is not a Hugging Face model directory"):
        from_hf(gpt2_dir)


def test_config_json_that_is_not_json(gpt2_dir: Path) -> None:
    (gpt2_dir / "config.json").write_text("{'n_embd': 32")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        from_hf(gpt2_dir)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["PegasusModel"]}, "unsupported architecture 'PegasusModel'"),
        ({"architectures": None, "model_type": "pegasus"}, "unsupported model_type 'pegasus'"),
    ],
)
def test_unsupported_architecture_lists_the_supported_ones(gpt2_dir: Path, changes: dict, message: str) -> None:
    edit_config(gpt2_dir, **changes)
    with pytest.raises(CheckpointError) as err:
        from_hf(gpt2_dir)
    assert "config.json" in str(err.value) and message in str(err.value)
    for supported in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "BertModel", "MarianMTModel"):
        assert supported in str(err.value)


def rewrite_weights(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(gpt2_dir: Path) -> None:
    rewrite_weights(gpt2_dir, lambda tensors: tensors.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(CheckpointError, match=r"model.safetensors\): missing tensors transformer.h.1.mlp.c_fc.bias,"):
        from_hf(gpt2_dir)


def test_extra_tensor_is_named(gpt2_dir: Path) -> None:
    rewrite_weights(gpt2_dir, lambda tensors: tensors.update({"transformer.h.0.attn.gate.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors transformer.h.0.attn.gate.weight: the GPT2LM"):
        from_hf(gpt2_dir)


def test_shape_mismatch_names_tensor_and_both_shapes(gpt2_dir: Path) -> None:
    edit_config(gpt2_dir, vocab_size=97)
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor transformer.wte.weight has shape \(96, 32\), "
        r"but config.json implies \(97, 32\)",
    ):
        from_hf(gpt2_dir)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_names_the_file(gpt2_dir: Path, damage: str) -> None:
    file = gpt2_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match=r"gpt2/model.safetensors: not a readable safetensors file .* truncated"):
        from_hf(gpt2_dir)


def test_pickled_checkpoint_is_refused_with_a_way_to_convert(gpt2_dir: Path) -> None:
    (gpt2_dir / "model.safetensors").rename(gpt2_dir / "pytorch_model.bin")  # never opened: the name is enough
    with pytest.raises(
        CheckpointError,
        match=r"pytorch_model.bin is a pickled PyTorch checkpoint.*convert it to "
        r"model.safetensors",
    ):
        from_hf(gpt2_dir)


def test_missing_shard_is_named(checkpoint, tmp_path: Path) -> None:
    theirs, _ = checkpoint("gpt2")
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shards that are not in {tmp_path}: {shard.name}"):
        from_hf(tmp_path)


UNREPRESENTABLE = [
    ("bert-mlm", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key' has no tformer"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True has no tformer"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "factor": 8.0}}, "rope_type 'longrope' has no tformer"),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' has no tformer equivalent"),
    ("bart", {"decoder_attention_heads": 2}, "decoder_attention_heads (2) differs from encoder_attention_heads (4)"),
    (
        "marian",
        {"d_model": 33, "encoder_attention_heads": 3, "decoder_attention_heads": 3},
        "MarianMTModel: sinusoidal positions pair sin and cos, so d_model must be even, got 33",
    ),
]


@pytest.mark.parametrize(("case", "changes", "message"), UNREPRESENTABLE)
def test_config_field_tformer_cannot_represent_is_named(
    case: str, changes: dict, message: str, checkpoint, tmp_path: Path
) -> None:
    _, path = checkpoint(case)
    path = Path(shutil.copytree(path, tmp_path / case))
    edit_config(path, **changes)
    with pytest.raises(CheckpointError) as err:
        from_hf(path)
    assert "config.json" in str(err.value) and message in str(err.value)


def test_to_hf_names_the_fields_no_architecture_holds(tmp_path: Path) -> None:
    model = make_model(tiny_config("tiny-transformer"))  # the paper's model: interleaved sinusoids, no final bias
    with pytest.raises(CheckpointError) as err:
        to_hf(model, tmp_path)
    message = str(err.value)
    assert "BartForConditionalGeneration: " in message and "position is 'sinusoidal', but a Bart" in message
    assert "MarianMTModel: " in message
    assert "sinusoidal_layout is 'interleaved', but a MarianMTModel has 'split'" in message
    assert not (tmp_path / "config.json").exists()


def test_to_hf_refuses_a_tokenizer_dir_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    model = make_model(tiny_config("tiny-gpt2"))
    with pytest.raises(CheckpointError, match=r"empty holds no tokenizer files; looked for tokenizer.json, "):
        to_hf(model, tmp_path / "out", tokenizer_dir=tmp_path / "empty")
    assert not (tmp_path / "out").exists()  # checked before anything is written
