"""HDETTrainer (docs/hf_trainer.md), run by tests/test_integrations.py:

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out /tmp/hf

A tiny GPT-2 from GPT2Config (or with --classifier a tiny BERT classifier) trained by HDETTrainer
on 2 gloo processes, gradient accumulation 2; optionally stopped at a step and resumed from the
checkpoint. Each rank writes its final weights, LRs seen and HDET state."""

import argparse
import contextlib
import os
import sys
from unittest import mock

import torch
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, TrainerCallback,
                          TrainingArguments)

import hdet
from hdet.integrations.hf import HDETTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=256, ctx=16, uneven=False, label0=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        base = torch.arange(ctx) * 3
        self.x = (base + torch.randint(0, 8, (n, 1), generator=g)) % 64  # learnable: arithmetic sequences
        self.labels = self.x.clone()
        if uneven:  # no label at position 0 (nothing predicts it; --label0 keeps it), rank 1 every 4th label only
            if not label0:
                self.labels[:, 0] = -100
            if int(os.environ.get("RANK", 0)) == 1:
                self.labels[:, torch.arange(ctx) % 4 != 1] = -100

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.labels[i]}


class Classes(torch.utils.data.Dataset):
    """--classifier: sequences labelled by their sum mod 3, drawn apart on each rank."""

    def __init__(self, n=256, ctx=16):
        g = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
        self.x = torch.randint(0, 64, (n, ctx), generator=g)
        self.labels = self.x.sum(1) % 3

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.labels[i]}


