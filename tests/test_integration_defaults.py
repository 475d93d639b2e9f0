"""Set-ups that used to run silently wrong now refuse with one clear line (issue 16, items 3, 5, 9, 12, 15),
each driven the way a user writes it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hdet
from hdet.app.cli import main


def test_a_scheduler_built_before_the_process_group_under_torchrun_is_refused(monkeypatch):
    """WORLD_SIZE=2 (torchrun) but no process group yet: it would be a lone replica, silently."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="WORLD_SIZE=2 .* none is initialised yet"):
        hdet.HDETLR(o, None, total_steps=10, ensemble_lr_spread_ratio=0.2)
    with pytest.raises(ValueError, match="Build the scheduler after torch.distributed.init_process_group"):
        hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=10)
    hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=10, world_size=1)  # one replica, said explicitly


def test_reduce_lr_on_plateau_is_refused_as_a_base():
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="got ReduceLROnPlateau, which steps on a validation metric"):
        hdet.HDETLR(o, torch.optim.lr_scheduler.ReduceLROnPlateau(o), total_steps=10)


def test_lightning_shorthand_scheduler_with_epoch_interval_is_refused(tmp_path):
    L = pytest.importorskip("lightning")
    from hdet.integrations.lightning import HDETCallback

    class Module(L.LightningModule):
        def __init__(self, shorthand):
            super().__init__()
            self.lin = nn.Linear(3, 1)
            self.shorthand = shorthand

        def training_step(self, batch, i):
            return nn.functional.mse_loss(self.lin(batch[0]), batch[1])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = hdet.OneCycleAutoLR(opt, max_lr=0.1, total_steps=8, model_sync_interval=2)
            if self.shorthand:  # Lightning's shorthand: interval "epoch"
                return [opt], [sched]
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1)),
                                       batch_size=4)
    kw = dict(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"interval 'epoch'.*HDET counts optimizer steps"):
        L.Trainer(callbacks=[HDETCallback()], **kw).fit(Module(True), data)
    module = Module(False)
    L.Trainer(callbacks=[HDETCallback()], **kw).fit(module, data)
    assert module.lr_schedulers().last_epoch == 8  # one hdet step per optimizer step


def test_cli_messages_name_the_commands(capsys):
    with pytest.raises(SystemExit):
        main([])
    err = capsys.readouterr().err
    assert "{train,plot,compare}" in err and "(see hdet --help)" in err and "hdet hdet" not in err
    with pytest.raises(SystemExit):
        main(["train", "--steps", "x"])
    assert "(see hdet train --help)" in capsys.readouterr().err
    for cmd in ("train", "compare", "plot"):  # an unknown option: the command's own help (it said hdet --help)
        with pytest.raises(SystemExit) as e:
            main([cmd, "run_dir", "--bogus"] if cmd == "plot" else [cmd, "--bogus"])
        assert e.value.code == 2
        assert f"unrecognized arguments: --bogus (see hdet {cmd} --help)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hdet {hdet.__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "(default: 400)" in out and "(default 0.2, and 0 with --lr-sweep" in " ".join(out.split())
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    out = capsys.readouterr().out
    for flag in ("--max-lr", "--auto-lr", "--warm-init", "--init-from", "--optimizer"):  # compare sets these itself
        assert flag not in out
    assert "--lr-high" in out and "--alpha" in out


def test_hf_trainer_with_reduce_lr_on_plateau_is_refused(tmp_path):
    """HDETTrainer with lr_scheduler_type='reduce_lr_on_plateau' (one process): a clear ValueError when the
    Trainer builds its scheduler, not a TypeError at the first step."""
    transformers = pytest.importorskip("transformers")
    from hdet.integrations.hf import HDETTrainer

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                                                 n_head=1))
    data = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 8
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                          lr_scheduler_type="reduce_lr_on_plateau", use_cpu=True, report_to=[],
                                          save_strategy="no", eval_strategy="steps", eval_steps=1)
    trainer = HDETTrainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                          hdet=dict(ensemble_lr_spread_ratio=0.2))
    with pytest.raises(ValueError, match="got ReduceLROnPlateau, which steps on a validation metric"):
        trainer.train()
