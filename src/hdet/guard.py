"""The gradient guard: one replica's NaN/Inf gradient must never reach the other replicas' weights.

With gradients all-reduced every step (DDP), one replica's non-finite gradient reaches every replica at
once, before any converge step could leave it out. Two guards, chosen by ``guard_gradients`` when
``model=`` is a ``DistributedDataParallel`` module (``"auto"``, the default: ``"skip-all"`` when the
optimizer can skip a step on the device, i.e. every param group is ``fused``, or ``"skip"`` under
``on_runaway="recover"``; ``"hook"`` otherwise):

* ``"hook"`` (:func:`finite_allreduce_hook`): a DDP communication hook that zeroes a replica's whole
  contribution to a bucket when it holds a NaN or Inf and then averages as DDP does, so the healthy
  replicas still step, with their mean gradient scaled by (N - bad) / N. The check sums the bucket in
  float64, where no sum of finite 16/32-bit values overflows. DDP calls it from Python once per bucket,
  which makes it much slower than "skip" (measured in ``docs/cost.md``). Under a ``torch.amp.GradScaler``
  it averages as DDP does (:class:`HookGuard`): an overflow is the scaler's to see and skip.
* ``"skip-all"`` and ``"skip"`` (:class:`SkipNonFiniteStep`): no hook; DDP averages as usual, so a NaN/Inf
  on any replica is in the averaged gradient, bit-identical on every replica. Just before
  ``optimizer.step()`` one fused check says whether the averaged gradient is finite, and the fused
  optimizer skips the step on the device when it is not (``found_inf``, the mechanism of
  ``torch.amp.GradScaler``): every replica skips that step together, weights and optimizer state
  untouched. ``"skip-all"`` reads every gradient (their max-abs norms, ``torch._foreach_norm(..., inf)``:
  NaN and Inf propagate, and a max cannot overflow): one read of the gradients a step, 0.6% of a 124M GPT's
  step on an H100 (``docs/cost.md``). ``"skip"`` reads only the *sentinel* gradients: those of the
  parameters with at most one dimension (biases, norm weights) and the first row of every other parameter's
  (0.15% of that GPT's): a NaN/Inf in a replica's loss, or in an activation's gradient, reaches every gradient the
  backward computes after it on its path, and a bias's or a norm weight's gradient sums over the whole batch; a
  NaN/Inf in an activation that the loss does see reaches them too, and a norm weight also sees one in a row the loss
  drops. A NaN in a row the loss leaves out (its gradient rows exact zeros: selected away, or behind a ReLU) leaves the
  biases finite, but a weight's gradient ``dY^T X`` holds ``0 * NaN`` in a whole column of torch's ``[out, in]``
  layout, and from the next layer on (the product spreads it over the row) in every element, so in its first row.
  What the sentinels miss: a NaN/Inf born in the backward or in a gradient itself (a gradient set by hand, a custom
  backward, an overflow in a weight's own product: fp16 without a GradScaler) that reaches no bias, norm weight or
  first row: single elements, or a row of a bias-free layer's gradient other than its first, where the layers below
  do not carry it into theirs (a ReLU's backward zeroes part of it); an Inf (an overflow) in a row the loss leaves
  out, with no norm layer, in gradients of the ``[in, out]`` layout (Hugging Face's ``Conv1D``), where a ReLU turns
  the Inf to 0 on part of the row and leaves only some of their rows non-finite. Such a step reaches every replica's
  weights: every replica's next loss is non-finite, the sentinels see that, and the next sync (or early recovery) finds
  every replica bad, then goes back to the best sync under ``on_runaway="recover"``, or stops with
  :class:`~hdet.NonFiniteReplicaError`. So ``"auto"`` picks ``"skip"`` only with ``on_runaway="recover"``
  (or the range test), where that costs at most a go-back, and ``"skip-all"`` otherwise. A model with no bias or
  norm weight with a gradient (bias-free, norm-free, or adapters only) has every gradient read. Neither reads
  anything when the step's gradient norm is handed over (:meth:`SkipNonFiniteStep.use_norm`, which
  ``HDETLR.clip_grad_norm_`` does): a clipping
  user has computed it anyway, over every gradient; nor under ``torch.amp.GradScaler`` (fp16), whose
  ``step`` has just checked every gradient and hands its verdict over as ``found_inf`` (not after an
  explicit ``scaler.unscale_``, whose verdict may be stale by the step).

With FSDP2/HSDP replicas (``device_mesh``) only "skip" and "skip-all" exist: each rank checks its own gradient shards
and the ranks agree through a MAX all_reduce of the flag over each mesh dimension.

Both run on the device with no host sync. A replica's non-finite weights are caught at the next converge
step, which resets it (see ``on_nonfinite``); under "skip" and "skip-all", :class:`SkipWatch` notices sooner when every
replica has been skipping for a stretch and the scheduler resets the bad replica early; under "hook" with a
GradScaler (whose skipped steps stall every replica alike), :class:`ScalerWatch` does.
"""

import copy
import gc
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .caller import user_stacklevel
from .loss_scale import LossScale, driving_scaler
from .optimizers import innermost as _innermost
from .optimizers import lr_free_kind
from .replicas import local_shard
from .sync import max_abs
from .values import int_number, real_number

__all__ = ["finite_allreduce_hook", "HookGuard", "install_gradient_guard", "SkipNonFiniteStep", "SkipWatch", "ScalerWatch",
           "GuardSetting", "GUARDS"]

GUARDS = ("auto", "hook", "skip", "skip-all")
READS = ("sentinels", "all")  # SkipNonFiniteStep: which gradients its own pass reads
_UNSET = object()  # SkipNonFiniteStep: the pre-hook set no found_inf


def finite_allreduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # (no `from __future__ import annotations` here: DDP checks these annotations at registration)
    """DDP's average with every non-finite contribution replaced by zeros: ``sum of finite
    contributions / N``. One read of the bucket (its sum in float64: NaN and Inf propagate, and no sum of
    finite fp16/bf16/fp32 elements overflows there), one in-place select, then the same single all_reduce
    as DDP's default hook."""
    buf = bucket.buffer()
    _zero_unless_finite(buf)
    return _allreduce_mean(process_group, buf)


def _zero_unless_finite(buf: torch.Tensor) -> torch.Tensor:
    """Zero ``buf`` in place unless every element is finite; returns whether it was (a device bool: no host sync). A
    sparse bucket (``nn.Embedding(sparse=True)``): its values (torch.where has no sparse out= form: a review)."""
    if buf.is_sparse:
        buf = buf._values()  # (a view: zeroed in place, the indices kept)
    ok = all_finite(buf)
    torch.where(ok, buf, torch.zeros((), dtype=buf.dtype, device=buf.device), out=buf)  # NaN * 0 is NaN
    return ok


