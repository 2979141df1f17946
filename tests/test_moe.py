"""Mixture-of-experts FFNs (Mixtral, Qwen3-MoE): the routed layer against a dense reference that runs every
expert on every token, the models against transformers' own with the same weights, the load-balancing loss against
transformers' `load_balancing_loss_func`, and training, serving and quantization against the float model."""

from __future__ import annotations

import copy
import json
import math

import gguf_writers
import pytest
import torch
from conftest import make_model, tiny_config
from gguf import GGMLQuantizationType as Q
from helpers import LINES, greedy_within_rounding, prompts_of_mixed_lengths, reference_greedy
from safetensors.torch import load_file

from tformer.config import ConfigError, ModelConfig
from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.engine.loading import load_quantized
from tformer.interop import from_hf, to_hf
from tformer.interop.gguf import dequantize_tensor, open_gguf
from tformer.kernels.quantize import Int4Linear, Int8Linear, quantize, set_precision
from tformer.layers.ffn import ROUTERS, MixtureOfExperts, Router
from tformer.training.losses import load_balancing_loss, moe_aux_loss

transformers = pytest.importorskip("transformers")

MOE = {"n_experts": 4, "n_experts_per_token": 2, "init": "normal"}


def moe_config(**overrides: object) -> ModelConfig:
    return tiny_config("tiny-llama", vocab_size=96, d_ff=64, **{**MOE, **overrides})


