"""Loading builds the model without initializing it, and gives the very weights that were saved.

The reference is the model that wrote the file: a tformer checkpoint, an HF directory written by `to_hf`, or a
GGUF file written from the same weights; every tensor must come back bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_model, tiny_config

import tformer.models.init
from tformer import TransformerModel, build_model, from_hf, load, to_hf
from tformer.models import meta_tensors

HF_PRESETS = ["tiny-gpt2", "tiny-llama", "tiny-bert"]


@pytest.fixture
def initializers_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a weight gets a random or constant initial value raises while the test loads."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a loader initialized weights that the file then overwrote")

    for method in ("normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    monkeypatch.setattr(tformer.models.init, "init_weights", refuse)
    for name in tformer.models.init.INITS:
        monkeypatch.setitem(tformer.models.init.INITS, name, refuse)


def assert_same_weights(loaded: TransformerModel, original: TransformerModel) -> None:
    theirs = original.state_dict()
    ours = loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    assert not meta_tensors(loaded)
    # tied weights stay one tensor, counted once
    assert loaded.num_parameters() == original.num_parameters()


def test_the_patched_initializers_do_raise(initializers_raise: None) -> None:
    with pytest.raises(AssertionError, match="initialized weights"):
        build_model(tiny_config("tiny-gpt2"))


@pytest.mark.parametrize("preset", ["encoder-decoder", "decoder", "encoder", "tiny-llama"])
def test_checkpoint_loads_without_initializing(preset: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    original = make_model(tiny_config(preset, tie_embeddings=True))
    original.save(tmp_path)
    request.getfixturevalue("initializers_raise")
    assert_same_weights(load(tmp_path), original)


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_hf_directory_loads_without_initializing(preset: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    original = make_model(tiny_config(preset))
    to_hf(original, tmp_path)
    request.getfixturevalue("initializers_raise")
    assert_same_weights(from_hf(tmp_path), original)


def test_checkpoint_weights_stay_memory_mapped(tmp_path: Path) -> None:
    """No copy of a float32 checkpoint: its parameters are views of model.safetensors' mapping."""
    make_model(tiny_config("tiny-llama")).save(tmp_path)
    loaded = load(tmp_path)
    weight = loaded.decoder.layers[0].ffn.up_proj.weight
    with pytest.raises(RuntimeError):  # the storage of a mapped file cannot grow; a private copy could
        weight.untyped_storage().resize_(weight.untyped_storage().nbytes() * 2)


def test_loaded_weights_are_trainable_and_keep_ties(tmp_path: Path) -> None:
    original = make_model(tiny_config("decoder", tie_embeddings=True))
    original.save(tmp_path)
    loaded = load(tmp_path).train()
    assert loaded.lm_head.weight is loaded.decoder.tokens.weight
    assert all(p.requires_grad for p in loaded.parameters())
    ids = torch.randint(1, loaded.config.vocab_size, (2, 6))
    loaded(ids).sum().backward()
    assert loaded.decoder.tokens.weight.grad is not None


def test_int4_from_q4_1_keeps_the_files_values_and_serves_like_requantizing() -> None:
    """INT4 straight from SmolLM2's Q4_1 blocks: each layer's weight is the file's, and the logits match the
    float load quantized afterwards, which finds the same groups here (measured: equal, max |delta| 0.0)."""
    from conftest import smollm2_path

    from tformer.checkpoints import load_pretrained
    from tformer.engine.loading import load_quantized
    from tformer.interop.gguf import dequantize_tensor, open_gguf
    from tformer.kernels.quantize import Int4Linear, set_precision

    path = smollm2_path()
    direct, tokenizer = load_quantized(path, "int4")
    layer = direct.decoder.layers[7]
    assert isinstance(layer.self_attn.q_proj, Int4Linear) and isinstance(layer.ffn.down_proj, Int4Linear)
    reader = open_gguf(path)
    down = next(t for t in reader.tensors if t.name == "blk.7.ffn_down.weight")
    expected = dequantize_tensor(reader, down)
    torch.testing.assert_close(layer.ffn.down_proj.dequantized(), expected, rtol=0, atol=1e-6)
    requantized, _ = load_pretrained(path)
    ids = torch.tensor([tokenizer.encode("In the beginning was the Word, and the Word was with God.")])
    with torch.no_grad():
        ours = set_precision(direct, "bfloat16", "int4")(ids).float()
        theirs = set_precision(requantized, "bfloat16", "int4")(ids).float()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max() <= 1e-2


def test_loading_in_the_serving_dtype_maps_the_file_and_equals_casting_afterwards(tmp_path: Path) -> None:
    """A bf16 checkpoint loaded as bf16 stays mapped (no float32 copy on the way) and equals loading it as
    float32 and casting; `load_engine` asks for the serving dtype at load time (its fused projections are
    joined copies; the layers it keeps, such as down_proj, stay mapped)."""
    from tformer.engine.loading import load_engine

    make_model(tiny_config("tiny-llama")).to(torch.bfloat16).save(tmp_path)
    direct = load(tmp_path, dtype=torch.bfloat16)
    cast = load(tmp_path).to(torch.bfloat16)
    for (name, ours), (_, theirs) in zip(direct.state_dict().items(), cast.state_dict().items(), strict=True):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs), name
    served = load_engine(tmp_path, dtype="bfloat16").model
    for model in (direct, served):
        weight = model.decoder.layers[0].ffn.down_proj.weight
        with pytest.raises(RuntimeError):  # a mapped file's storage cannot grow; a copy's could
            weight.untyped_storage().resize_(weight.untyped_storage().nbytes() * 2)
    ids = torch.randint(1, direct.config.vocab_size, (1, 8))
    assert torch.equal(direct(ids), cast(ids))


def test_training_a_mapped_checkpoint_never_writes_its_file(tmp_path: Path) -> None:
    """The mapping is private: updating loaded weights in place copies their pages, the file stays as saved."""
    make_model(tiny_config("tiny-llama")).save(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    loaded = load(tmp_path)
    with torch.no_grad():
        for param in loaded.parameters():
            param.add_(1.0)
    del loaded
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert not torch.equal(
        load(tmp_path).decoder.tokens.weight, make_model(tiny_config("tiny-llama")).decoder.tokens.weight + 1
    )


def test_an_engine_over_a_quantized_gguf_reads_its_header_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_engine` asks what the file stores and then loads it through one reader (each open decodes the whole
    vocabulary: a tenth of a second of `tformer generate`'s start-up on SmolLM2)."""
    from conftest import smollm2_path

    import tformer.interop.gguf as gguf
    import tformer.interop.gguf_tokenizer as gguf_tokenizer
    from tformer.engine import EngineConfig, SamplingParams, loading

    opened, open_gguf = [], gguf.open_gguf

    def counting_open(path: object) -> object:
        opened.append(path)
        return open_gguf(path)

    for module in (loading, gguf, gguf_tokenizer):
        monkeypatch.setattr(module, "open_gguf", counting_open)
    engine = loading.load_engine(smollm2_path(), EngineConfig(max_model_len=64), quantize="auto")
    assert len(opened) == 1
    (output,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(output.token_ids) == 2
