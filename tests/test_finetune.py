"""Fine-tuning from pretrained weights (`train.init_from`): a tformer checkpoint, a Hugging Face directory and a
GGUF file, each holding the same tiny LLaMA and tokenizer.

The reference is the pretrained model itself: the first step's loss must equal its loss on the same batch,
computed here directly. A run stopped after its first checkpoint must resume to the weights of an uninterrupted
run, bit for bit, and no tokenizer is trained.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from helpers import ENV, LINES, gguf_tensors, interrupt_and_resume, llama_metadata, losses, trainer
from helpers import write_finetune_recipe as write_recipe
from safetensors.torch import load_file

import tformer
from tformer.checkpoints import list_checkpoints, load_pretrained
from tformer.config import ConfigError
from tformer.data import Cursor, Tokenizer, Vocab, causal_lm
from tformer.models import WEIGHTS_FILE
from tformer.training import load_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sources(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same weights as a tformer checkpoint, a Hugging Face directory and a GGUF file (F32)."""
    hf_dir = tmp_path_factory.mktemp("hf")
    tformer.to_hf(tformer.load(pretrained), hf_dir, tokenizer_dir=pretrained)
    return {"tformer": pretrained, "hf": hf_dir, "gguf": write_gguf(hf_dir, Tokenizer.load(pretrained))}


def write_gguf(hf_dir: Path, tokenizer: Tokenizer) -> Path:
    """The HF model as a GGUF file (tests/test_interop_gguf_tiny.py's writer) with a gpt2 tokenizer's metadata."""
    transformers = pytest.importorskip("transformers")

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    path = hf_dir / "tiny.gguf"
    meta = llama_metadata(model)
    backend = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = backend["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny test model")
    for key, value in meta.items():
        add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
        add(f"llama.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if vocab[t] in tokenizer.special_ids else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    for name, value in gguf_tensors(model).items():
        writer.add_tensor(name, value.astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_loss(model: torch.nn.Module, batch) -> float:  # noqa: ANN001 -- an LMBatch
    """Mean next-token cross-entropy of `model` on `batch`, computed without the trainer."""
    with torch.no_grad():
        logits = model.eval()(batch.input_ids, batch.attention_mask)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=-100).item()


@pytest.mark.parametrize("kind", ["tformer", "hf", "gguf"])
def test_first_step_loss_is_the_pretrained_models_and_training_lowers_it(
    kind: str, sources: dict[str, Path], pretrained: Path, tmp_path: Path
) -> None:
    run = trainer(write_recipe(tmp_path, sources[kind]))
    indices, _ = next(run.sampler.iterate(Cursor()))
    batch = run._batch(indices, 0)
    before = reference_loss(tformer.load(pretrained), batch)
    run.fit()
    logged = losses(run.run_dir)
    assert logged[0] == pytest.approx(before, rel=1e-5, abs=1e-5)
    after = reference_loss(tformer.load(list_checkpoints(run.run_dir)[-1]), batch)
    assert after < before - 0.5, f"training did not lower the loss: {before:.3f} -> {after:.3f}"
    # the pretrained file is untouched (its tensors were mapped, training wrote copies)
    fresh = load_file(pretrained / WEIGHTS_FILE)
    assert all(torch.equal(fresh[k], v) for k, v in tformer.load(pretrained).state_dict().items() if k in fresh)


def test_checkpoint_is_ordinary_and_keeps_the_pretrained_tokenizer(
    sources: dict[str, Path], pretrained: Path, tmp_path: Path
) -> None:
    dev = tmp_path / "dev.txt"
    dev.write_text("\n".join(LINES[:6]) + "\n", encoding="utf-8")
    run = trainer(write_recipe(tmp_path, sources["tformer"], max_steps=5, dev_corpus=str(dev)))
    run.fit()
    theirs = Tokenizer.load(pretrained)
    # before the first step the run scores the pretrained model on dev: its perplexity, computed here directly
    kept = [ids for ids in theirs.encode_batch(LINES[:6]) if len(ids) <= 32]  # the recipe's max_len
    batch = causal_lm(kept, Vocab.of(theirs))
    first = json.loads((run.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["dev_ppl"] == pytest.approx(
        math.exp(reference_loss(tformer.load(pretrained), batch))
    )
    checkpoint = list_checkpoints(run.run_dir)[0]
    model, tokenizer = load_pretrained(checkpoint)  # what `tformer generate` and `tformer serve` load
    assert model.config == tformer.load(pretrained).config
    for ours in (tokenizer, Tokenizer.load(run.run_dir)):
        assert ours.backend.get_vocab() == theirs.backend.get_vocab()
        assert ours.special_tokens == theirs.special_tokens
        assert ours.encode(LINES[1]) == theirs.encode(LINES[1])
    assert (run.run_dir / "tokenizer.json").read_bytes() == (pretrained / "tokenizer.json").read_bytes()


def test_model_keys_that_contradict_the_weights_are_named(pretrained: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.d_model is 64 in the recipe.* have 32.*remove model\.d_model"):
        load_recipe(write_recipe(tmp_path, pretrained, model={"d_model": 64}))
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads"):
        load_recipe(write_recipe(tmp_path, pretrained, model={"preset": "tiny-llama", "n_kv_heads": 4}))
    with pytest.raises(ConfigError, match=r"objective 'mlm'.*'decoder'.*clm"):
        load_recipe(write_recipe(tmp_path, pretrained, objective="mlm"))
    with pytest.raises(ConfigError, match=r"model\.vocab_size is 97 in the recipe.* have 300"):
        load_recipe(write_recipe(tmp_path, pretrained, model={"vocab_size": 97}))
    model, _ = load_recipe(write_recipe(tmp_path, pretrained, model={"n_heads": 4, "dropout": 0.2}))
    assert model.dropout == 0.2 and model.d_model == 32  # agreeing and training-only keys are accepted
    model, _ = load_recipe(write_recipe(tmp_path, pretrained, model={"preset": "tiny-llama"}))
    assert model == tformer.load(pretrained).config  # a preset's vocabulary size gives way, as in training


def test_interrupted_run_resumes_bit_exactly_from_its_own_checkpoint(pretrained: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, pretrained, model={"dropout": 0.1}, grad_accum=2, bf16=True)
    whole, resumed = interrupt_and_resume(recipe, tmp_path)
    a = load_file(list_checkpoints(whole.run_dir)[-1] / WEIGHTS_FILE)
    b = load_file(list_checkpoints(resumed.run_dir)[-1] / WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(whole.run_dir) == losses(resumed.run_dir)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_follow_the_single_process_run(strategy: str, pretrained: Path, tmp_path: Path) -> None:
    """Every rank loads the weights, then they are sharded as when training from scratch (torchrun, gloo)."""
    recipe = write_recipe(tmp_path, pretrained, grad_accum=2, max_steps=4, save_every=4)
    single = trainer(recipe, f"train.out_dir={tmp_path / 'single'}")
    single.fit()
    out_dir = tmp_path / strategy
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "tformer", "train", str(recipe), f"train.out_dir={out_dir}", f"train.parallel={strategy}"]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(out_dir) == pytest.approx(losses(single.run_dir), rel=1e-5)
    a = load_file(list_checkpoints(single.run_dir)[-1] / WEIGHTS_FILE)
    b = load_file(list_checkpoints(out_dir)[-1] / WEIGHTS_FILE)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0, msg=name)