def dense_reference(layer: MixtureOfExperts, x: torch.Tensor, router: str) -> torch.Tensor:
    """Every expert on every token, mixed with the weights the routing formula gives (zero off the top k)."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(layer.router(flat).double(), -1)  # (N, E)
    top = probs.topk(layer.top_k, -1)
    weights = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
    if router == "topk-softmax":
        weights = weights / weights.sum(-1, keepdim=True)
    outputs = torch.stack([expert(flat).double() for expert in layer.experts], 1)  # (N, E, d)
    return (weights[..., None] * outputs).sum(1).reshape(x.shape)


@pytest.mark.parametrize("router", ["topk-softmax", "softmax-topk"])
@pytest.mark.parametrize("training", [False, True])
def test_routed_experts_equal_the_dense_mixture_and_each_runs_once(router: str, training: bool) -> None:
    config = moe_config(n_experts=5, n_experts_per_token=2, moe_router=router)
    torch.manual_seed(0)
    layer = MixtureOfExperts(config).train(training)
    x = torch.randn(3, 7, config.d_model, requires_grad=True)
    calls: list[int] = []
    for expert in layer.experts:
        expert.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    out = layer(x)
    assert len(calls) <= config.n_experts and sum(calls) == 21 * 2  # once per expert, over its tokens only
    torch.testing.assert_close(out.double(), dense_reference(layer, x, router), atol=1e-5, rtol=1e-5)
    assert (layer.router_logits is not None) == training
    grad = torch.autograd.grad(out.square().sum(), x)[0]  # the gradient flows through the routing weights too
    x_ref = x.detach().requires_grad_()
    expected = torch.autograd.grad(dense_reference(layer, x_ref, router).square().sum(), x_ref)[0]
    torch.testing.assert_close(grad, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("training", [False, True])
def test_one_token_runs_its_k_experts_and_mixes_them_exactly(training: bool) -> None:
    """Batch-1 decode's path: y = sum_j w_j expert_j(x) in fp32, bit for bit, each chosen expert once on the one
    row; in training the same gradients as the dense reference, and zeros (not None) for the idle experts."""
    config = moe_config(n_experts=4, n_experts_per_token=2)
    torch.manual_seed(1)
    layer = MixtureOfExperts(config).train(training)
    x = torch.randn(1, 1, config.d_model, requires_grad=True)
    calls: list[tuple[int, int]] = []
    for e, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda module, args, out, e=e: calls.append((e, args[0].shape[0])))
    out = layer(x)
    weights, chosen = layer.route(layer.router(x[0]), 2)
    assert sorted(calls) == sorted((e, 1) for e in chosen[0].tolist())
    with torch.no_grad():
        formula = sum(w * layer.experts[e](x[0]) for w, e in zip(weights[0], chosen[0].tolist(), strict=True))
    assert torch.equal(out.detach(), formula[None])
    torch.testing.assert_close(out.double(), dense_reference(layer, x, "topk-softmax"), atol=1e-6, rtol=1e-6)
    if not training:
        return
    out.square().sum().backward()
    x_ref = x.detach().requires_grad_()
    ours = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    dense_reference(layer, x_ref, "topk-softmax").square().sum().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(ours[name].double(), p.grad.double(), atol=1e-5, rtol=1e-4, msg=name)
    idle = set(range(4)) - set(chosen[0].tolist())
    assert idle and all(not ours[f"experts.{e}.up_proj.weight"].any() for e in idle)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-4)


def test_no_tokens_give_no_rows() -> None:
    layer = MixtureOfExperts(moe_config()).eval()
    assert layer(torch.randn(2, 0, 32)).shape == (2, 0, 32)


def test_idle_experts_get_zero_gradients_in_training() -> None:
    """DistributedDataParallel needs a gradient for every parameter: an expert no token chose gets zeros."""
    torch.manual_seed(0)
    layer = MixtureOfExperts(moe_config(n_experts_per_token=1)).train()
    layer.route = lambda logits, k: (torch.ones(logits.shape[0], k), torch.zeros(logits.shape[0], k, dtype=torch.long))
    layer(torch.randn(5, 32)).square().sum().backward()
    grads = [expert.up_proj.weight.grad for expert in layer.experts]
    assert grads[0].abs().sum() > 0 and all(g is not None and not g.any() for g in grads[1:])


def test_released_models_have_their_parameter_counts() -> None:
    """Mixtral-8x7B and Qwen3-30B-A3B as their config.json describes them, built on the meta device."""
    from tformer.models import build_model

    common = {"family": "decoder", "n_encoder_layers": 0, "position": "rope", "norm": "rmsnorm", "ffn": "swiglu"}
    common |= {"norm_placement": "pre", "ffn_bias": False, "attn_bias": False, "tie_embeddings": False}
    common |= {"scale_embeddings": False, "init": "normal"}
    mixtral = ModelConfig(
        **common, vocab_size=32000, d_model=4096, n_decoder_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, n_experts=8
    )
    qwen3 = ModelConfig(
        **common,
        vocab_size=151936,
        d_model=2048,
        n_decoder_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        moe_d_ff=768,
        n_experts=128,
        n_experts_per_token=8,
    )
    for config, released in ((mixtral, 46_702_792_704), (qwen3, 30_532_122_624)):
        with torch.device("meta"):
            assert build_model(config, initialize=False).num_parameters() == released


def test_activation_checkpointing_keeps_the_aux_loss_and_its_gradients() -> None:
    from conftest import with_config

    model = make_model(moe_config()).train()
    checkpointed = with_config(model, activation_checkpointing=True)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (model, checkpointed):
        loss = m(ids).logsumexp(-1).mean() + moe_aux_loss(m)
        loss.backward()
        grads.append({name: p.grad for name, p in m.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_two_routers_differ_only_by_renormalization() -> None:
    logits = torch.randn(6, 8)
    w1, e1 = ROUTERS["topk-softmax"](logits, 3)
    w2, e2 = ROUTERS["softmax-topk"](logits, 3)
    assert torch.equal(e1, e2)
    torch.testing.assert_close(w1, torch.softmax(logits.gather(-1, e1), -1))  # Mixtral: softmax of the top logits
    torch.testing.assert_close(w1, w2 / w2.sum(-1, keepdim=True))


def test_dense_layers_and_bad_configs() -> None:
    model = make_model(moe_config(moe_dense_layers=[1], moe_d_ff=24))
    ffns = [layer.ffn for layer in model.decoder.layers]
    assert isinstance(ffns[0], MixtureOfExperts) and not isinstance(ffns[1], MixtureOfExperts)
    assert ffns[0].experts[0].up_proj.out_features == 24 and ffns[1].up_proj.out_features == 64
    with pytest.raises(ConfigError, match="n_experts_per_token <= n_experts"):
        moe_config(n_experts=2, n_experts_per_token=3)
    with pytest.raises(ConfigError, match=r"moe_dense_layers \[5\] must be layer indices in \[0, 2\)"):
        moe_config(moe_dense_layers=[5])
    with pytest.raises(ConfigError, match="moe_router"):
        moe_config(moe_router="top1")
    with pytest.raises(ConfigError, match="use init 'normal'"):
        moe_config(init="gpt2")


# ---- Hugging Face: Mixtral and Qwen3-MoE ---------------------------------------------------------------------------

HF_SIZES = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
}


def hf_mixtral(**overrides: object) -> torch.nn.Module:
    config = transformers.MixtralConfig(**{**HF_SIZES, "num_local_experts": 4, **overrides})
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def hf_qwen3_moe(**overrides: object) -> torch.nn.Module:
    sizes = {**HF_SIZES, "num_experts": 4, "moe_intermediate_size": 24, "head_dim": 16, **overrides}
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**sizes)).eval()
    with torch.no_grad():  # transformers starts q/k norms at 1 and the router at 0: make them matter
        for name, param in model.named_parameters():
            if name.endswith(("_norm.weight", "gate.weight")):
                param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


HF_CASES = {
    "mixtral": lambda: hf_mixtral(),
    "mixtral-tied-window": lambda: hf_mixtral(tie_word_embeddings=True, sliding_window=5, num_experts_per_tok=1),
    "qwen3-moe": lambda: hf_qwen3_moe(),
    "qwen3-moe-normalized": lambda: hf_qwen3_moe(norm_topk_prob=True, attention_bias=True),
    "qwen3-moe-dense-layers": lambda: hf_qwen3_moe(mlp_only_layers=[0], decoder_sparse_step=2),
}


@pytest.fixture(params=list(HF_CASES), scope="module")
def hf_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    hf = HF_CASES[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, from_hf(path), path


def test_logits_equal_transformers_and_to_hf_round_trips(hf_pair: tuple, tmp_path) -> None:
    hf, ours, path = hf_pair
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-5, rtol=1e-5)
    to_hf(ours, tmp_path)
    written, original = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
    assert written.keys() == original.keys() - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    assert all(torch.equal(written[name], original[name]) for name in written)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__]
    again = type(hf).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_moe_layers_are_where_transformers_has_them(hf_pair: tuple) -> None:
    hf, ours, _ = hf_pair
    theirs = [
        type(layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe).__name__ for layer in hf.model.layers
    ]
    mine = [isinstance(layer.ffn, MixtureOfExperts) for layer in ours.decoder.layers]
    assert mine == ["Sparse" in name for name in theirs]


def test_engine_greedy_equals_uncached_forward_and_transformers_generate(hf_pair: tuple) -> None:
    """Continuous batching over paged KV, prompts of mixed lengths, prefill chunked to mix prompt and decode rows."""
    hf, ours, _ = hf_pair
    prompts = prompts_of_mixed_lengths(96)
    engine = Engine(ours, config=EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16))
    results = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(ours, prompt, 8)
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert result.token_ids == generated[0, len(prompt) :].tolist()


# ---- training: the load-balancing loss ------------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked: bool) -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(3 * 5, 6, generator=generator) * 2 for _ in range(4))  # 4 layers, B=3, T=5
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]]) if masked else None
    expected = load_balancing_loss_func(logits, 6, 2, mask)
    torch.testing.assert_close(load_balancing_loss(logits, 2, mask), expected)
    # the formula itself: n_experts * sum_i f_i P_i over all layers' real tokens
    keep = torch.ones(15) if mask is None else mask.reshape(-1).float()
    probs = torch.softmax(torch.cat(logits), -1)
    chosen = torch.zeros_like(probs).scatter(-1, probs.topk(2, -1).indices, 1.0)
    rows = keep.repeat(4)[:, None]
    f, p = (chosen * rows).sum(0) / rows.sum(), (probs * rows).sum(0) / rows.sum()
    torch.testing.assert_close(load_balancing_loss(logits, 2, mask), 6 * (f * p).sum())


def test_model_aux_loss_equals_transformers_on_the_same_weights(tmp_path) -> None:
    hf = hf_mixtral(output_router_logits=True, router_aux_loss_coef=0.02)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).train()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    hf.train()
    expected = hf(ids, attention_mask=mask, labels=ids)
    ours(ids, mask)
    torch.testing.assert_close(moe_aux_loss(ours, mask), expected.aux_loss, atol=1e-6, rtol=1e-5)
    assert ours.config.router_aux_loss_coef == 0.02


def test_a_tiny_moe_model_trains_and_logs_its_aux_loss(tmp_path) -> None:
    from tformer.training.config import TrainConfig
    from tformer.training.trainer import Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    train = TrainConfig(
        corpus=str(corpus),
        objective="clm",
        vocab_size=300,
        max_len=32,
        max_tokens=256,
        max_steps=12,
        log_every=1,
        save_every=1000,
        eval_every=1000,
        optimizer="adamw-cosine",
        lr=3e-3,
        warmup=2,
        label_smoothing=0.0,
        out_dir=str(tmp_path / "run"),
    )
    trainer = Trainer(moe_config(router_aux_loss_coef=0.1), train)
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["loss"] < 0.9 * steps[0]["loss"]
    assert all(1.0 <= r["aux_loss"] <= 4.0 for r in steps)  # k = 2 when balanced, n_experts * k at worst
    routers = [m.router.weight for m in trainer.model.modules() if isinstance(m, MixtureOfExperts)]
    assert routers and all(w.grad is not None for w in routers)  # the router learns (from both losses)


# ---- quantization ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_stay_close_to_the_float_model(mode: str) -> None:
    float_model = make_model(moe_config())
    model = quantize(make_model(moe_config()), mode, group_size=32)
    experts = [e for m in model.modules() if isinstance(m, MixtureOfExperts) for e in m.experts]
    kind = Int8Linear if mode == "int8" else Int4Linear
    assert all(isinstance(getattr(e, name), kind) for e in experts for name in ("gate_proj", "up_proj", "down_proj"))
    routers = [(m.router, f.router) for m, f in zip(moe_layers(model), moe_layers(float_model), strict=True)]
    assert all(type(ours) is Router and torch.equal(ours.weight, theirs.weight) for ours, theirs in routers)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        distance = (torch.softmax(model(ids), -1) - torch.softmax(float_model(ids), -1)).abs().sum(-1).max()
    assert distance < (0.30 if mode == "int8" else 0.20)  # test_quantize's budgets for the dense tiny-llama


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_serve_like_their_uncached_forward(mode: str, dtype: str) -> None:
    """As `tformer serve --quantize` prepares a model: each expert's gate and up fused, then quantized."""
    model = set_precision(make_model(moe_config()), dtype, mode)
    assert all(
        e.gate_up_proj is not None for m in model.modules() if isinstance(m, MixtureOfExperts) for e in m.experts
    )
    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(1, 18))]
    results = Engine(model, config=EngineConfig(block_size=4, num_blocks=32)).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0)
    )
    if dtype == "float32":  # fp32 paths stay exact
        assert [r.token_ids for r in results] == [reference_greedy(model, p, 8) for p in prompts]
        return
    # bf16: the cached and uncached forwards round differently; two bf16 steps at the largest logit (test_quantize)
    with torch.no_grad():
        largest = max(model(torch.tensor([p])).abs().max().item() for p in prompts)
    margin = 2 * 2.0 ** (math.floor(math.log2(largest)) - 7)
    for result, prompt in zip(results, prompts, strict=True):
        assert len(result.token_ids) == 8 and greedy_within_rounding(model, prompt, result.token_ids, margin)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_int4_experts_run_grouped_and_equal_each_expert_on_its_tokens(tokens: int, dtype: str) -> None:
    """Served INT4 experts (gate and up fused) run as one grouped gate/up call, one activation and one grouped down
    call (an INT8 down, as a GGUF file's Q6_K layers have, one call per expert): each token's mixture is, bit for
    bit, its k experts' own forwards mixed with its weights, as the dense reference mixes them."""
    model = set_precision(make_model(moe_config()), dtype, "int4")
    layers = moe_layers(model)
    for expert in layers[1].experts:  # layer 1: INT8 downs under the INT4 gate/up
        expert.down_proj = Int8Linear(torch.nn.Linear(64, 32, bias=False))
    calls: list[int] = []
    for layer in layers:
        for expert in layer.experts:
            expert.register_forward_hook(lambda module, args, out: calls.append(1))
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(2)).to(getattr(torch, dtype))
    with torch.no_grad():
        for layer in layers:
            weights, experts = layer.route(layer.router(x), layer.top_k)
            _, out = layer.mix(x, weights, experts)
            assert not calls  # no expert module ran: the grouped calls did
            outputs = [
                torch.cat([layer.experts[e](x[i : i + 1]) for e in experts[i].tolist()]) for i in range(tokens)
            ]  # (k, d) per token, each expert's own forward
            assert torch.equal(out, (torch.stack(outputs) * weights[..., None]).sum(1))
            torch.testing.assert_close(out.double(), dense_reference(layer, x, "topk-softmax"), atol=1e-5, rtol=1e-5)
            calls.clear()