def _allreduce_mean(process_group: Any, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """DDP's default hook: the mean of ``buf`` over the group, in place; divided before the sum, as DDP's own
    ``allreduce_hook`` does (summed first, fp16 gradients of 4e4 on two ranks averaged to +Inf: an audit)."""
    avg = "nccl" in str(dist.get_backend(process_group))
    if not avg:
        buf.div_(dist.get_world_size(process_group))
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
    fut = dist.all_reduce(buf, op=op, group=process_group, async_op=True).get_future()  # COLLECTIVE
    return fut.then(lambda f: f.value()[0])


def _guarded_allreduce(state: "HookGuard", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook :class:`HookGuard` registers: :func:`finite_allreduce_hook`, or DDP's own average once a
    GradScaler drives the optimizer."""
    buf = bucket.buffer()
    if not state.closed and state.loss_scale.scaler is None:  # (closed: its scheduler's run is over, DDP's own mean)
        state.note(_zero_unless_finite(buf))
    return _allreduce_mean(state.process_group, buf)


class HookGuard:
    """The "hook" guard of one DDP model: the state of its comm hook, which watches for a ``torch.amp.GradScaler``.

    Under a GradScaler (fp16) a non-finite gradient is the scaler's overflow signal: every replica's scaler must
    see it, skip the step and lower its scale, as without hdet. Zeroed by the hook, the overflow was hidden: the
    scaler never lowered its scale (it kept doubling it) and the optimizer stepped on zeros, silently. So once a
    GradScaler is seen stepping the optimizer, the hook averages as DDP does and the scaler guards every replica
    alike (a replica whose weights turned non-finite makes every step overflow until the next converge step
    resets it). torch tells an optimizer nothing about a scaler: a step pre-hook looks for the scaler's frame among
    its callers (``GradScaler.step`` / ``_maybe_opt_step``: a few frames, a few microseconds a step until found).
    That is the first ``scaler.step``; if the hook zeroed an overflow before it (in the first backward), that step is
    skipped on every replica, as the scaler would have skipped it, and the scaler is told, so that it lowers its
    scale: the run is then DDP's, step for step."""

    def __init__(self, process_group: Any, optimizer: torch.optim.Optimizer, loss_scale: LossScale,
                 local: Callable[[], bool] = lambda: False, model_params: Sequence[torch.Tensor] = ()) -> None:
        self.process_group = process_group
        self.model_params = list(model_params)  # the DDP model's: another optimizer may step some of them
        self.local = local  # the DDP model's last forward ran inside no_sync(): the hook did not run, nothing to agree
        self.loss_scale = loss_scale  # the scheduler's: the GradScaler once seen (by this guard or the scheduler)
        self._zeroed: torch.Tensor | None = None  # since the last optimizer step: this rank zeroed a bucket (device bool)
        self.taken = 0  # optimizer steps taken (a step the GradScaler skips never calls optimizer.step())
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []  # the gradients held back from a skipped step
        self.closed = False  # its scheduler closed: the comm hook (DDP keeps it) averages as DDP does, nothing else
        self.orphaned = False  # its scheduler dropped unclosed: the comm hook still zeroes, its optimizer hooks idle
        optimizer = _innermost(optimizer)
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def close(self) -> None:
        """Its scheduler's run is over: the optimizer's hooks off, and the comm hook, which DDP cannot take off,
        averages as DDP does (a GradScaler's overflow reaches the scaler; an audit: a fine-tune on the same DDP model
        after HDET never skipped an overflowed step). A new scheduler on the model takes it over (:meth:`reopen`)."""
        self.remove()
        self.closed, self._held, self._zeroed = True, [], None
        self.model_params, self.local = [], _never

    def orphan(self) -> None:
        """Its scheduler was dropped unclosed (collected: :func:`hdet.schedulers._release`, which may run inside a
        step, so nothing is taken off here): the comm hook goes on keeping non-finite gradients out, its optimizer
        hooks do nothing, until a new scheduler on the model takes it over (:meth:`reopen`)."""
        self.orphaned, self._held, self._zeroed = True, [], None
        self.model_params, self.local = [], _never

    def reopen(self, process_group: Any, optimizer: torch.optim.Optimizer, loss_scale: LossScale,
               local: Callable[[], bool], model_params: Sequence[torch.Tensor]) -> None:
        """A closed guard, still the DDP model's comm hook, taken over by a new scheduler (the next trial of a search
        on one DDP model had no guard: DDP takes one comm hook, an audit)."""
        HookGuard.__init__(self, process_group, optimizer, loss_scale, local, model_params)

    def note(self, ok: torch.Tensor) -> None:
        bad = ok.logical_not()
        self._zeroed = bad if self._zeroed is None else self._zeroed.logical_or_(bad)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        zeroed, self._zeroed = self._zeroed, None
        if self.orphaned or self.loss_scale.scaler is not None:
            return
        found = driving_scaler()
        if found is None:
            return
        self.loss_scale.scaler, optimizer_state = found
        grads = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads or self.local():  # local mode: each rank's scaler decides its own first step, at its own step (a
            # collective here paired ranks' first steps taken, which differ there: a hang; an audit); nothing zeroed
            return
        flag = torch.zeros((), device=grads[0].grad.device) if zeroed is None else zeroed.float()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)  # COLLECTIVE: once, at the scaler's
        if flag.item():  # HOST SYNC: once             # first step (every replica steps there: the same gradients)
            found_inf = next(iter(optimizer_state.get("found_inf_per_device", {}).values()), None)
            if found_inf is not None:
                found_inf.fill_(1.0)  # scaler.update() lowers the scale, as for the overflow it did not see
            self._held = [(p, p.grad) for p in grads]
            for p in grads:  # an optimizer steps no parameter without a gradient: this step changes nothing
                p.grad = None
            self._skip_other_optimizers(optimizer, found[0], optimizer_state)

    def _skip_other_optimizers(self, optimizer: torch.optim.Optimizer, scaler: Any, own: dict[str, Any]) -> None:
        """At a first scaler step held back: the scaler skips the other optimizers over the DDP model's parameters too
        (two optimizers over one model, one GradScaler: torch's multi-optimizer AMP recipe), as it would have without
        the hook's zeros (the other stepped on them: its Adam step count one ahead of plain DDP's, an audit): their
        parameters' gradients made +Inf for the ones still to unscale, the scaler's found_inf set for the ones already
        unscaled (their +Inf gradients would have reached the step: NaN weights, a review). One that stepped already,
        before this one: said."""
        others = {id(p) for p in self.model_params} - {id(p) for g in optimizer.param_groups for p in g["params"]}
        for p in self.model_params:
            if id(p) in others and p.grad is not None:
                p.grad.fill_(float("inf"))
        stage = getattr(getattr(torch.amp, "grad_scaler", None), "OptState", None)
        states = {k: st for k, st in getattr(scaler, "_per_optimizer_states", {}).items() if st is not own}
        stepped = False
        if stage is None or not states or not others:
            return
        # the scaler keeps its optimizers by id only: found among the live objects (once, at this first overflow),
        # those over this model's other parameters (another model's optimizer the scaler also drives steps, a review)
        for o in [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer) and id(o) in states]:
            if not any(id(p) in others for g in o.param_groups for p in g["params"]):
                continue
            state = states[id(o)]
            if state.get("stage") is stage.UNSCALED:
                for found_inf in state.get("found_inf_per_device", {}).values():
                    found_inf.fill_(1.0)
            stepped = stepped or state.get("stage") is stage.STEPPED
        if stepped:
            warnings.warn("hdet: another optimizer that the torch.amp.GradScaler drives stepped before this one at its "
                          "first step, on gradients the \"hook\" guard had zeroed where a replica's overflowed (plain "
                          "DDP would have skipped that step): step the optimizer HDET's scheduler drives first, or use "
                          "one optimizer for the model", stacklevel=user_stacklevel())

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held, self._held = self._held, []
        self.taken += not held  # (a first step held back is a skipped one)
        for p, g in held:
            p.grad = g

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _never() -> bool:
    return False


