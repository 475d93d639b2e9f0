"""hdet.flat: contiguous parameters and the runs the converge step all-reduces in place."""

import pytest
import torch
from torch import nn

import hdet
from hdet.flat import contiguous_runs


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    m[1].weight = m[0].weight  # tied: one parameter, listed once
    m.extra = nn.Parameter(torch.randn(3, dtype=torch.float64))
    return m


def test_contiguous_parameters_keep_values_objects_and_ties():
    m = _model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids = [id(p) for p in m.parameters()]
    flats = hdet.contiguous_parameters_(m)
    assert [id(p) for p in m.parameters()] == ids and m[1].weight is m[0].weight
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    assert [d for _, d in flats] == [torch.float64, torch.float32]  # m.extra is listed first and flats[(torch.device("cpu"), torch.float32)].numel() == 50
    runs = contiguous_runs(list(m.parameters()))
    assert [idx for idx, _ in runs] == [[0], [1, 2]]  # the float64 one; the tied weight + bias in one run
    runs[1][1].fill_(7.0)  # the run's view is the parameters' own memory
    assert (m[0].weight == 7).all() and (m[1].bias == 7).all()
    out = m[1](torch.ones(2, 4)).sum()
    out.backward()  # autograd is unaffected
    assert m[0].weight.grad is not None and m[0].weight.grad.shape == (10, 4)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.mid(self.emb(idx)))


def _aliased_by_assign() -> nn.Module:
    """A tied model built on the meta device and loaded with assign=True (the memory-saving load): its head and
    embedding are two Parameter objects over one tensor's memory."""
    torch.manual_seed(0)
    sd = _Tied().state_dict()
    with torch.device("meta"):
        m = _Tied()
    m.load_state_dict(sd, assign=True)
    return m


@pytest.mark.parametrize("how", ["assign", "parameter_of_a_parameter"])
def test_weights_tied_through_their_memory_stay_tied(how):
    """Two Parameter objects over the same memory (load_state_dict(..., assign=True) of a tied model built on the meta
    device; nn.Parameter(other.weight)) are one weight: each got its own copy in the flat buffer, and the model trained
    them apart (0.09 between head and embedding after 10 steps under DDP, silently; an audit)."""
    if how == "assign":
        m = _aliased_by_assign()
    else:
        torch.manual_seed(0)
        m = _Tied()
        m.head.weight = nn.Parameter(m.emb.weight)
    assert m.head.weight is not m.emb.weight and m.head.weight.data_ptr() == m.emb.weight.data_ptr()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    flats = hdet.contiguous_parameters_(m)
    assert flats[(torch.device("cpu"), torch.float32)].numel() == 40 + 16 + 4  # the tied weight laid out once
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    assert m.head.weight.data_ptr() == m.emb.weight.data_ptr()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        m(torch.arange(6)).square().mean().backward()
        opt.step()
    assert torch.equal(m.head.weight, m.emb.weight)  # still one weight after training
    runs = contiguous_runs([p for p in m.parameters()])
    assert all(flat is not None for _, flat in runs)


def test_parameters_overlapping_in_part_are_refused():
    m = nn.Linear(4, 4)
    m.part = nn.Parameter(m.weight.data[1:3])  # a slice of another parameter's memory
    with pytest.raises(ValueError, match=r"share no memory, or share all of it.*overlaps"):
        hdet.contiguous_parameters_(m)
    fused = nn.Module()  # column blocks of one matrix interleave in memory but share no element: laid out
    w = torch.randn(4, 6)
    fused.a, fused.b = nn.Parameter(w[:, :3]), nn.Parameter(w[:, 3:])
    hdet.contiguous_parameters_(fused)
    assert torch.equal(torch.cat([fused.a, fused.b], 1), w)


def test_runs_break_at_gaps_transposes_and_dtypes():
    buf = torch.arange(20.0)
    a, b, c = buf[0:4], buf[4:8], buf[10:14]  # a, b back to back; c after a gap
    t = buf[:16].view(4, 4).t()  # not contiguous
    runs = contiguous_runs([a, b, c, t, torch.zeros(3, dtype=torch.float64)])
    assert [idx for idx, _ in runs] == [[0, 1], [2], [3], [4]]
    assert runs[0][1].data_ptr() == a.data_ptr() and runs[0][1].numel() == 8 and runs[2][1] is None


def test_a_compiled_model_sees_in_place_updates_of_the_flat_buffer():
    """A converge step writes the flat buffer in place: a torch.compile'd forward must see the new weights
    (no stale copy), as the eager module does."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    (flat,) = hdet.contiguous_parameters_(m).values()
    fast = torch.compile(m)
    x = torch.randn(3, 4)
    before = fast(x)
    torch.testing.assert_close(before, m(x))
    with torch.no_grad():
        flat.mul_(0.5)  # what an all_reduce(AVG) over the run does to every weight at once
    assert m[0].weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # still views
    after = fast(x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, m(x))
    out = fast(x).sum()
    out.backward()  # gradients flow to the view parameters
    assert m[2].weight.grad is not None


def test_order_lays_the_parameters_out_as_the_param_groups_walk_them():
    """Weight decay on the matrices only (two param groups) interleaves the groups in the module's order: the converge
    step, walking group by group, found one-tensor runs (the matrices went through buckets). order=optimizer lays them
    out in its groups' order: one run, and the optimizer keeps stepping the same parameters."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    decay = [p for p in m.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}])
    walked = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in walked]
    hdet.contiguous_parameters_(m)
    assert len(contiguous_runs(walked)) == 4
    hdet.contiguous_parameters_(m, order=opt)
    assert [idx for idx, _ in contiguous_runs(walked)] == [list(range(6))]
    assert all(torch.equal(p, b) for p, b in zip(walked, before))
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    assert not any(torch.equal(p, b) for p, b in zip(decay, before[:2]))  # stepped through the same objects
    hdet.contiguous_parameters_(m, order=[nn.Parameter(torch.zeros(2)), *reversed(walked)])  # one outside: left out
    assert [idx for idx, _ in contiguous_runs(walked[::-1])] == [list(range(6))]