def moe_layers(model: torch.nn.Module) -> list[MixtureOfExperts]:
    return [m for m in model.modules() if isinstance(m, MixtureOfExperts)]


@pytest.mark.parametrize("quantize, as_stored", [("int4", True), ("int8", False)], ids=["auto", "int8"])
def test_a_gguf_files_routers_stay_float_and_route_as_the_file_says(quantize: str, as_stored: bool, tmp_path) -> None:
    """A Mixtral file as llama.cpp quantizes one (matrices Q4_0, each router ffn_gate_inp kept F16), served as
    stored (`--quantize auto`) or as INT8: the experts are quantized, each router is a float `Router` holding the
    file's F16 weight, and on the served model's own hidden states it picks the experts the float formula picks."""
    routers = {f"blk.{i}.ffn_gate_inp.weight": Q.F16 for i in range(HF_SIZES["num_hidden_layers"])}
    path = gguf_writers.write(
        tmp_path / "moe.gguf", hf_mixtral(intermediate_size=64), "llama", Q.Q4_0, types=routers,
        keys=gguf_writers.TINY_TOKENIZER,
    )  # fmt: skip
    model, _ = load_quantized(path, quantize, as_stored=as_stored)
    set_precision(model, "float32", quantize)
    reader = open_gguf(path)
    files = {t.name: dequantize_tensor(reader, t) for t in reader.tensors if t.name in routers}
    seen: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}  # router -> (its input, its logits)
    for layer, name in zip(moe_layers(model), routers, strict=True):
        assert type(layer.router) is Router and torch.equal(layer.router.weight, files[name])
        assert isinstance(layer.experts[0].gate_up_proj, Int4Linear if quantize == "int4" else Int8Linear)
        layer.router.register_forward_hook(lambda router, args, out: seen.__setitem__(router, (args[0], out)))
    with torch.no_grad():
        model(torch.tensor([[5, 17, 3, 60, 42, 8, 91, 33, 12, 50]]))
        for layer, name in zip(moe_layers(model), routers, strict=True):
            x, logits = seen[layer.router]
            expected = x @ files[name].T  # the float router's formula, on the quantized model's hidden states
            torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(logits.topk(2).indices.sort().values, expected.topk(2).indices.sort().values)


