"""HDETCallback with Lightning (docs/lightning.md), run by tests/test_integrations.py:

    python examples/lightning_ddp.py --out /tmp/lt

Lightning ddp_spawn on CPU, 2 devices, with
HDETCallback; optionally stopped after a checkpoint and resumed from it. Each rank writes its results
(result_rank{r}.pt)."""

import argparse
import os

import lightning as L
import torch
from torch import nn

import hdet
from hdet.integrations.lightning import HDETCallback

STEPS = 16


class Data(torch.utils.data.Dataset):
    def __init__(self, n=128, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)  # 8 batches per rank and epoch: checkpoints at epoch ends
        self.y = self.x[:, :1] * 2 - self.x[:, 1:2]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Module(L.LightningModule):
    def __init__(self, bn=False, fused=False, nan_at=0, clip=0.0):
        super().__init__()
        self.fused, self.nan_at, self.clip = fused, nan_at, clip
        self.clipped = []  # (--clip) per optimizer step: the gradient's norm the step is taken with, the explored norm
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.ReLU(), nn.Linear(16, 1))
        self.lrs, self.raw_losses, self.windows = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.raw_losses.append(float(loss.detach()))  # the true per-batch loss (Lightning divides what it backpropagates)
        if self.global_rank == 1 and self.trainer.global_step + 1 == self.nan_at:  # (--nan-at: a fault on one rank)
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_before_optimizer_step(self, optimizer):  # (after HDETCallback's: the gradients the step is taken with)
        if self.clip:
            norm = torch.cat([p.grad.reshape(-1) for p in self.parameters() if p.grad is not None]).norm()
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                norm = norm / scaler.get_scale()  # ("16-mixed" + fused: Lightning leaves them scaled until the step)
            clip = [h for h in self.trainer.lr_scheduler_configs[0].scheduler.ensemble.hypers
                    if isinstance(h, hdet.GradClip)][0]
            self.clipped.append((float(norm), clip.max_norm))

    def validation_step(self, batch, batch_idx):  # (--val) the metric a user monitors: the mean over every rank
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01, fused=self.fused or None)
        sched = hdet.OneCycleAutoLR(opt, max_lr=0.02, total_steps=STEPS, ensemble_lr_spread_ratio=0.3,
                                    model_sync_interval=4, controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=4,
                                    loss_scale=0.05, seed=3,  # no model=: as the docs write it
                                    explore=[hdet.GradClip(self.clip)] if self.clip else [])
        sched.ensemble.on_sync.append(lambda r: self.windows.append((r.step, r.losses)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Report(L.Callback):
    def __init__(self, out, ema=False):
        self.out = out
        self.validated = []  # (--val) per validation: step, this rank's weights and every rank's, then the metric
        self.ema, self.shadow, self.shadow_step, self.mid = ema, None, 0, None  # (--ema) see on_train_batch_end

    def on_validation_start(self, trainer, pl_module):  # (after HDETCallback's: the weights validated)
        if not trainer.sanity_checking:
            own = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            self.validated.append({"step": trainer.global_step, "seen": own.clone(),
                                   "replicas": pl_module.all_gather(self.before)})

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validated[-1]["val_loss"] = float(trainer.callback_metrics["val_loss"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # this rank's own weights
        self.before = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone()
        if self.ema and trainer.global_step > self.shadow_step:  # (--ema) this rank's own EMA, never averaged, updated
            # as EMAWeightAveraging updates its own: by linearity the ranks' mean is the ensemble's EMA
            if self.shadow is None:
                self.shadow = torch.optim.swa_utils.AveragedModel(
                    pl_module, use_buffers=True, avg_fn=torch.optim.swa_utils.get_ema_avg_fn(EMA_DECAY))
            self.shadow.update_parameters(pl_module)
            self.shadow_step = trainer.global_step
            if trainer.global_step == 6:  # (the mid-window checkpoint's step: saved after this hook)
                self.mid = {"ema": pl_module.all_gather(_flat(self.shadow.module)).mean(0),
                            "live": pl_module.all_gather(self.before).mean(0)}

    def on_train_end(self, trainer, pl_module):
        sched = trainer.lr_scheduler_configs[0].scheduler
        params = [p.detach().clone() for p in pl_module.parameters()]
        gathered = [pl_module.all_gather(torch.cat([p.reshape(-1) for p in params]))]
        bufs = [b.reshape(-1).float() for b in pl_module.buffers() if b.is_floating_point()]
        bufs = pl_module.all_gather(torch.cat(bufs)) if bufs else None
        torch.save({"params": gathered[0], "lrs": pl_module.lrs, "updates": sched.ensemble.controllers[0].updates,
                    "step": sched.last_epoch, "bases": sched.base_lrs_now, "buffers": bufs,
                    "guard": sched.gradient_guard, "raw_losses": pl_module.raw_losses, "windows": pl_module.windows,
                    "rank": sched.rank, "validated": self.validated, "clipped": pl_module.clipped, "skipped": None if sched.skip_guard is None or sched.skip_guard.skipped is None
                    else float(sched.skip_guard.skipped),
                    "finite": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()),
                    "ema_mean": None if self.shadow is None else pl_module.all_gather(_flat(self.shadow.module)).mean(0),
                    "ema_mid": self.mid},
                   os.path.join(self.out, f"result_rank{trainer.global_rank}.pt"))


EMA_DECAY = 0.8


def ema_fn(averaged, current, num_averaged):  # (a module's function: ddp_spawn pickles the callbacks, and
    return EMA_DECAY * averaged + (1 - EMA_DECAY) * current  # EMAWeightAveraging's get_ema_avg_fn closure fails)


class EMA(L.pytorch.callbacks.WeightAveraging):  # EMAWeightAveraging(decay=EMA_DECAY), as lightning's docs write it
    def __init__(self):
        super().__init__(avg_fn=ema_fn, use_buffers=True)

    def should_update(self, step_idx=None, epoch_idx=None):
        return step_idx is not None


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=STEPS)
    p.add_argument("--resume", default=None)
    p.add_argument("--bn", action="store_true", help="a BatchNorm layer in the model")
    p.add_argument("--fp16", action="store_true", help='precision "16-mixed" with a GradScaler (on the CPU)')
    p.add_argument("--fused", action="store_true", help="a fused Adam (the skip guard)")
    p.add_argument("--nan-at", type=int, default=0, help="rank 1's loss is NaN at this optimizer step")
    p.add_argument("--precision", default="32-true", help='Lightning\'s precision, e.g. "bf16-true" (bf16 weights)')
    p.add_argument("--clip", type=float, default=0.0, help="explore the gradient-clipping norm around this value "
                   "(hdet.GradClip; HDETCallback clips with it)")
    p.add_argument("--ema", choices=["before", "after"], default=None, help="lightning's WeightAveraging as an EMA, before or "
                   "after HDETCallback in callbacks=[...]; a checkpoint mid-window (mid-step=6.ckpt)")
    p.add_argument("--val", type=int, default=0, help="validate every N training batches (a val_loss-monitoring "
                   "ModelCheckpoint saves val-step=<step>.ckpt at each)")
    a = p.parse_args()
    torch.set_num_threads(1)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=a.out, every_n_train_steps=8, save_top_k=-1)
    best = [L.pytorch.callbacks.ModelCheckpoint(dirpath=a.out, filename="val-{step}", monitor="val_loss",
                                                save_top_k=-1)] if a.val else []
    callbacks = [HDETCallback()]
    if a.ema:
        ema = EMA()
        callbacks = [ema, *callbacks] if a.ema == "before" else [*callbacks, ema]
        best.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=a.out, filename="mid-{step}", every_n_train_steps=6,
                                                        save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=a.max_steps,
                        accumulate_grad_batches=2, callbacks=[*callbacks, ckpt, *best, Report(a.out, bool(a.ema))],
                        limit_val_batches=None if a.val else 0, val_check_interval=a.val or None,
                        num_sanity_val_steps=0,
                        plugins=[L.pytorch.plugins.MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler(
                            "cpu", init_scale=2.0 ** 12))] if a.fp16 else None,
                        logger=L.pytorch.loggers.CSVLogger(a.out, name="logs", version=0), log_every_n_steps=5,
                        enable_progress_bar=False, enable_model_summary=False,
                        **({} if a.fp16 else {"precision": a.precision}))
    loader = torch.utils.data.DataLoader(Data(), batch_size=8, shuffle=False)
    val = torch.utils.data.DataLoader(Data(64, seed=1), batch_size=8) if a.val else None
    trainer.fit(Module(a.bn, a.fused, a.nan_at, a.clip), loader, val, ckpt_path=a.resume)


if __name__ == "__main__":
    main()
