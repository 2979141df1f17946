"""The training loop: token-budget batches, label-smoothed loss, accumulation, clipping, bf16 autocast, durable
checkpoints with bit-exact resume, dev BLEU, metrics in JSONL and TensorBoard (sinks.py), a progress bar, a clean stop
on Ctrl-C or SIGTERM, and an error that says where a diverged step went non-finite or what to change when memory runs
out (diagnose.py).

Resuming: every checkpoint stores the optimizer and scheduler state and the data cursor, and every random
choice in a step is drawn from generators seeded by (seed, step) (seeds.py), so a run killed at any point and
restarted continues to the same weights as an uninterrupted run (bit-exact on the CPU).

On several processes (torchrun; training/distributed.py) every rank walks the same global stream of
batches; a step takes `grad_accum` of them and each data-parallel rank trains on its share, so the global
batch and the loss curve do not depend on the number of ranks. Only rank 0 logs, evaluates and writes the
files that are not sharded.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tformer.checkpoints import best_from_states, checkpoint_dir, recorded_best
from tformer.config import ModelConfig
from tformer.data import Cursor, LMBatch, Seq2SeqBatch, TokenBatchSampler, Vocab
from tformer.errors import TrainingDiverged, TrainingOutOfMemory
from tformer.models import CheckpointError, TransformerModel, build_model
from tformer.training.checkpoint import (
    RunLock,
    begin_checkpoint,
    check_recipe,
    commit_checkpoint,
    drop_records_after,
    newest_valid_checkpoint,
    pending_dir,
    prune_checkpoints,
    record_best,
    recover_checkpoints,
    rewrite_trainer_state,
    write_checkpoint_files,
    write_recipe,
)
from tformer.training.config import TrainConfig, check_objective
from tformer.training.corpus import PreparedData, batch_objective, prepare_data
from tformer.training.diagnose import (
    LossSpikes,
    NonFinite,
    diverged_message,
    is_out_of_memory,
    locate_non_finite,
    out_of_memory_message,
)
from tformer.training.distributed import (
    clip_gradients,
    full_state_dict,
    gradient_sync,
    init_distributed,
    is_collective_failure,
    parallelize,
)
from tformer.training.evaluate import dev_scores, evaluate_translation, forward_logits
from tformer.training.host_memory import keep_freed_memory
from tformer.training.init_from import load_init_from, vocab_of
from tformer.training.lora import load_weights, with_lora
from tformer.training.losses import fused_label_smoothed_cross_entropy, label_smoothed_cross_entropy, moe_aux_loss
from tformer.training.optim import adamw_cosine, paper_adam
from tformer.training.precision import TrainingPrecision
from tformer.training.progress import Progress
from tformer.training.seeds import seed_dropout, stream_seed
from tformer.training.sharded import SHARDED_DIR, load_sharded, save_sharded
from tformer.training.sinks import MetricsSinks
from tformer.viz import plot_training_curves


class Trainer:
    """Trains `model_config` with `train_config`, writing everything into `train_config.out_dir`."""

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, device: str = "cpu") -> None:
        check_objective(model_config, train_config)
        self.config = train_config
        self.run_dir = Path(train_config.out_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"  # one JSON record per line
        self.dist = init_distributed(train_config, torch.device(device))
        self.device = self.dist.device
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # one run at a time in a run directory: a second one would delete the first's pending checkpoints
        self.lock = RunLock(self.run_dir) if self.dist.is_main else None
        self.sinks: MetricsSinks | None = None  # where rank 0 logs (train.log_to), opened once resumed
        try:
            self._set_up(model_config, train_config)
        except BaseException:
            self.close()
            raise

    def _set_up(self, model_config: ModelConfig, train_config: TrainConfig) -> None:
        if self.dist.is_main:
            recover_checkpoints(self.run_dir)  # what a crash left half done, before any rank reads the checkpoints
        if not self.dist.is_main:  # rank 0 trains the tokenizer (or finds it) first; the others then load it
            self.dist.barrier()
        # fine-tuning: the weights (on every rank) and their tokenizer; resuming then overwrites the weights
        pretrained = load_init_from(model_config, train_config.init_from) if train_config.init_from else None
        self.data: PreparedData = prepare_data(train_config, self.run_dir, pretrained and pretrained.tokenizer)
        if self.dist.is_main:
            self.dist.barrier()
        tokenizer = self.data.tokenizer
        self.model_config = (
            model_config
            if pretrained
            else replace(
                model_config, vocab_size=tokenizer.vocab_size, tgt_vocab_size=None, pad_token_id=tokenizer.pad_id
            )
        )
        # the run's tokenizer and checkpoints were made by the recipe in its train.yaml: another one is refused
        check_recipe(self.run_dir, self.config.recipe(self.model_config), force=train_config.resume == "force")
        if self.dist.is_main:
            write_recipe(self.run_dir, self.config.recipe(self.model_config))
        torch.manual_seed(train_config.seed)
        model = (pretrained.model if pretrained else build_model(self.model_config)).to(self.device)
        self.model = with_lora(model, train_config.lora_config, self.dist.enabled)  # a lora: section: adapters only
        self.module = parallelize(self.model, self.dist, train_config)  # what forward runs on (DDP wraps)
        self._consolidated_model: nn.Module | None = None  # rank 0's unsharded copy, for evaluation and export
        self.optimizer, self.scheduler = self._optimizer()
        self.sampler = TokenBatchSampler(self.data.lengths, train_config.max_tokens, seed=train_config.seed)
        self.vocab = vocab_of(tokenizer) if pretrained else Vocab.of(tokenizer)
        self.step, self.cursor, self.best_bleu, self.elapsed = 0, Cursor(), -1.0, 0.0
        self.stop_requested = False
        self.grad_norm = math.nan  # of the last step, before clipping
        self.aux_loss: float | None = None  # a mixture of experts' load-balancing loss in the last step
        self.spikes = LossSpikes()
        self.saved_step = -1
        resumed = self._resume()
        if self.dist.is_main:  # TensorBoard then hides what a killed run logged after this checkpoint
            c = train_config
            self.sinks = MetricsSinks(c.log_to, self.run_dir, self.model, c.histogram_every, self.step)
        self.precision = TrainingPrecision(train_config, self.model, self.module, self.dist)
        if resumed is not None:  # fp16: the loss scale and its growth tracker go on where the run stopped
            self.precision.load_state_dict(resumed.get("precision", {}))
        keep_freed_memory(self.device)  # CPU: the same large activations every step reuse their pages
        # with a time budget the step count is not the limit: show the budget left instead of a step ETA
        total = None if train_config.time_budget else train_config.max_steps
        self.progress = Progress(self.dist.is_main, total, self.step)

    # ---- setup -----------------------------------------------------------------------------------------
    def _optimizer(self) -> tuple:
        c = self.config
        fused = self.dist.strategy != "tp"  # tp alone mixes DTensor and plain parameters (see optim.py)
        if c.optimizer == "adam-noam":
            return paper_adam(self.model, self.model_config.d_model, c.warmup, scale=c.lr, fused=fused)
        return adamw_cosine(self.model, c.lr, c.warmup, c.max_steps, weight_decay=c.weight_decay, fused=fused)

    def _resume(self) -> dict | None:
        """Continues from the newest checkpoint that is complete and readable, naming the newer ones skipped;
        returns its trainer state (None when there is none)."""
        latest, state, skipped = newest_valid_checkpoint(self.run_dir)
        if skipped and self.dist.is_main:
            print(f"warning: skipped checkpoints that cannot be resumed: {'; '.join(skipped)}", file=sys.stderr)
        if latest is None:
            if skipped:  # never train from the start over a run's checkpoints
                raise CheckpointError(
                    f"{self.run_dir} holds no checkpoint that can be resumed ({'; '.join(skipped)}); delete them (or "
                    "the run directory) to train from the start, or set train.out_dir to a new directory"
                )
            return None
        if (latest / SHARDED_DIR).is_dir():
            load_sharded(latest / SHARDED_DIR, self.module, self.optimizer)
        elif self.dist.enabled:
            raise CheckpointError(
                f"{latest} was written by an older tformer without a sharded/ state; resume it in one process "
                f"(its next checkpoint then resumes on any number of ranks)"
            )
        else:  # a LoRA run's adapters, or written before checkpoints had a sharded/ directory
            load_weights(self.model, latest, str(self.device))
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.cursor = state["step"], Cursor.from_dict(state["cursor"])
        self.best_bleu, self.elapsed = state["best_bleu"], state["elapsed"]
        self.saved_step = self.step
        if self.dist.is_main:
            drop_records_after(self.metrics_path, self.step)
            self._repair_best_record()
            print(f"resumed from {latest} (step {self.step})")
        return state

    def _repair_best_record(self) -> None:
        """Records the best checkpoint again from the checkpoints' trainer states when best.json does not name it:
        a run killed after committing a new best but before writing best.json, or a best.json lost or damaged."""
        found = best_from_states(self.run_dir)
        recorded, problem = recorded_best(self.run_dir)
        if found is None or found[0] == recorded:
            return
        best, bleu = found
        compared = min(self.config.eval_sentences, len(self.data.dev))
        record_best(self.run_dir, int(best.name.removeprefix("step-")), bleu, compared)
        if recorded is not None:
            problem = f"best.json named {recorded.name}, but {best.name} scored higher (its record was cut short)"
        print(f"warning: {problem or 'best.json was missing'}; recorded {best.name} as the best", file=sys.stderr)

    def close(self) -> None:
        """Lets another run train in this run directory (releases its lock) and closes the metric sinks; `fit` calls
        it when it ends."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None

    # ---- one optimizer step ----------------------------------------------------------------------------
    def _batch(self, indices: list[int], micro_step: int) -> Seq2SeqBatch | LMBatch:
        generator = torch.Generator().manual_seed(stream_seed(self.config.seed, micro_step))
        examples = [self.data.examples[i] for i in indices]
        return batch_objective(self.config)(examples, self.vocab, generator).to(self.device)

    def train_step(self, batches: list[Seq2SeqBatch | LMBatch]) -> tuple[float, int]:
        """One optimizer step over this rank's `batches` (gradient accumulation); returns (mean loss per token,
        tokens), both over all ranks. The loss is normalised by the step's global token count."""
        self.precision.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        local_tokens = sum(int((b.labels != -100).sum()) for b in batches)
        n_tokens = int(self.dist.sum_over_data_parallel([local_tokens])[0])
        dp_size = self.dist.dp_size  # DDP and FSDP average gradients over the dp ranks: scale that back to a sum
        total, aux_total = 0.0, None if self.model_config.n_experts == 0 else 0.0
        for i, batch in enumerate(batches):
            with gradient_sync(self.module, sync=i == len(batches) - 1):
                with self.precision.autocast():
                    logits = forward_logits(self.precision.module, batch)
                loss_sum, _ = fused_label_smoothed_cross_entropy(logits, batch.labels, self.config.label_smoothing)
                loss = loss_sum / n_tokens * dp_size
                # a mixture of experts' load-balancing loss: a mean over tokens, so each micro-batch adds its share
                aux = moe_aux_loss(self.precision.module, getattr(batch, "attention_mask", None))
                if aux is not None:
                    loss = loss + self.model_config.router_aux_loss_coef * aux / len(batches)
                    aux_total += aux.item() / len(batches)
                self.precision.backward(loss)  # fp16: of the scaled loss
            total += loss_sum.item()
        self.aux_loss = None if aux_total is None else self.dist.sum_over_data_parallel([aux_total])[0] / dp_size
        self.precision.after_backward()  # bf16 weights: their gradients become the fp32 masters'
        self.precision.unscale(self.optimizer)  # fp16 loss scaling: true gradients before clipping
        total = self.dist.sum_over_data_parallel([total])[0]
        grad_norm = clip_gradients(
            self.model.parameters(), self.config.clip_grad if self.config.clip_grad > 0 else math.inf
        )
        finite = math.isfinite(total) and bool(torch.isfinite(grad_norm))
        if self.precision.skips(finite):  # fp16 overflow: the scaler skips the step and halves its scale
            self.grad_norm = grad_norm.item()
            self.precision.step(self.optimizer)
            self.scheduler.step()
            return total / n_tokens, n_tokens
        if not finite:
            culprit = None if self.dist.enabled else self._locate_non_finite(batches)
            raise TrainingDiverged(
                diverged_message(
                    self.step + 1, total / n_tokens, grad_norm.item(), culprit, self.config, self.model.config
                )
            )
        self.grad_norm = grad_norm.item()
        self.precision.step(self.optimizer)
        self.precision.after_step()
        self.scheduler.step()
        return total / n_tokens, n_tokens

    def _step_or_explain(self, batches: list[Seq2SeqBatch | LMBatch]) -> tuple[float, int]:
        """`train_step`, with an allocation failure turned into the estimate and the fixes, in order."""
        try:
            return self.train_step(batches)
        except (MemoryError, RuntimeError) as err:
            if not is_out_of_memory(err):
                raise
            message = out_of_memory_message(self.step + 1, err, self.config, self.model.config, self.dist.dp_size)
            raise TrainingOutOfMemory(message) from None

    def _locate_non_finite(self, batches: list[Seq2SeqBatch | LMBatch]) -> NonFinite | None:
        """Replays this step's batches, with its dropout masks, and names the first module that went non-finite."""
        seed_dropout(self.config.seed, self.step, self.dist.dp_rank)
        for batch in batches:

            def replay(batch: Seq2SeqBatch | LMBatch = batch) -> torch.Tensor:
                with self.precision.autocast():
                    logits = forward_logits(self.precision.model, batch)
                return label_smoothed_cross_entropy(logits, batch.labels, self.config.label_smoothing)[0]

            if (culprit := locate_non_finite(self.precision.model, replay)) is not None:
                return culprit
        return None

    # ---- the loop ---------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Trains until max_steps, the time budget or Ctrl-C; returns the final evaluation."""
        try:
            return self._fit()
        except RuntimeError as err:
            if self.dist.enabled and is_collective_failure(err):
                raise self.dist.failure(err) from err
            raise
        finally:
            self.close()

    def _fit(self) -> dict:
        c = self.config
        dist = self.dist
        stream = self.sampler.iterate(self.cursor)  # the global stream: the same on every rank
        # Ctrl-C, or SIGTERM (a scheduler's preemption): finish the step, save, exit cleanly
        previous_handlers = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        window_tokens, window_loss, window_start = 0, 0.0, self.elapsed  # training time only, no eval
        if c.init_from and self.step == 0:  # the pretrained model's dev score: the baseline of a fine-tune
            self._evaluate(c.eval_sentences)
        try:
            while self.step < c.max_steps and not dist.any_rank(self.stop_requested or self._out_of_time()):
                started = time.perf_counter()
                seed_dropout(c.seed, self.step, dist.dp_rank)
                batches = []
                for j in range(c.grad_accum):  # the step's global batches; each dp rank trains on its share
                    indices, self.cursor = next(stream)
                    if dist.takes_batch(j):
                        batches.append(dist.local_part(self._batch(indices, self.step * c.grad_accum + j)))
                loss, n_tokens = self._step_or_explain(batches)
                self.step += 1
                if self.precision.last_step_skipped:
                    self.progress.write(
                        f"fp16: step {self.step} overflowed and was skipped; {self.precision.metrics()}"
                    )
                if (average := self.spikes.check(loss)) is not None:
                    self.progress.write(
                        f"warning: step {self.step}: loss {loss:.3f} jumped above "
                        f"{self.spikes.factor:g}x its recent average {average:.3f}"
                    )
                self.elapsed += time.perf_counter() - started
                window_tokens += n_tokens
                window_loss += loss * n_tokens
                self.progress.advance()
                if self.step % c.log_every == 0:
                    rate = window_tokens / max(self.elapsed - window_start, 1e-9)
                    lr, mean_loss = self.scheduler.get_last_lr()[0], window_loss / window_tokens
                    left = c.time_budget - self.elapsed if c.time_budget else None
                    self.progress.report(self.step, mean_loss, lr, rate, left)
                    self._log(
                        {
                            "step": self.step,
                            "loss": mean_loss,
                            "lr": lr,
                            "grad_norm": self.grad_norm,
                            **({} if self.aux_loss is None else {"aux_loss": self.aux_loss}),
                            **self.precision.metrics(),
                            "tokens_per_s": rate,
                            "elapsed": self.elapsed,
                        }
                    )
                    window_tokens, window_loss, window_start = 0, 0.0, self.elapsed
                if self.step % c.eval_every == 0:
                    self._evaluate(c.eval_sentences)
                if self.step % c.save_every == 0:
                    self._save()
        finally:
            self.progress.close()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
        interrupted = dist.any_rank(self.stop_requested)
        if interrupted and dist.is_main:
            print(f"interrupted: saving a checkpoint at step {self.step}; the same command resumes the run")
        self._save()
        return self._final_evaluation(evaluate=not interrupted)

    def _request_stop(self, signum: int, frame: object) -> None:
        if self.stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop_requested = True

    def _out_of_time(self) -> bool:
        return self.config.time_budget > 0 and self.elapsed >= self.config.time_budget

    def _save(self, new_best: tuple[float, int] | None = None) -> None:
        """A checkpoint of this step (a collective: every rank writes its shards, rank 0 the rest).

        When this step is already on disk (a new best on a save step, or the final evaluation's new best after
        the last save), only its trainer state is rewritten, by rank 0, so that it agrees with best.json.
        `new_best` (BLEU, sentences compared) names this step the best in best.json once its checkpoint is
        committed, and before older checkpoints are pruned.
        """
        state = {
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "cursor": self.cursor.to_dict(),
            "best_bleu": self.best_bleu,
            "elapsed": self.elapsed,
            "precision": self.precision.state_dict(),  # fp16 loss scaling's scale and growth tracker
        }
        if self.config.lora is not None:  # one process, no sharded/: the adapters' optimizer state goes in here
            state["optimizer"] = self.optimizer.state_dict()
        if self.saved_step == self.step:
            if self.dist.is_main:
                rewrite_trainer_state(checkpoint_dir(self.run_dir, self.step), state)
                if new_best is not None:
                    record_best(self.run_dir, self.step, *new_best)
            return
        weights = self._consolidated()
        tmp = begin_checkpoint(self.run_dir, self.step) if self.dist.is_main else pending_dir(self.run_dir, self.step)
        self.dist.barrier()
        if self.config.lora is None:
            save_sharded(tmp / SHARDED_DIR, self.module, self.optimizer)
        self.dist.barrier()  # every rank's shards are on disk before the directory gets its real name
        if self.dist.is_main:
            write_checkpoint_files(tmp, weights, self.data.tokenizer, state)
            commit_checkpoint(tmp)
            if new_best is not None:
                record_best(self.run_dir, self.step, *new_best)
            prune_checkpoints(self.run_dir, self.config.keep_last)
        self.dist.barrier()
        self.saved_step = self.step

    def _consolidated(self) -> TransformerModel | None:
        """The whole model with the current weights on rank 0 (None elsewhere); a collective when sharded."""
        if not self.dist.enabled:
            return self.model
        weights = full_state_dict(self.module)
        if not self.dist.is_main:
            return None
        if self._consolidated_model is None:
            self._consolidated_model = build_model(self.model_config)
        self._consolidated_model.load_state_dict(weights)
        return self._consolidated_model

    def _evaluate(self, n_sentences: int | None, final: bool = False) -> dict:
        """Dev BLEU (or perplexity), computed by rank 0 on the consolidated model; saves a new best.

        The best checkpoint is chosen on the same dev sentences every time, the first `eval_sentences`: the
        final evaluation decodes the whole dev set and reports its BLEU, but competes with the score of those
        first sentences. It comes after the last save, so the other ranks need not wait for its score."""
        if not self.data.dev or self.config.objective not in ("seq2seq", "clm", "classification"):
            return {}
        dev = self.data.dev[:n_sentences] if n_sentences else self.data.dev
        model = self._consolidated()
        if self.config.objective != "seq2seq":  # perplexity or accuracy, on rank 0
            if not self.dist.is_main:
                return {}
            data, vocab, max_len = self.data, self.vocab, self.config.max_len
            scores, line = dev_scores(self.config.objective, model, data.tokenizer, vocab, dev, max_len, self.device)
            self._log({"step": self.step, **scores})
            self.progress.write(f"step {self.step}: {line}")
            return scores
        result = None
        if self.dist.is_main:
            result = evaluate_translation(
                model, self.data.tokenizer, dev, self.config.beam_size, self.config.length_penalty
            )
            self._log({"step": self.step, "dev_bleu": result.bleu, "dev_sentences": len(dev)})
            self.progress.write(f"step {self.step}: dev BLEU {result.bleu:.2f} on {len(dev)} sentences")
        compared = min(self.config.eval_sentences, len(dev))
        local_bleu = result.bleu_of_first(compared) if result else -1.0  # no score on the ranks other than 0
        bleu = local_bleu if final else self.dist.from_main(local_bleu)
        if bleu > self.best_bleu:
            self.best_bleu = bleu  # before the save: the saved state agrees with best.json
            self._save(new_best=(bleu, compared))
        if result is None:  # final evaluation on a rank other than 0
            return {}
        return {
            "dev_bleu": result.bleu,
            "dev_sentences": len(dev),
            "dev_seconds": result.seconds,
            "samples": result.samples(3),
        }

    def _final_evaluation(self, evaluate: bool = True) -> dict:
        """The whole dev set's score (skipped after Ctrl-C, which should exit promptly) and the curves PNG."""
        final = {"step": self.step, "elapsed": self.elapsed}
        if self.data.dev and evaluate:
            final.update({"dev_sentences": len(self.data.dev), **self._evaluate(None, final=True)})
        if self.dist.is_main and self.metrics_path.is_file():
            final["curves"] = str(plot_training_curves(self.metrics_path, self.run_dir / "curves.png"))
        return final

    def _log(self, record: dict) -> None:
        if self.sinks is not None:
            self.sinks.write(record)