def weak_method(method: Callable[..., Any], gone: Any = None) -> Callable[..., Any]:
    """``method`` called while its object lives, else ``gone``: a hook that holds no scheduler or guard (one dropped
    unclosed is freed, with its optimizer)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return gone if bound is None else bound(*args)
    return call


def all_finite(buf: torch.Tensor) -> torch.Tensor:
    """Whether every element is finite, as a device bool. A sum in the buffer's own dtype would overflow
    (fp16: 65504) while every element is finite, and zero a healthy gradient; a float64 sum of 16/32-bit
    elements cannot overflow. float64 buffers are checked element by element."""
    if buf.element_size() < 8:
        return torch.isfinite(buf.sum(dtype=torch.float64))
    return torch.isfinite(buf).all()


SMALL = 1 << 20  # _nonfinite: gradients of at most this many elements in all are checked in one kernel


def _nonfinite(grads: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write into ``out`` (a float 0-dim tensor on the gradients' device) 1.0 if any element of ``grads``
    (one device and dtype) is NaN or Inf, else 0.0. Large gradients: their largest magnitude
    (:func:`hdet.sync.max_abs`, one fused read), non-finite exactly then; four small kernels besides the read.
    float32, up to :data:`SMALL` elements in all (the sentinels): ``out`` zeroed and GradScaler's fused check at
    scale 1 (each element read and written back unchanged: ``x * 1.0`` is ``x``, bit for bit), two kernels in all."""
    grads = [g for g in grads if g.numel()]  # an empty shard has no max-abs norm (and nothing to check)
    if not grads:
        return out.zero_()
    if (grads[0].dtype == torch.float32 and sum(g.numel() for g in grads) <= SMALL  # (CUDA's check takes a huge
            and all(g.is_contiguous() for g in grads)):  # finite fp16/fp64 value for an overflow, has no bf16, and
        # cannot write back a gradient set by hand as an expanded view)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, out.zero_(), _one(out.device))
        return out
    return _nonfinite_scalar(max_abs(grads), out)


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on ``device``, allocated once (the scale of :func:`_nonfinite`'s fused check)."""
    if device not in _ONES:
        _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _ONES[device]


def _nonfinite_scalar(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = 1.0 if the scalar ``x`` is NaN or +-Inf, else 0.0: ``x * 0 != 0``, two kernels, no host sync."""
    return torch.ne(x.mul(0), 0, out=out)


def _scaler_checked(optimizer: torch.optim.Optimizer, found_inf: Any) -> bool:
    """Whether ``found_inf`` is the verdict of ``torch.amp.GradScaler.step`` on every gradient of ``optimizer`` as
    they are now: for a fused optimizer whose gradients are still scaled, the scaler checks every gradient in
    ``step`` and sets ``grad_scale`` (a tensor) and ``found_inf`` just before ``optimizer.step()`` (and deletes both
    after it). After an explicit ``scaler.unscale_`` (``grad_scale`` None) the verdict is from that call, and the
    gradients may have changed since: the guard then reads them itself."""
    return (isinstance(found_inf, torch.Tensor) and found_inf.dim() == 0
            and isinstance(getattr(optimizer, "grad_scale", None), torch.Tensor))


def _unchanged(seen: list[tuple[torch.Tensor, int]], groups: dict[Any, list[torch.Tensor]]) -> bool:
    """Whether the gradients in ``groups`` are exactly the tensors in ``seen``, none modified in place since
    (a tensor's ``_version`` counts its in-place writes: a backward accumulating into it, a clip)."""
    now = [g for grads in groups.values() for g in grads]
    if len(now) != len(seen):
        return False
    ids = {id(g): v for g, v in seen}
    return all(ids.get(id(g)) == g._version for g in now)


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` on the device (torch's fused Adam/AdamW/SGD/...)."""
    inner = _innermost(optimizer)
    if lr_free_kind(inner) == "mechanic":  # its tuner reads the gradients itself after the fused step skipped
        return False
    return bool(getattr(inner, "_step_supports_amp_scaling", False)) and all(g.get("fused") for g in inner.param_groups)


def _sentinel(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """What the "skip" guard reads of ``grad`` (this rank's shard of ``param``'s gradient): all of it when the parameter
    has at most one dimension (a bias, a norm weight: each element sums over the whole batch), else its first row
    ``grad[0]`` (a view: a row of a matrix's gradient ``dY^T X``, in which a NaN/Inf in a column of ``X`` leaves a whole
    column, and through the layers below one in a row of ``dY`` too; a convolution's first output channel). None for
    an empty shard."""
    if param.dim() <= 1:  # (a DTensor's dim is the whole parameter's)
        return grad
    return grad[0] if grad.dim() and grad.shape[0] else None


class SkipNonFiniteStep:
    """Skip ``optimizer.step()`` on the device when a gradient is NaN/Inf (the ``"skip"`` and ``"skip-all"`` guards).

    A step pre-hook computes ``found_inf`` (1.0 when any gradient holds a NaN or Inf) and hands it to
    the fused optimizer, which then leaves weights, state and step count untouched; a step
    post-hook restores whatever ``found_inf`` was there before (``torch.amp.GradScaler`` sets its own;
    the two are combined by ``max``). :attr:`skipped` counts skipped steps on the device (reading it
    is a host sync). Needs an optimizer whose every param group is ``fused``; a wrapper that keeps the
    real optimizer as ``.optimizer`` (Accelerate) gets the hooks on the real one.

    ``agree_over``: process groups whose ranks must take the same decision although their gradients
    differ (FSDP2/HSDP: each rank holds other shards; pass every dimension's group of the device mesh):
    the flag is all-reduced (MAX) over each, one scalar per group and step. Not needed under DDP, whose
    averaged gradient is the same on every rank.

    ``reads``: which gradients the guard's own pass reads: ``"all"`` (default), or ``"sentinels"``, those of the
    parameters with at most one dimension (biases, norm weights) and the first row of every other's, which a NaN/Inf
    of the loss or of an activation reaches (the module docstring says what they miss); every gradient when no
    parameter with a gradient has at most one dimension."""

    def __init__(self, optimizer: torch.optim.Optimizer, agree_over: Sequence[Any] = (), reads: str = "all") -> None:
        if reads not in READS:
            raise ValueError(f"Expected reads in {READS}, but got {reads!r}")
        self.reads = reads
        self.active = True  # False: its scheduler dropped unclosed, the hooks idle (taken off only by close())
        optimizer = _innermost(optimizer)
        if not _fused(optimizer):
            raise ValueError("Expected an optimizer that can skip a step on the device (torch's Adam, AdamW, SGD, "
                             f"... with fused=True in every param group) for guard_gradients='skip', but got "
                             f"{type(optimizer).__name__} with fused={[g.get('fused') for g in optimizer.param_groups]}; "
                             + ("pass fused=True, or guard_gradients=False (sharded replicas have no 'hook' guard)"
                                if agree_over else "use guard_gradients='hook'"))
        self.optimizer = optimizer
        self.agree_over = list(agree_over)
        self.skipped: torch.Tensor | None = None
        self.checked = 0  # steps checked (host count; `skipped` of them were skipped)
        self._flags: dict[torch.device, torch.Tensor] = {}  # per device: the found flag, reused
        self._norm: tuple[torch.Tensor, list[tuple[torch.Tensor, int]]] | None = None  # use_norm: (norm, versions)
        self._saved: list[Any] = []  # per step in flight: the found_inf to restore (None: there was none)
        self._mine: torch.Tensor | None = None  # the found_inf this guard set last
        # torch's fused SGD makes its momentum buffers with empty_like at its first step and fills them only if the step
        # is taken: a skipped first step left them uninitialised memory, which the next step used (weights 1e22; a
        # torch bug). Until every buffer exists, the parameters without one, to drop those made by a skipped step
        self._fresh_sgd = isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0)
                                                                          for g in optimizer.param_groups)
        self._no_buffer: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self.hook_on()

    def hook_on(self) -> None:
        """Its step hooks on the optimizer, run eagerly where the step is compiled: ``torch.compile(opt.step)``
        traced the pre-hook's ``found_inf`` into a graph that did not hand it to the fused step (no guard: a NaN
        gradient was stepped) and the post-hook then failed (an audit). A graph break on each side of the step."""
        self._handles = [self.optimizer.register_step_pre_hook(torch.compiler.disable(self._pre)),
                         self.optimizer.register_step_post_hook(torch.compiler.disable(self._post))]

    def use_norm(self, total_norm: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        """The next step's verdict comes from ``total_norm``, a norm of ``grads`` (what
        ``torch.nn.utils.clip_grad_norm_`` returns; a p-norm with p > 0 is non-finite when one element is, and when
        a finite gradient's norm overflows, which is skipped too), instead of
        a pass of the guard's own. Used only if, at that step, ``grads`` are exactly the gradients the
        optimizer holds, unmodified since (same tensors, same in-place version: clipping first and then
        running another backward falls back to the guard's own pass). :meth:`hdet.HDETLR.clip_grad_norm_`
        hands over its norm so. Not with ``agree_over`` (sharded replicas each hold other shards)."""
        if self.agree_over:
            raise ValueError("Expected no agree_over groups for use_norm (a plain DDP guard), but this guard agrees "
                             f"over {len(self.agree_over)} mesh groups: sharded norms are not handed over")
        self._norm = (total_norm, [(g, g._version) for g in grads])

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if not self.active:  # (its scheduler dropped unclosed: see HookGuard.orphan)
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0]: the optimizer itself)
        if closure is None:
            self._verdict(optimizer)
            return None

        def checked() -> Any:  # optimizer.step(closure) (Lightning's way): the closure runs the backward inside the
            loss = closure()   # step, after this hook, so the verdict is taken on what it made, before the update
            # (the optimizer reads found_inf after its closure); eager where the step is compiled, as the hooks are:
            # traced inside torch.compile(opt.step)(closure), its found_inf never reached the fused step
            torch.compiler.disable(self._verdict)(optimizer, after_closure=True)
            return loss
        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked}
        return (args[0], checked, *args[2:]), kwargs

    def _momentum_buffers_missing(self, optimizer: torch.optim.Optimizer) -> None:
        """SGD with momentum, until its buffers exist: the parameters about to get one at this step."""
        self._no_buffer = [p for g in optimizer.param_groups if g.get("momentum", 0) for p in g["params"]
                           if p.grad is not None and optimizer.state.get(p, {}).get("momentum_buffer") is None]

    def _drop_unfilled_buffers(self, optimizer: torch.optim.Optimizer) -> None:
        """After a step that made momentum buffers: if it was skipped, they hold uninitialised memory (torch's fused
        SGD fills them only when it steps), so they are dropped, and the next step taken makes them afresh as a first
        step does. HOST SYNC: one read of the flag, at the steps that make buffers only (the first, usually)."""
        made, self._no_buffer = self._no_buffer, []
        if self._mine is None or not bool(self._mine.item() > 0):  # HOST SYNC (the first step taken only)
            self._fresh_sgd = False  # taken: torch made every buffer and filled it (it makes them all at once)
            return
        for p in made:
            state = optimizer.state.get(p)
            if state is not None:
                state.pop("momentum_buffer", None)

    def _verdict(self, optimizer: torch.optim.Optimizer, after_closure: bool = False) -> None:
        """Set ``optimizer.found_inf`` from the gradients as they are now (see the class doc). ``after_closure``: the
        step's closure has just made them, so a GradScaler's verdict (taken by ``scaler.step`` before the closure ran,
        as Accelerate's positional closure allows) is of the gradients before: the guard reads them itself."""
        handed, self._norm = self._norm, None
        if self._fresh_sgd:  # (here: after a closure has made this step's gradients)
            self._momentum_buffers_missing(optimizer)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}  # every gradient
        sentinels: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}  # <= 1 dim, and matrices' first rows
        vectors = False  # whether a parameter of at most one dimension has a gradient
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    grad = local_shard(p.grad)  # FSDP2: this rank's shard
                    groups.setdefault((grad.device, grad.dtype), []).append(grad)
                    probe = _sentinel(p, grad) if self.reads == "sentinels" else None
                    if probe is not None:
                        sentinels.setdefault((grad.device, grad.dtype), []).append(probe)
                        vectors = vectors or p.dim() <= 1
        if not groups:
            self._saved.append(_UNSET)  # nothing to check: found_inf left alone
            return
        norm = handed[0] if handed is not None and _unchanged(handed[1], groups) else None
        read = sentinels if vectors else groups  # (no bias or norm weight with a gradient: every gradient)
        prev = getattr(optimizer, "found_inf", None)
        if prev is not None and prev is self._mine:  # ours, left by a step that raised before its post-hook
            prev, self._saved = None, []
        with torch.no_grad():
            if norm is not None:  # the norm of exactly these gradients decides: no pass of our own
                found = _nonfinite_scalar(norm, self._flag(norm.device))
            elif _scaler_checked(optimizer, prev) and not self.agree_over and not after_closure:
                # torch.amp.GradScaler.step has just checked every gradient of this optimizer (found_inf > 0: some
                # NaN/Inf): its verdict is ours, with no pass of our own
                found = torch.ne(prev, 0, out=self._flag(prev.device))
            else:
                found = None
                for (device, _), grads in read.items():  # one read of these gradients, on the device: no host sync
                    if found is None:
                        found = _nonfinite(grads, self._flag(device))
                    else:  # another device or dtype (rare): combined by max
                        other = _nonfinite(grads, torch.empty((), dtype=torch.float32, device=device))
                        found.copy_(torch.maximum(found, other.to(found.device)))
            for group in self.agree_over:  # sharded replicas: one decision for all of them
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)  # COLLECTIVE (one scalar, no host sync)
            self.skipped = found.clone() if self.skipped is None else self.skipped.add_(found.to(self.skipped.device))
        self.checked += 1
        self._saved.append(prev)
        self._mine = found if prev is None else torch.maximum(found, prev.to(found.device))
        optimizer.found_inf = self._mine  # type: ignore[attr-defined]

    def device(self) -> torch.device:
        """Where the skip counter lives: the device of the first trained parameter's gradient (this rank's shard)."""
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    return local_shard(p.detach()).device
        return torch.device("cpu")

    def _flag(self, device: torch.device) -> torch.Tensor:
        """This device's found flag (a float 0-dim tensor, allocated once: the optimizer reads it)."""
        if device not in self._flags:
            self._flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        return self._flags[device]

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._no_buffer:
            self._drop_unfilled_buffers(optimizer)
        prev = self._saved.pop() if self._saved else _UNSET
        if prev is _UNSET:
            return
        if prev is None:
            del optimizer.found_inf  # type: ignore[attr-defined]
        else:
            optimizer.found_inf = prev  # type: ignore[attr-defined]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class SkipWatch:
    """Notices, without a host sync, that the skip guard skipped every step of a stretch.

    One NaN weight on one replica makes its gradient NaN at every step, so the averaged gradient is NaN
    on every replica and the guard skips every replica's step until a converge step resets the bad
    replica (up to ``T`` steps). Every ``every`` steps :meth:`poll` starts a non-blocking copy of the
    guard's skip counter to the host and reads the copy started ``every`` steps before (long finished:
    waiting on its event costs nothing in practice); when all ``every`` steps between the two copies
    before that were skipped, it returns True and the scheduler runs an early recovery
    (:meth:`hdet.Ensemble.recover`). A stall is thus bounded by about ``3 * every`` steps (a stretch of ``every``
    skipped steps, up to ``every`` more before a copy starts after it, and ``every`` before that copy is read: a NaN
    weight at step 7 is reset after step 30 at ``every`` 10). Not before a step
    was taken: a ``torch.amp.GradScaler`` skips the first steps while it lowers its initial scale, and those are
    the scaler's work, not a stall (every replica's weights are still the initial ones). The counter
    is the same on every replica (DDP averages the gradient; sharded replicas agree by an all_reduce),
    so every replica takes the same decision at the same step, provided every parameter the optimizer
    steps gets its gradient through DDP (a parameter outside the DDP module could be NaN on one rank
    only, and the ranks would then disagree on the recovery, a collective)."""

    def __init__(self, guard: SkipNonFiniteStep, every: int = 10, local: Callable[[], bool] = lambda: False,
                 loss_scale: LossScale | None = None) -> None:
        self.guard = guard
        self.every = every
        self.local = local  # whether this optimizer step's gradients were not all-reduced (local mode)
        self.loss_scale = loss_scale  # a GradScaler's scale, kept at every step taken (poll: step_taken)
        self._pending: tuple[torch.Tensor, Any, int] | None = None  # (host copy of the counter, its CUDA event,
        # the steps checked then)
        self._seen: float | None = 0.0  # the counter at the copy before (none yet: after a reset)
        self._taken = False  # a step was taken before that copy
        self._checked = 0  # the guard's count of checked steps at the last poll

    def poll(self, t: int) -> bool:
        if self.loss_scale is not None and self.guard.checked != self._checked:  # an optimizer step since the last
            self._checked = self.guard.checked  # poll: its GradScaler scale is kept if it was taken (on the device)
            self.loss_scale.step_taken(self.guard._mine)
        if t % self.every or self.local():  # local mode: each replica skips on its own, and an early recovery
            return False  # (a collective) would be entered by some replicas only: the converge step resets them
        stalled = self._read()
        self._snapshot()
        return stalled

    def reset(self) -> None:
        """After a converge step or a recovery: the stretch starts anew from the counter now (a copy, read at
        the next poll: no wait for the averaging in flight)."""
        self._snapshot()
        self._seen = None

    def _read(self) -> bool:
        """Read the copy started one poll ago; True when every step since the copy before was skipped, and some step
        before them was not."""
        if self._pending is None:
            return False
        copy, event, checked = self._pending
        if event is not None:
            event.synchronize()  # HOST SYNC on an event recorded `every` steps ago: finished long since
        now = float(copy)
        stalled = self._seen is not None and now - self._seen >= self.every and self._taken
        self._seen, self._taken = now, self._taken or now < checked
        return stalled

    def _snapshot(self) -> None:
        skipped = self.guard.skipped
        if skipped is None:  # no step checked yet
            self._pending = (torch.zeros(()), None, 0)
        elif skipped.device.type == "cuda":
            copy = torch.empty((), dtype=skipped.dtype, pin_memory=True)
            copy.copy_(skipped, non_blocking=True)  # device -> host, no wait
            event = torch.cuda.Event()
            event.record()
            self._pending = (copy, event, self.guard.checked)
        else:
            self._pending = (skipped.detach().clone(), None, self.guard.checked)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the guard's counts and this watch's reads, so that a resumed run notices a stall at the step
        the uninterrupted run does. HOST SYNC (a checkpoint): the skip counter and the copy in flight are read."""
        g, pending = self.guard, None
        if self._pending is not None:
            count, event, checked = self._pending
            if event is not None:
                event.synchronize()  # HOST SYNC
            pending = [float(count), int(checked), None]  # (the third: a scale copied here once; states keep its slot)
        return {"kind": "skip", "skipped": None if g.skipped is None else float(g.skipped), "checked": g.checked,
                "pending": pending, "seen": self._seen, "taken": self._taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A :meth:`state_dict` (checked by :func:`check_watch_state`)."""
        g = self.guard
        g.checked = state["checked"]
        g.skipped = None if state["skipped"] is None else torch.tensor(float(state["skipped"]), device=g.device())
        pending = state["pending"]
        self._pending = None if pending is None else (
            torch.tensor(float(pending[0])), None, pending[1])  # (pending[2], a scale saved by earlier versions: unused)
        self._seen, self._taken = state["seen"], state["taken"]


class ScalerWatch:
    """:class:`SkipWatch` for the "hook" guard under a ``torch.amp.GradScaler``: notices that the scaler skipped
    every optimizer step of a stretch.

    There the hook averages as DDP does and leaves overflows to the scaler (:class:`HookGuard`), so one replica's
    NaN weight makes every step overflow on every replica, and the scaler skips them all (halving its scale each
    time) until a converge step resets the bad replica: up to ``T`` steps. A skipped step never calls
    ``optimizer.step()``; :meth:`poll`, at each scheduler step, counts the scheduler steps in a row in which the
    guard saw no optimizer step, on the host (the scaler has synced already to decide). After ``every`` of them it
    returns True and the scheduler runs an early recovery, as under "skip". The scaler's verdict comes from the
    averaged gradient, the same on every replica, so every replica takes the same decision at the same step (with
    :class:`SkipWatch`'s proviso: every parameter the optimizer steps gets its gradient through DDP)."""

    def __init__(self, guard: HookGuard, every: int = 10, local: Callable[[], bool] = lambda: False) -> None:
        self.guard = guard
        self.every = every
        self.local = local  # whether this optimizer step's gradients were not all-reduced (local mode)
        self._taken: int | None = None  # the guard's count at the last poll
        self._missed = 0  # scheduler steps in a row with no optimizer step

    def poll(self, t: int) -> bool:
        before, self._taken = self._taken, self.guard.taken
        if self.guard.loss_scale.scaler is not None and self._taken and self._taken != before:  # a step taken: a
            self.guard.loss_scale.step_taken(None)  # healthy scale (a device copy), in local mode too (where a reset
            # went back to the last healthy sync's scale only, none before the first: left collapsed, 256 for 1024)
        if self.guard.loss_scale.scaler is None or self.local() or not self._taken:
            # no scaler: the hook zeroes, nothing stalls; local mode: each replica's scaler decides alone (a recovery,
            # a collective, would be entered by some replicas only: the converge step resets them); no step taken
            # yet: the scaler is lowering its initial scale (see SkipWatch)
            self._missed = 0
            return False
        self._missed = self._missed + 1 if self._taken == before else 0
        if self._missed < self.every:
            return False
        self._missed = 0
        return True

    def reset(self) -> None:
        """After a converge step or a recovery: the stretch starts anew."""
        self._missed = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the guard's count of steps taken and this watch's, so that a resumed run counts a stall as the
        uninterrupted run does (no host read)."""
        return {"kind": "hook", "hook_taken": self.guard.taken, "taken": self._taken, "missed": self._missed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A :meth:`state_dict` (checked by :func:`check_watch_state`)."""
        self.guard.taken, self._taken, self._missed = state["hook_taken"], state["taken"], state["missed"]


def _count(x: Any) -> bool:
    """An integer >= 0 (:func:`hdet.values.int_number`)."""
    n = int_number(x)
    return n is not None and n >= 0


def _real(x: Any) -> bool:
    """A finite real number >= 0 (:func:`hdet.values.real_number`)."""
    v = real_number(x)
    return v is not None and math.isfinite(v) and v >= 0


def _whole(x: Any) -> bool:
    """A count saved as a float (a device counter read back): :func:`_real` and integral."""
    return _real(x) and float(x) == int(float(x))


def check_watch_state(state: Any) -> None:
    """ValueError unless ``state`` is None or what :meth:`SkipWatch.state_dict` or :meth:`ScalerWatch.state_dict`
    returns."""
    if state is None:
        return
    ok = isinstance(state, dict) and state.get("kind") in ("skip", "hook")
    if ok and state["kind"] == "skip":
        pending = state.get("pending")
        ok = (set(state) == {"kind", "skipped", "checked", "pending", "seen", "taken"}
              and (state["skipped"] is None or _whole(state["skipped"])) and _count(state["checked"])
              and (state["seen"] is None or _whole(state["seen"])) and isinstance(state["taken"], bool)
              and (pending is None or (isinstance(pending, list) and len(pending) == 3 and _whole(pending[0])
                                       and _count(pending[1]) and (pending[2] is None or _real(pending[2])))))
        if ok:  # the counts in order: skipped steps are checked steps, the copies are of earlier counts
            skipped, checked = state["skipped"] or 0, state["checked"]
            ok = skipped <= checked and (pending is None or (pending[0] <= min(pending[1], skipped)
                                                               and pending[1] <= checked
                                                               and (state["seen"] is None or state["seen"] <= pending[0])))
    elif ok:
        ok = (set(state) == {"kind", "hook_taken", "taken", "missed"} and _count(state["hook_taken"])
              and (state["taken"] is None or _count(state["taken"])) and _count(state["missed"]))
    if not ok:
        raise ValueError(f"Expected the state's gradient guard counts (a dict from the guard's stall watch, or None), "
                         f"but got {state!r}")


def uncompiled(model: Any) -> Any:
    """The module ``torch.compile`` wrapped (its ``OptimizedModule`` keeps it as ``_orig_mod``), else ``model``."""
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def resolve_guard(guard: Any, optimizer: torch.optim.Optimizer, advise: bool = True, mesh: bool = False,
                  recovering: bool = False) -> str | None:
    """``guard_gradients`` -> "hook", "skip", "skip-all" or None (off); "auto"/True picks "skip-all" for fused
    optimizers, or "skip" (the sentinels) when ``recovering`` (``on_runaway="recover"``: what the sentinels miss
    then costs a go-back to the best sync, not the run).
    ``advise``: warn when "auto" falls back to the slow hook off the CPU (only where it will be installed).
    ``mesh``: sharded replicas (FSDP2/HSDP), where only "skip"/"skip-all" exist ("auto" with a non-fused optimizer:
    no guard, with a warning)."""
    if guard is False or guard is None:
        return None
    if guard is True:
        guard = "auto"
    if guard not in GUARDS:
        raise ValueError(f"Expected guard_gradients in {GUARDS} or True/False, but got {guard!r}")
    if mesh and guard == "hook":
        raise ValueError("Expected guard_gradients 'skip', 'skip-all', 'auto' or False with device_mesh (FSDP2/HSDP), but got "
                         "'hook': the hook is a DDP communication hook")
    if guard == "auto":
        if _fused(optimizer):
            return "skip" if recovering else "skip-all"
        if mesh:
            warnings.warn("hdet: no gradient guard for these sharded replicas: the 'skip' guard needs a fused optimizer "
                          "(fused=True); without it one replica's NaN gradient reaches the others through the all-reduce "
                          "of the gradients over the replicas. Pass guard_gradients=False to silence this",
                          stacklevel=user_stacklevel())
            return None
        if advise and any(p.device.type != "cpu" for g in _innermost(optimizer).param_groups for p in g["params"]):
            warnings.warn("hdet: the optimizer is not fused, so the gradient guard is the DDP comm hook ('hook'), "
                          "which costs far more than the 'skip' guard of a fused optimizer (fused=True; "
                          "docs/cost.md). Pass guard_gradients='hook' (or False) to choose and silence this",
                          stacklevel=user_stacklevel())
        return "hook"
    return guard


_KINDS_ON: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()  # DDP model -> guard kinds


def _check_one_kind(ddp: "torch.nn.parallel.DistributedDataParallel", guard: str) -> None:
    """Several schedulers (one per optimizer) on one DDP model: a "hook" guard zeroes a replica's non-finite
    contribution to every bucket before a "skip" guard's check runs, which then never sees it (an audit: the fused
    optimizer's parameters stepped on the healthy mean while its scheduler reported "skip-all"). Said, once a mix is
    installed."""
    kinds = _KINDS_ON.setdefault(ddp, set())
    if kinds and ("hook" in kinds) != (guard == "hook"):
        warnings.warn(f"hdet: this DDP model's gradients get a \"hook\" gradient guard (a non-fused optimizer's "
                      f"scheduler) and a \"skip\" one (a fused optimizer's: {sorted(kinds | {guard})}): the hook "
                      "zeroes a replica's non-finite contribution before the skip check runs, so the fused optimizer's "
                      "parameters step on the healthy replicas' mean instead of skipping. Give every optimizer of one "
                      "DDP model the same kind (all fused, or none; or guard_gradients=\"hook\" for all)",
                      stacklevel=user_stacklevel())
    kinds.add(guard)


def _hdet_hook_on(ddp: "torch.nn.parallel.DistributedDataParallel") -> HookGuard | None:
    """The :class:`HookGuard` a scheduler registered on ``ddp`` (DDP keeps its comm hook in ``_comm_hooks``), if any."""
    for hook, state in getattr(ddp, "_comm_hooks", ()):
        if hook is _guarded_allreduce and isinstance(state, HookGuard):
            return state
    return None


def install_gradient_guard(ddp: "torch.nn.parallel.DistributedDataParallel", optimizer: torch.optim.Optimizer,
                           loss_scale: LossScale, process_group: Any = None,
                           local: Callable[[], bool] = lambda: False) -> HookGuard | None:
    """Register the hook guard (:class:`HookGuard`) on ``ddp`` for ``optimizer``; None (with a warning) if DDP
    refuses (a hook is already registered, or training has started). ``local()``: the model's last forward ran
    inside ``no_sync()``."""
    old = _hdet_hook_on(ddp)
    if old is not None and (old.closed or old.orphaned):  # (a closed or dropped scheduler's, on this DDP model for
        # good: taken over)
        old.reopen(process_group, optimizer, loss_scale, local, list(ddp.parameters()))
        return old
    state = HookGuard(process_group, optimizer, loss_scale, local, model_params=ddp.parameters())
    try:
        ddp.register_comm_hook(state, _guarded_allreduce)
    except RuntimeError as e:
        state.remove()
        hooks = getattr(ddp, "_comm_hooks", None)  # (torch lists the hook before it refuses a second one: this one's
        if isinstance(hooks, list):  # entry taken out, a user's own hook was taken for another scheduler's, an audit)
            hooks[:] = [entry for entry in hooks if not (isinstance(entry, tuple) and entry[-1] is state)]
        if _hdet_hook_on(ddp) is not None:  # another scheduler's (or a discarded one's): it zeroes a replica's
            # non-finite contribution to every bucket, but watches that scheduler's optimizer only (its GradScaler,
            # its stall counts): not this one's, so it is not taken as this scheduler's guard
            warnings.warn("hdet: the DDP model already carries another HDET scheduler's \"hook\" gradient guard (DDP "
                          "takes one comm hook): it keeps a replica's non-finite gradient out of every bucket, but "
                          "watches that scheduler's optimizer only (its GradScaler, its early recovery), so this "
                          "scheduler has no guard of its own until that one is closed or dropped (then it takes the "
                          "hook over; sched.close() ends a run left early). Build one scheduler per DDP model, or use "
                          "fused optimizers (fused=True: the \"skip\" guard, one per optimizer)",
                          stacklevel=user_stacklevel())
        else:
            warnings.warn(f"hdet: could not install the gradient guard on the DDP model ({e}); a non-finite gradient "
                          "on one replica will reach all of them. DDP takes one comm hook: with a hook of your own, a "
                          "fused optimizer (fused=True) gets hdet's \"skip\" guard, which needs none",
                          stacklevel=user_stacklevel())
        return None
    return state


class GuardSetting:
    """A scheduler's ``guard_gradients`` and what it installed: the guard goes on once the model is one
    whose gradients are all-reduced (DDP with several replicas, or FSDP2/HSDP replicas), at construction
    or at :meth:`install` from ``attach_model``; never twice."""

    def __init__(self, guard: Any, process_group: Any, device_mesh: Any, optimizer: torch.optim.Optimizer,
                 world_size: int, loss_scale: LossScale, recovering: bool = False) -> None:
        resolve_guard(guard, optimizer, advise=False)  # a bad value fails here, not later
        self.guard, self.process_group, self.device_mesh = guard, process_group, device_mesh
        self.recovering = recovering  # on_runaway="recover": "auto" may read only the sentinels
        self.optimizer, self.world_size = optimizer, world_size
        self.loss_scale = loss_scale  # the GradScaler driving the optimizer, shared with the scheduler
        self.installed: str | None = None  # "hook", "skip" or "skip-all"
        self.local = False  # the DDP model's last forward ran inside ddp.no_sync() (local mode, at an optimizer step)
        self._local_hook: Any = None
        self.skip: SkipNonFiniteStep | None = None
        self.hook: HookGuard | None = None
        self.watch: SkipWatch | ScalerWatch | None = None  # early recovery when every replica stalls
        self._resumed = False  # loaded from a run that had taken steps (see resumed)
        self._waiting: Any = None  # the DDP model whose hook guard another scheduler holds (retry)
        self._loaded: dict[str, Any] | None = None  # the watch's loaded state, until the watch exists

    def state_dict(self) -> dict[str, Any] | None:
        """The stall watch's counts (plain data); before the watch exists, those loaded for it (or None)."""
        if self.watch is None:
            return copy.deepcopy(self._loaded)
        return self.watch.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The watch's counts as saved (checked already): set now, or when the guard is installed. A state saved
        with the other kind of watch (another optimizer or set-up) is left aside: :meth:`resumed`'s rule applies."""
        self._loaded = copy.deepcopy(state)  # (this object's own: the caller's dict may change after the check)
        self._apply_loaded()

    def _apply_loaded(self) -> None:
        state = self._loaded
        if state is None or self.watch is None:
            return
        kind = "skip" if isinstance(self.watch, SkipWatch) else "hook"
        if state["kind"] == kind:
            self.watch.load_state_dict(state)
        else:
            self._loaded = None
            if self._resumed:
                self.resumed()

    def resumed(self) -> None:
        """The run was resumed after steps were taken: the watches count a stall from the first step (not only after a
        step taken in this process, their rule for a GradScaler's first skips: its scale is loaded with the run). A
        checkpoint that holds the watch's own counts (:meth:`state_dict`) sets them instead, exactly."""
        self._resumed = True
        if self._loaded is not None:
            return
        if isinstance(self.watch, SkipWatch):
            self.watch._taken = True
        if self.hook is not None:
            self.hook.taken = max(self.hook.taken, 1)

    def _is_local(self) -> bool:
        return self.local

    def _note_local(self, module: Any, args: Any) -> None:
        """At each forward of the DDP model: inside ``ddp.no_sync()`` its backward all-reduces nothing. When the
        optimizer steps on such gradients (local mode; not gradient accumulation, whose last micro-step syncs),
        replicas skip steps on their own and :class:`SkipWatch`'s early recovery (a collective that every replica
        must enter) is left to the converge step. A forward with autograd off (an evaluation through the DDP model,
        outside ``no_sync()``, between a training forward and its optimizer step) has no backward and says nothing:
        it left a local run treated as shared at that step's sync (its early recovery's collective entered alone)."""
        if torch.is_grad_enabled():
            self.local = not module.require_backward_grad_sync

    def orphan(self) -> None:
        """Its scheduler dropped unclosed (from a finalizer, maybe inside a step: nothing is taken off, the hooks
        idle): a hook guard goes on zeroing until the next scheduler on the model takes it over."""
        if self.skip is not None:
            self.skip.active = False
        if self.hook is not None:
            self.hook.orphan()

    @property
    def waiting(self) -> bool:
        """Whether another scheduler's hook guard holds the model (:meth:`retry`)."""
        return self._waiting is not None

    def retry(self) -> None:
        """A "hook" guard that could not go on because another scheduler's held the DDP model: taken over once that
        one is closed or dropped (a search's next trial, built while the last one's scheduler was still referenced,
        had no guard at all once that one was collected: a review). At a scheduler step, while it waits."""
        ddp = self._waiting
        old = _hdet_hook_on(ddp) if ddp is not None else None
        if old is not None and (old.closed or old.orphaned):
            self._waiting = None
            self._install(ddp)

    def close(self) -> None:
        """Everything the guard put on the optimizer and the model taken off (:meth:`hdet.HDETLR.close`); the hook
        guard's comm hook, which DDP keeps, averages as DDP does from now on."""
        self._waiting = None
        if self._local_hook is not None:
            self._local_hook.remove()
            self._local_hook = None
        if self.skip is not None:
            self.skip.remove()
        if self.hook is not None:
            self.hook.close()

    def reopen(self, model: Any) -> None:
        """After :meth:`close`: the same guard on again (its counts kept; a closed "hook" guard taken back over)."""
        if self.skip is not None:
            self.skip.active = True
            self.skip.hook_on()
        model = uncompiled(model)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if self._local_hook is None:
                self._local_hook = model.register_forward_pre_hook(weak_method(self._note_local))
            if self.hook is not None and _hdet_hook_on(model) is self.hook and (self.hook.closed or self.hook.orphaned):
                counts = self.watch.state_dict() if self.watch is not None else None
                self.hook.reopen(self.process_group, self.optimizer, self.loss_scale, weak_method(self._is_local, False),
                                 list(model.parameters()))
                if counts is not None:
                    self.watch.load_state_dict(counts)
            elif self.hook is not None:  # (another scheduler took it over meanwhile: this one waits for it)
                self.hook, self.installed, self.watch, self._waiting = None, None, None, model

    def missing(self, model: Any) -> bool:
        """Whether a guard asked for (``guard_gradients``) is off only because ``model`` is no DDP module: with
        several replicas and no device mesh, where :meth:`_install` would have put one on a DDP model (nothing
        installed, none waiting for another scheduler's). Read by the scheduler's first step, which says so."""
        return (self.installed is None and not self.waiting and self.device_mesh is None and self.world_size > 1
                and not isinstance(uncompiled(model), torch.nn.parallel.DistributedDataParallel)
                and resolve_guard(self.guard, self.optimizer, advise=False, recovering=self.recovering) is not None)

    def install(self, model: Any) -> None:
        """Install the guard on ``model`` (once); an install that fails (a "skip" guard on a non-fused optimizer, a
        "hook" with a device mesh) takes back the forward pre-hook it put on."""
        added = self._local_hook is None
        try:
            self._install(model)
        except BaseException:
            if added and self._local_hook is not None:
                self._local_hook.remove()
                self._local_hook = None
            raise

    def _install(self, model: Any) -> None:
        model = uncompiled(model)  # torch.compile(DDP(net)): the guard goes on the DDP module inside
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and self._local_hook is None:
            self._local_hook = model.register_forward_pre_hook(weak_method(self._note_local))  # (the DDP model
            # holds no guard: a dropped scheduler's optimizer is freed)
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.world_size > 1
        sharded = self.device_mesh is not None and self.world_size > 1
        if self.installed is not None or not (ddp or sharded):
            return
        guard = resolve_guard(self.guard, self.optimizer, advise=ddp, mesh=sharded, recovering=self.recovering)
        if guard in ("skip", "skip-all"):
            # FSDP2/HSDP: ranks hold different shards, so they agree on the decision over the whole mesh
            mesh = self.device_mesh
            groups = [mesh.get_group(i) for i in range(mesh.ndim)] if sharded else []
            self.skip = SkipNonFiniteStep(self.optimizer, agree_over=groups,
                                          reads="sentinels" if guard == "skip" else "all")
            self.watch = SkipWatch(self.skip, local=lambda: self.local, loss_scale=self.loss_scale)
            self.installed = guard
        elif guard == "hook" and ddp:
            self.hook = install_gradient_guard(model, self.optimizer, self.loss_scale, self.process_group,
                                               local=weak_method(self._is_local, False))
            self.installed = "hook" if self.hook is not None else None
            held = self.hook is None and _hdet_hook_on(model) is not None
            self._waiting = model if held else None
            if self.hook is not None and not _fused(self.optimizer):  # (steps stall only under a GradScaler; a fused
                # optimizer, "hook" chosen by hand, is stepped by the scaler even when it skips: no count to read)
                self.watch = ScalerWatch(self.hook, local=lambda: self.local)
        if ddp and self.installed is not None:
            _check_one_kind(model, self.installed)
        if self._resumed:  # (loaded before the model was attached)
            self.resumed()
        self._apply_loaded()