def test_the_experts_op_runs_the_layer_its_key_names_and_a_copy_has_its_own() -> None:
    """`tformer::moe_experts`, what a compiled graph calls for a layer's experts, equals the dense mixture of the
    layer it names, and a deep copy (other weights here) is a layer of its own, not the one it was copied from."""
    layer = MixtureOfExperts(moe_config()).eval()
    twin = copy.deepcopy(layer)
    x = torch.randn(7, layer.router.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for param in twin.experts.parameters():
            param.mul_(-1.5)
        for each in (layer, twin):
            weights, experts = each.route(each.router(x), each.top_k)
            out = torch.ops.tformer.moe_experts(x, weights, experts, each.key)
            torch.testing.assert_close(out.double(), dense_reference(each, x, "topk-softmax"), atol=1e-6, rtol=1e-5)
    assert twin.key != layer.key


def test_compiled_decode_runs_moe_and_dense_layers_each_as_its_own() -> None:
    """EngineConfig(compile=True) on layers of two structures (layer 0 dense, layer 1 a mixture of experts): the
    experts run as one op (`tformer::moe_experts`) inside the decode step's one graph, so no Block's compiled frame
    is shared by layers of another structure (the step keeps no guards on modules). Decode steps of one row and of
    several; fp32, so the tokens are the uncached forward's exactly."""
    from torch._dynamo.utils import counters

    from tformer.engine.runner import compiled_decode_step

    model = make_model(moe_config(moe_dense_layers=[0]))
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=32, compile=True))
    graphs = counters["stats"]["unique_graphs"]
    prompts, params = [[5, 6, 7, 8], [3, 4, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = engine.generate(prompts[:1], params)[0].token_ids
    together = [r.token_ids for r in engine.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] == graphs + 2  # batch 1 and larger batches, each one whole graph
    assert compiled_decode_step(model.decoder).compiled is not None  # no eager fallback
    assert [alone, *together] == [reference_greedy(model, p, 6) for p in [prompts[0], *prompts]]


# ---- to_hf from a model trained here, and files tformer refuses ---------------------------------------------------


@pytest.mark.parametrize(
    "overrides, architecture",
    [
        ({}, "MixtralForCausalLM"),
        ({"qk_norm": True, "moe_router": "softmax-topk", "head_dim": 16}, "Qwen3MoeForCausalLM"),
        ({"qk_norm": True, "moe_d_ff": 24, "moe_dense_layers": [0]}, "Qwen3MoeForCausalLM"),
    ],
)
def test_a_tformer_moe_model_is_written_as_the_architecture_that_holds_it(
    overrides: dict, architecture: str, tmp_path
) -> None:
    model = make_model(moe_config(rope_theta=1e6, **overrides))
    to_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [architecture]
    hf = getattr(transformers, architecture).from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert from_hf(tmp_path).config == model.config


def test_moe_configs_no_architecture_holds_are_refused(tmp_path) -> None:
    from tformer.models import CheckpointError

    model = make_model(moe_config(moe_router="softmax-topk"))  # Qwen3-MoE's router, without its q/k norms
    expected = "(?s)MixtralForCausalLM: moe_router is 'softmax-topk'.*Qwen3MoeForCausalLM: qk_norm is False"
    with pytest.raises(CheckpointError, match=expected):
        to_hf(model, tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_local_experts": 0}, "num_local_experts=0: a mixture of experts needs at least one expert"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "use_sliding_window": True}, "use_sliding_window=true"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ],
)
def test_bad_moe_config_json_names_the_field(change: dict, message: str, tmp_path) -> None:
    from tformer.models import CheckpointError

    hf_mixtral().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=message):
        from_hf(tmp_path)


def test_a_missing_expert_tensor_is_named(tmp_path) -> None:
    from safetensors.torch import save_file

    from tformer.models import CheckpointError

    hf_mixtral().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensors .*layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        from_hf(tmp_path)