class PredictAt(TrainerCallback):
    """--predict-at N: a callback's ``trainer.predict()`` and ``trainer.save_model()`` (inside ``averaged()``, on every
    rank) after step N;
    records every rank's own weights then (to average by hand), the prediction's loss, and whether this rank's own
    weights are back after."""

    def __init__(self, step, out):
        self.step, self.out, self.trainer, self.seen = step, out, None, None

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step != self.step:
            return
        own = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).clone()
        every = [torch.empty_like(own) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(every, own)
        loss = self.trainer.predict(Tokens(32, seed=1)).metrics["test_loss"]
        with self.trainer.lr_scheduler.averaged():  # (on every rank: docs/hf_trainer.md)
            self.trainer.save_model(os.path.join(self.out, f"saved-{self.step}"))
        back = torch.equal(torch.cat([q.detach().reshape(-1) for q in model.parameters()]), own)
        self.seen = {"replicas": torch.stack(every), "test_loss": loss, "own_back": back}


class Record(TrainerCallback):
    def __init__(self, stop_at=None):
        self.lrs, self.stop_at, self.logs, self.windows, self.hdet_logged = [], stop_at, [], [], []
        self.ce, self.own_losses = [0.0, 0], []  # this rank's per-token loss of each optimizer step
        self.evaluated = None  # (--eval-steps) a list: per evaluation, the weights evaluated, every rank's own, the loss
        self.clipped = []  # (--clip) per optimizer step: the gradient's norm after clipping, the explored norm
        self.went_back = []  # (--recover) the syncs where every replica went back to a kept state: (step, to step)

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kw):  # hdet's window losses at each sync
        lr_scheduler.ensemble.on_sync.append(lambda r: self.windows.append((r.step, r.losses)))
        lr_scheduler.ensemble.on_sync.append(
            lambda r: self.went_back.append((r.step, r.went_back_to)) if r.went_back_to is not None else None)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.logs.append((state.global_step, logs["loss"], logs.get("learning_rate")))
        if logs and "hdet/base/lr/0" in logs and "hdet/window_loss/replica1" in logs:  # each sync's, at its step
            self.hdet_logged.append(state.global_step)

    def on_train_end(self, args, state, control, model=None, **kw):  # what a reporting callback would upload
        self.end_params = [q.detach().clone() for q in model.parameters()]

    def on_pre_optimizer_step(self, args, state, control, model=None, lr_scheduler=None, **kw):  # (--clip)
        clips = [h for h in lr_scheduler.ensemble.hypers if isinstance(h, hdet.GradClip)] if lr_scheduler else []
        if clips:  # the norm the step is taken with, and the norm this replica was to be clipped to
            norm = torch.cat([q.grad.reshape(-1) for q in model.parameters() if q.grad is not None]).norm()
            self.clipped.append((float(norm), clips[0].max_norm))

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kw):  # (--eval-steps) what was evaluated
        seen = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).clone()
        self.evaluated.append({"step": state.global_step, "seen": seen, "replicas": self.replicas,
                               "eval_loss": metrics["eval_loss"]})

    def on_step_end(self, args, state, control, optimizer=None, model=None, **kw):
        if self.evaluated is not None:  # (--eval-steps) every rank's own weights after this step, to average by hand
            own = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
            self.replicas = [torch.empty_like(own) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(self.replicas, own)
            self.replicas = torch.stack(self.replicas)
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.own_losses.append(self.ce[0] / self.ce[1] if self.ce[1] else None)  # (None: no label token)
        self.ce = [0.0, 0]
        if self.stop_at is not None and state.global_step == self.stop_at:
            control.should_training_stop = True  # a "crash" right after the checkpoint of this step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--ga", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=20, help="optimizer steps (a resume may change it)")
    p.add_argument("--alpha", type=float, default=0.3, help="ensemble_lr_spread_ratio")
    p.add_argument("--nan-at", type=int, default=None, help="rank 1's loss is NaN in this optimizer step")
    p.add_argument("--own-scheduler", action="store_true", help="pass optimizers=(AdamW, a linear schedule) to the "
                   "Trainer: HDET wraps that schedule")
    p.add_argument("--uneven", action="store_true", help="rank 1's batches have a quarter of the labels")
    p.add_argument("--label0", action="store_true", help="with --uneven: keep the label at position 0 (a causal LM's "
                   "loss never predicts it)")
    p.add_argument("--empty-steps", default="", help="comma-separated optimizer steps whose batches have no label "
                   "token on rank 1 (an SFT sample whose answer was truncated away)")
    p.add_argument("--classifier", action="store_true", help="a tiny BERT sequence classifier instead of the GPT-2 "
                   "(its loss a plain mean: model.accepts_loss_kwargs = False, as docs/hf_trainer.md says)")
    p.add_argument("--own-loss", action="store_true", help="the Trainer subclass computes its own per-token loss "
                   "(a plain mean of this rank's tokens) without calling super().compute_loss")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N optimizer steps (eval_strategy "
                   '"steps") on held-out sequences')
    p.add_argument("--best", action="store_true", help="with --eval-steps: load_best_model_at_end on eval_loss")
    p.add_argument("--predict-at", type=int, default=None, help="a callback's trainer.predict() and save_model() "
                   "after this optimizer step")
    p.add_argument("--clip", type=float, default=0.0, help="explore the gradient-clipping norm around this value "
                   "(hdet.GradClip; the Trainer's max_grad_norm stays at its default)")
    p.add_argument("--recover", action="store_true", help='on_runaway="recover" (the stability guard)')
    p.add_argument("--judge-steps", type=int, default=25, help="with --recover: judge_steps")
    p.add_argument("--blow-up-from", type=int, default=None, help="rank 1's loss x100 from this optimizer step on "
                   "(a run that goes wrong)")
    p.add_argument("--blow-up-until", type=int, default=None, help="with --blow-up-from: the last such step")
    p.add_argument("--best-missing-on", default="", help="with --best: comma-separated ranks that do not see the "
                   "checkpoint folders (as on another node without save_on_each_node): the Trainer records no best "
                   "checkpoint there, nor loads one")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                       attn_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # a GPT-2 built from its config has none: transformers then counts position 0,
    # which its loss never predicts, among each sequence's tokens (docs/hf_trainer.md)
    if a.classifier:
        model = BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        model.accepts_loss_kwargs = False  # its forward takes **kwargs, its loss is a plain mean (docs/hf_trainer.md)
    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=4, gradient_accumulation_steps=a.ga,
                             max_steps=a.max_steps, save_steps=a.save_steps, logging_steps=5, learning_rate=3e-3,
                             lr_scheduler_type="linear", warmup_steps=2, use_cpu=True, report_to=[], seed=0,
                             ddp_backend="gloo", save_only_model=False, dataloader_num_workers=0,
                             **({"eval_strategy": "steps", "eval_steps": a.eval_steps, "per_device_eval_batch_size": 4}
                                if a.eval_steps else {}),
                             **({"load_best_model_at_end": True, "metric_for_best_model": "eval_loss"} if a.best else {}))
    rec = Record(a.stop_at)
    predict = PredictAt(a.predict_at, a.out)
    if a.eval_steps:
        rec.evaluated = []
    rank = int(os.environ.get("RANK", 0))

    class Trainer(HDETTrainer):  # the user's own compute_loss, with a fault on rank 1 if asked
        def compute_loss(self, model, inputs, *args, **kwargs):
            if a.own_loss:  # the user's own loss: this rank's per-token mean, the Trainer's scaling not asked for
                logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                         inputs["labels"][:, 1:].reshape(-1), ignore_index=-100)
            else:
                loss = super().compute_loss(model, inputs, *args, **kwargs)
            if rank == 1 and self.state.global_step + 1 == a.nan_at:
                loss = loss * float("nan")
            if (rank == 1 and model.training and a.blow_up_from is not None
                    and a.blow_up_from <= self.state.global_step + 1 <= (a.blow_up_until or a.max_steps)):
                loss = loss * 100.0
            if model.training and a.classifier:  # this rank's own mean loss, measured apart (dropout is off)
                with torch.no_grad():
                    logits = getattr(model, "module", model)(input_ids=inputs["input_ids"]).logits
                    rec.ce[0] += float(torch.nn.functional.cross_entropy(logits, inputs["labels"], reduction="sum"))
                    rec.ce[1] += len(inputs["labels"])
            elif model.training:  # this rank's own per-token loss, measured apart (no gradient; dropout is off)
                with torch.no_grad():
                    logits = getattr(model, "module", model)(input_ids=inputs["input_ids"]).logits[:, :-1]
                    labels = inputs["labels"][:, 1:]
                    rec.ce[0] += float(torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"))
                    rec.ce[1] += int((labels != -100).sum())
            return loss

        def _get_num_items_in_batch(self, batch_samples, device):  # (--empty-steps: before the Trainer counts them)
            if rank == 1 and self.model.training and str(self.state.global_step + 1) in a.empty_steps.split(","):
                for b in batch_samples:
                    b["labels"].fill_(-100)
            return super()._get_num_items_in_batch(batch_samples, device)

        def _save_checkpoint(self, *args, **kwargs):  # (where the Trainer records the best checkpoint)
            with self._hidden():
                return super()._save_checkpoint(*args, **kwargs)

        def _load_best_model(self):
            with self._hidden():
                return super()._load_best_model()

        def _hidden(self):  # --best-missing-on: this rank's disk does not hold the checkpoints (another node's)
            if str(rank) not in a.best_missing_on.split(","):
                return contextlib.nullcontext()
            folders, exists = os.path.join(a.out, "checkpoint-"), os.path.exists
            return mock.patch("os.path.exists", lambda q: not str(q).startswith(folders) and exists(q))

    own = {}
    if a.own_scheduler:
        from transformers import get_linear_schedule_with_warmup

        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        own = {"optimizers": (opt, get_linear_schedule_with_warmup(opt, 2, 20))}
    trainer = Trainer(model=model, args=args, train_dataset=Classes() if a.classifier else Tokens(uneven=a.uneven, label0=a.label0), callbacks=[rec] + ([predict] if a.predict_at else []), **own,
                      eval_dataset=Tokens(32, seed=1) if a.eval_steps else None,
                          hdet=dict(ensemble_lr_spread_ratio=a.alpha, model_sync_interval=5, controller="paper", enable_auto_lr=True,
                                    auto_lr_warmup_steps=10, loss_scale=0.05, final_lr=3e-4,  # (Eq. 8's target: the
                                    # Trainer's linear schedule ends at 0, no target for the paper controller's decay)
                                    explore=[hdet.GradClip(a.clip)] if a.clip else [],
                                    **({"on_runaway": "recover", "judge_steps": a.judge_steps} if a.recover else {})))
    predict.trainer = trainer
    trainer.train(resume_from_checkpoint=a.resume)
    s = trainer.lr_scheduler
    torch.save({"params": [q.detach().clone() for q in model.parameters()], "lrs": rec.lrs,
                "bases": s.base_lrs_now, "updates": s.ensemble.controllers[0].updates if s.ensemble.controllers[0]
                else 0, "perms": s.ensemble.perms, "step": s.last_epoch, "world": s.world_size, "logs": rec.logs,
                "windows": rec.windows, "guard": s.gradient_guard, "hdet_logged": rec.hdet_logged,
                "own_losses": rec.own_losses, "end_params": rec.end_params, "evaluated": rec.evaluated, "clipped": rec.clipped, "scheduler": type(s).__name__,
                "trainer_shifts_labels": bool(getattr(trainer, "_loss_shifts_labels", True)),
                "finite": all(bool(torch.isfinite(q).all()) for q in model.parameters()),
                "best_checkpoint": trainer.state.best_model_checkpoint,
                "went_back": rec.went_back, "predicted": predict.seen},
               os.path.join(a.out, f"result_rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # leave without C++ destructors: gloo may abort at teardown ("terminate called without an active
    # exception"), which would turn a finished run into a failed one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
