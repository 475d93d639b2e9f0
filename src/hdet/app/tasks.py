"""The CLI's tasks, on data that every machine has: no download, ever.

* ``bytes``: a byte-level GPT on the CPython standard library's own ``.py`` files (files whose name
  hashes to 0 mod 10 are held out for validation). The corpus depends on the Python version: record it.
* ``fashion``: a small CNN on Fashion-MNIST read from the gz IDX files of Debian's
  ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``) or ``--data DIR``.

A task gives a model factory, a sampler of per-replica batches and a loss; batches are drawn from a
task-owned generator, so the global RNG stays the model's.
"""

from __future__ import annotations

import gzip
import math
import struct
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import under_vmap
from ..hyper import group_params

__all__ = ["ByteGPT", "SmallCNN", "Task", "make_task", "load_stdlib", "load_fashion_mnist", "FASHION_DIR",
           "TaskError", "param_groups"]

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


class TaskError(ValueError):
    """A task cannot be built from what was given (unknown name, missing or malformed data)."""


# -- models -------------------------------------------------------------------------------------------
def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, attn: str = "auto") -> None:
        super().__init__()
        self.heads = heads
        self.attn = attn
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, L, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.attn == "sdpa" or (self.attn == "auto" and h.is_cuda and not (under_vmap(q) and _compiling())):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (the engine folds its replicas into one call)
        else:  # explicit attention: compiled under torch.func.vmap, the CUDA memory-efficient kernel's backward
            # fails ("LSE is not correctly aligned"); on the CPU as the runs recorded so far
            causal = torch.ones(L, L, dtype=torch.bool, device=h.device).triu_(1)
            a = (q @ k.transpose(-2, -1)).mul_(q.shape[-1] ** -0.5).masked_fill_(causal, float("-inf"))
            a = a.softmax(-1) @ v
        h = h + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, d)))
        return h + self.drop(self.mlp(self.ln2(h)))


class ByteGPT(nn.Module):
    """A small pre-norm causal transformer over bytes (vocabulary 256), head tied to the embedding.

    ``attn="auto"``: fused SDPA on CUDA (under the engine's eager vmap too: :mod:`hdet.attention`), explicit attention
    on the CPU and compiled under vmap; "sdpa"/"math" force one."""

    def __init__(self, ctx: int = 64, d: int = 128, layers: int = 2, heads: int = 4, dropout: float = 0.0,
                 attn: str = "auto", vocab: int = 256):
        super().__init__()
        if attn not in ("auto", "sdpa", "math"):
            raise TaskError(f"Expected attn 'auto', 'sdpa' or 'math', but got {attn!r}")
        if d % heads:
            raise TaskError(f"Expected the width ({d}) to be a multiple of the number of heads ({heads})")
        tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d, _weight=torch.randn(ctx, d) * 0.02)  # (a layer, not a raw parameter: the
        # engine's mode="merged" runs such models' replicas as one batch, hdet.merged; before tok, as the raw
        # parameter came first, so that optimizer states keep their order)
        self.tok = tok
        self.blocks = nn.Sequential(*[Block(d, heads, dropout, attn) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)  # tied: N(0, 1) embeddings would give huge logits
        self._register_load_state_dict_pre_hook(_pos_was_a_parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device).view(*([1] * (x.dim() - 1)), t))
        return self.head(self.norm(self.blocks(h)))


def _pos_was_a_parameter(state: dict[str, Any], prefix: str, *args: Any) -> None:
    """A state dict saved before the position table was an ``nn.Embedding`` (``pos``) loads as ``pos.weight``."""
    if prefix + "pos" in state and prefix + "pos.weight" not in state:
        state[prefix + "pos.weight"] = state.pop(prefix + "pos")


class SmallCNN(nn.Module):
    """Two conv blocks with BatchNorm and a linear head for 28x28 grey images (10 classes)."""

    def __init__(self, width: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x).flatten(1)))


# -- data ---------------------------------------------------------------------------------------------
def load_stdlib(max_bytes: int = 4_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the stdlib's ``.py`` files (no tests, no site-packages), as (train, validation)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, size = [], [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts or "tests" in f.parts:
            continue
        data = f.read_bytes()
        (val if zlib.crc32(f.name.encode()) % 10 == 0 else train).append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not train or not val:
        raise TaskError(f"Expected .py files in the standard library at {root}, but found too few")

    def as_tensor(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    return as_tensor(train), as_tensor(val)


def _read_idx(path: Path) -> torch.Tensor:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise TaskError(f"Expected an unsigned-byte IDX file at {path}, but got header {raw[:4].hex()}")
    shape = struct.unpack(">" + "I" * ndim, raw[4: 4 + 4 * ndim])
    data = torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8)
    if data.numel() != math.prod(shape):
        raise TaskError(f"Expected {math.prod(shape)} values in {path} (shape {shape}), but got {data.numel()}")
    return data.view(*shape)


def load_fashion_mnist(root: Path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((train images, labels), (test images, labels)) from the four gz IDX files in ``root``."""
    names = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
    missing = [n for pair in names.values() for n in pair if not (root / n).is_file()]
    if missing:
        raise TaskError(f"Expected Fashion-MNIST gz IDX files in {root}, but missing: {', '.join(missing)}")
    out = []
    for images, labels in names.values():
        x = _read_idx(root / images).float().div_(255).sub_(0.2860).div_(0.3530).unsqueeze(1)  # dataset mean/std
        out.append((x, _read_idx(root / labels).long()))
    return out[0], out[1]


# -- tasks --------------------------------------------------------------------------------------------
@dataclass
class Task:
    name: str
    make_model: Callable[[], nn.Module]
    sample: Callable[[str, int, torch.Generator], Any]  # (split, batch size, generator) -> batch on CPU
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    describe: str
    group_of: Callable[[str], str]  # parameter name -> param group name (each group's LR explored separately)
    splits: dict[str, Any] | None = None  # the raw data per split (for a full evaluation)
    ctx: int = 0  # context length (byte GPT)


def _byte_group(name: str) -> str:
    if name.startswith(("tok.", "pos")):
        return "embed"
    if ".qkv." in name or ".proj." in name:
        return "attn"
    if ".mlp." in name:
        return "mlp"
    return "norm"


def _cnn_group(name: str) -> str:
    if name.startswith("head."):
        return "head"
    return "bn" if name.startswith(("features.1.", "features.5.")) else "conv"


def param_groups(model: nn.Module, group_of: Callable[[str], str], weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer param groups named by ``group_of`` (in first-seen order); no weight decay on norms."""
    groups = group_params(model, lambda name, p: group_of(name))
    for g in groups:
        g["weight_decay"] = 0.0 if g["name"] in ("norm", "bn") else weight_decay
    return groups


def _lm_loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    logits = m(b[..., :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[..., 1:].reshape(-1))


def _cls_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def gpt_heads(width: int) -> int:
    """The byte GPT's attention heads at ``width``: one per 32 channels (the width must divide by it)."""
    return max(1, width // 32)


def make_task(name: str, *, data: str | Path | None = None, ctx: int = 64, width: int = 128, layers: int = 2,
              dropout: float = 0.0, data_bytes: int = 4_000_000) -> Task:
    if name == "bytes":
        train, val = load_stdlib(data_bytes)
        splits = {"train": train, "val": val}

        def sample(split: str, n: int, g: torch.Generator) -> torch.Tensor:
            src = splits[split]
            i = torch.randint(0, src.numel() - ctx - 1, (n, 1), generator=g)
            return src[i + torch.arange(ctx + 1)].long()  # [n, ctx + 1]: inputs and shifted targets

        return Task("bytes", lambda: ByteGPT(ctx, width, layers, gpt_heads(width), dropout), sample, _lm_loss,
                    f"byte-level GPT (ctx {ctx}, width {width}, {layers} layers) on the stdlib's .py files "
                    f"({train.numel() / 1e6:.1f} MB train, {val.numel() / 1e6:.2f} MB held-out files)", _byte_group,
                    splits, ctx)
    if name == "fashion":
        root = Path(data) if data is not None else FASHION_DIR
        if not root.is_dir():
            raise TaskError(f"Expected a Fashion-MNIST folder at {root} (apt-get install dataset-fashion-mnist, "
                            "or --data DIR), but it does not exist")
        (xt, yt), (xv, yv) = load_fashion_mnist(root)
        fsplits = {"train": (xt, yt), "val": (xv, yv)}

        def fsample(split: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = fsplits[split]
            i = torch.randint(0, x.shape[0], (n,), generator=g)
            return x[i], y[i]

        channels = max(8, width // 4)  # (--width 128, the default: 32 and 64 channels)
        return Task("fashion", lambda: SmallCNN(channels, dropout), fsample, _cls_loss,
                    f"small CNN (BatchNorm; {channels} and {2 * channels} channels at --width {width}) on Fashion-MNIST "
                    f"from {root} ({xt.shape[0]} train, {xv.shape[0]} test)",
                    _cnn_group, fsplits)
    raise TaskError(f"Expected task 'bytes' or 'fashion', but got {name!r}")
