"""ftrun.snapshot.layout: capture a trainer's state, store it as the engine would, restore it bit-exactly."""

from __future__ import annotations

import math
import random
import struct
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from ftrun.snapshot.layout import (
    ALIGN, Capture, Entry, Layout, UnsupportedState, capture, decode_meta, encode_meta, restore,
)


def store(cap: Capture) -> tuple[Layout, dict, Callable[[Entry], torch.Tensor]]:
    """What the engine does: copy every tensor into one flat buffer, ship the metadata as JSON bytes."""
    buf = torch.zeros(cap.layout.nbytes, dtype=torch.uint8)

    def view(e: Entry) -> torch.Tensor:
        return buf[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).reshape(e.shape)

    for e, t in zip(cap.layout.entries, cap.tensors, strict=True):
        view(e).copy_(t)
    layout, skeleton = decode_meta(encode_meta(cap.layout, cap.skeleton))
    return layout, skeleton, view


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same(a: object, b: object) -> bool:
    """Equal values of the same types, floats and tensors compared bit by bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return [(type(k), k) for k in a] == [(type(k), k) for k in b] and all(same(a[k], b[k]) for k in a)
    return a == b


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.norm(self.lin(self.emb(x).mean(1)))))


class Loader:
    def __init__(self) -> None:
        self.pos, self.order = 0, [3, 1, 2]

    def state_dict(self) -> dict:
        return {"pos": self.pos, "order": list(self.order)}

    def load_state_dict(self, sd: dict) -> None:
        self.pos, self.order = sd["pos"], list(sd["order"])


def trainer(seed: int) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)


def step(model: Net, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randint(0, 10, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()


def full_state(seed: int, steps: int) -> dict:
    model, opt, sched = trainer(seed)
    for i in range(steps):
        step(model, opt, sched, i)
    return {"model": model, "optim": opt, "sched": sched, "data": Loader(), "epoch_info": {}, "ema": None,
            "scalar": None, "arr": None}


@pytest.fixture
def trained() -> dict:
    state = full_state(0, 3)
    state["data"].pos = 7
    odd_nan = struct.unpack("<d", bytes.fromhex("0100000000f8ffff"))[0]  # sign bit and payload set
    od = OrderedDict(b=2, a=1)
    od._metadata = {"": {"version": 2}}  # as on a module's state_dict()
    state["epoch_info"] = {"epoch": 3, 7: ("a", 1.5, None), "vals": [math.nan, odd_nan, -0.0, math.inf, -math.inf],
                           "blob": b"\x00\xff", "nested": {1: {2: [True, False]}}, "np": np.float32(0.25), "od": od}
    state["ema"] = torch.randn(3, 4).to(torch.bfloat16)
    state["scalar"] = torch.tensor(2.5)
    state["arr"] = np.arange(6, dtype=np.float32).reshape(2, 3)
    return state


def fresh() -> dict:
    state = full_state(1, 0)
    state.update(ema=torch.zeros(3, 4, dtype=torch.bfloat16), scalar=torch.tensor(0.0), arr=np.zeros((2, 3), "f4"))
    return state


def assert_same_state(a: dict, b: dict) -> None:
    for key in ("model", "optim", "sched", "data"):
        assert same(a[key].state_dict(), b[key].state_dict()), key
    for key in ("epoch_info", "ema", "scalar", "arr"):
        assert same(a[key], b[key]), key


def test_round_trip_into_fresh_objects_then_train_identically(trained: dict) -> None:
    cap = capture(trained, rng=False)
    layout, skeleton, stored = store(cap)
    live = fresh()
    epoch_info, ema = live["epoch_info"], live["ema"]
    restore(live, layout, skeleton, stored)
    assert_same_state(trained, live)
    assert live["epoch_info"] is epoch_info and live["ema"] is ema  # mutated in place, not replaced
    assert type(live["epoch_info"]["np"]) is np.float32
    assert live["epoch_info"]["od"]._metadata == {"": {"version": 2}}
    assert live["optim"].param_groups[0]["lr"] == trained["optim"].param_groups[0]["lr"] == 1e-2 * 0.5 ** 3
    for state in (trained, live):
        step(state["model"], state["optim"], state["sched"], 3)
    assert_same_state(trained, live)


def test_restore_copies_into_live_tensors(trained: dict) -> None:
    model, opt = trained["model"], trained["optim"]
    cap = capture(trained, rng=False)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = opt.state[model.lin.weight]["exp_avg"]
    expected_avg = exp_avg.clone()
    layout, skeleton, stored = store(cap)
    step(model, opt, trained["sched"], 3)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    model.load_state_dict = lambda *a, **k: pytest.fail("every tensor was copied in place")
    restore(trained, layout, skeleton, stored)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs
    assert same(dict(model.state_dict()), expected)
    assert opt.state[model.lin.weight]["exp_avg"] is exp_avg and torch.equal(exp_avg, expected_avg)


def test_rng_round_trip() -> None:
    cap = capture({})
    assert {e.path for e in cap.layout.entries} == {"__rng__/numpy/1", "__rng__/torch"}
    layout, skeleton, stored = store(cap)
    first = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    restore({}, layout, skeleton, stored)
    second = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert same(first, second)


def test_parameters_and_optimizer_state_by_reference_others_cloned(trained: dict) -> None:
    cap = capture(trained)
    got = {e.path: t for e, t in zip(cap.layout.entries, cap.tensors, strict=True)}
    model, opt = trained["model"], trained["optim"]
    for name, p in model.named_parameters():
        assert got[f"model/{name}"].data_ptr() == p.data_ptr()
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for name, t in opt.state[p].items():
            assert got[f"optim/state/{i}/{name}"].data_ptr() == t.data_ptr()
    assert got["model/bn.running_mean"].data_ptr() != model.bn.running_mean.data_ptr()
    assert got["ema"].data_ptr() != trained["ema"].data_ptr()
    assert got["arr"].data_ptr() != trained["arr"].ctypes.data
    before = got["model/bn.running_mean"].clone()
    model.bn.running_mean.add_(1)  # a forward pass after capture must not change the snapshot
    assert torch.equal(got["model/bn.running_mean"], before)


class AppState:
    """As DCP's recipes (torchtitan) write it: one Stateful whose state dict holds the model's and optimizer's."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])


def test_parameters_and_optimizer_state_in_another_object_s_state_dict_by_reference(trained: dict) -> None:
    """A Stateful app state (DCP's recipe) returns the parameters and optimizer states in a state dict of its own:
    they were cloned at every save, on the training thread (3-5 % of a step instead of under 2 %)."""
    model, opt = trained["model"], trained["optim"]
    tensors = [*model.parameters(), *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))]
    stepped = {t.untyped_storage().data_ptr() for t in tensors}
    asked = []
    cap = capture({"app": AppState(model, opt)}, rng=False, stepped=lambda: asked.append(1) or stepped)
    got = {e.path: t for e, t in zip(cap.layout.entries, cap.tensors, strict=True)}
    assert asked == [1]  # once per capture
    for name, p in model.named_parameters():
        assert got[f"app/model/{name}"].data_ptr() == p.data_ptr()
    exp_avg = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
    assert got["app/optim/state/0/exp_avg"].data_ptr() == exp_avg.data_ptr()
    assert got["app/model/bn.running_mean"].data_ptr() != model.bn.running_mean.data_ptr()  # a buffer: cloned
    cloned = capture({"app": AppState(model, opt)}, rng=False)  # nothing stepped: cloned, as before
    assert not cloned.by_reference
    assert not capture({"app": AppState(model, opt)}, rng=False, live=False, stepped=lambda: stepped).by_reference
    fresh_state = fresh()
    restore({"app": AppState(fresh_state["model"], fresh_state["optim"])}, *store(cap))
    assert same(fresh_state["model"].state_dict(), model.state_dict())


def test_unsupported_values_name_their_path() -> None:
    with pytest.raises(UnsupportedState, match=r"cannot snapshot function at fn: give it state_dict"):
        capture({"fn": lambda: 0})
    with pytest.raises(UnsupportedState, match=r"object at cfg/a/1"):
        capture({"cfg": {"a": [1, object()]}})
    with pytest.raises(UnsupportedState, match=r"__rng__"):
        capture({"__rng__": 1})
    with pytest.raises(UnsupportedState, match=r"sparse tensor at w"):
        capture({"w": torch.eye(2).to_sparse()})


def test_restore_rejects_mismatched_state(trained: dict) -> None:
    layout, skeleton, stored = store(capture(trained, rng=False))
    with pytest.raises(ValueError, match="state keys not in the snapshot: \\['extra'\\]"):
        restore({**trained, "extra": 1}, layout, skeleton, stored)
    with pytest.raises(ValueError, match="cannot restore ema: the snapshot holds bfloat16 \\[3, 4\\]"):
        restore({**trained, "ema": torch.zeros(4, 3)}, layout, skeleton, stored)
    with pytest.raises(ValueError, match="cannot restore data: the snapshot holds a state_dict"):
        restore({**trained, "data": 3}, layout, skeleton, stored)


def test_entries_added_after_the_state_was_built_come_back(trained: dict) -> None:
    """A restarted script builds its state as at step 0: an entry it adds later (an EMA copy from step N on, a
    best metric), or a placeholder it fills later, was refused ("missing"), and every restart failed the same."""
    later = {**trained, "ema": trained["ema"].clone(), "best": {"loss": 0.5, "at": torch.arange(3)},
             "filled": torch.ones(2)}
    layout, skeleton, stored = store(capture(later, rng=False))
    fresh = {k: v for k, v in trained.items() if k not in ("ema", "best")} | {"filled": None}
    restore(fresh, layout, skeleton, stored)
    assert torch.equal(fresh["ema"], later["ema"]) and fresh["best"]["loss"] == 0.5
    assert torch.equal(fresh["best"]["at"], torch.arange(3)) and torch.equal(fresh["filled"], torch.ones(2))
    assert fresh["ema"] is not later["ema"]
    with_module = {**trained, "swa": nn.Linear(2, 2)}
    layout, skeleton, stored = store(capture(with_module, rng=False))
    with pytest.raises(ValueError, match="cannot restore swa: the snapshot holds a state_dict\\(\\) \\(a module's, an "
                                         "optimizer's\\) and the state has no object there: put one of its kind"):
        restore(dict(trained), layout, skeleton, stored)


def test_lazy_module_is_materialized_by_restore() -> None:
    """A restarted script builds its lazy modules (``nn.LazyLinear``) unmaterialized, as at step 0, and restores
    before a forward; ``load_state_dict`` materializes them, as a torch.load-and-load resume does. The restore read
    the shape of the live uninitialized parameter ("Can't access the shape of an uninitialized parameter") and
    every restart failed the same."""
    torch.manual_seed(0)
    trained = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    trained(torch.ones(3, 5))
    layout, skeleton, stored = store(capture({"model": trained}, rng=False))
    live = {"model": nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))}
    restore(live, layout, skeleton, stored)
    assert not any(nn.parameter.is_lazy(p) for p in live["model"].parameters())
    assert same(dict(live["model"].state_dict()), dict(trained.state_dict()))
    assert isinstance(live["model"][0].weight, nn.Parameter) and live["model"][0].weight.requires_grad


def test_layout_digest_alignment_and_json() -> None:
    a = capture({"m": nn.Linear(3, 5), "x": torch.zeros(3, dtype=torch.int8)}, rng=False).layout
    b = capture({"m": nn.Linear(3, 5), "x": torch.ones(3, dtype=torch.int8)}, rng=False).layout
    c = capture({"m": nn.Linear(3, 6), "x": torch.zeros(3, dtype=torch.int8)}, rng=False).layout
    assert a == b and a.digest == b.digest and a.digest != c.digest and 0 <= a.digest < 2 ** 63
    assert [e.offset for e in a.entries] == [0, 64, 128]  # 60 B weight, 20 B bias, 3 B x
    assert all(e.offset % ALIGN == 0 for e in c.entries) and a.nbytes == 192
    assert Layout.from_json(a.to_json()) == a
    assert capture({}, rng=False).layout.nbytes == 0
    with pytest.raises(ValueError, match="digest"):
        Layout.from_json({**a.to_json(), "digest": a.digest ^ 1})


def test_prefixed_keys_of_wrapped_module() -> None:
    class Wrapper(nn.Module):  # DistributedDataParallel's keys look like this: "module." + name
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    torch.manual_seed(0)
    src, dst = Wrapper(Net()), Wrapper(Net())
    cap = capture({"model": src}, rng=False)
    assert cap.layout.entries[0].path == "model/module.emb.weight"
    assert cap.tensors[0].data_ptr() == src.module.emb.weight.data_ptr()
    restore({"model": dst}, *store(cap))
    assert same(dict(src.state_dict()), dict(dst.state_dict()))


def test_parameters_are_cloned_too_when_not_live(trained: dict) -> None:
    """Before any optimizer step (a loop that updates parameters by hand) parameters and optimizer state are
    cloned like the rest; ``by_reference`` says whether any tensor was not."""
    model, opt = trained["model"], trained["optim"]
    cloned = capture(trained, live=False)
    assert not cloned.by_reference
    got = {e.path: t for e, t in zip(cloned.layout.entries, cloned.tensors, strict=True)}
    assert all(got[f"model/{name}"].data_ptr() != p.data_ptr() for name, p in model.named_parameters())
    exp_avg = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
    assert got["optim/state/0/exp_avg"].data_ptr() != exp_avg.data_ptr()
    assert capture(trained).by_reference and not capture({"arr": np.zeros(3)}).by_reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_and_rng() -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(4, 5, dtype=torch.long, device="cuda")).sum().backward()
    opt.step()
    cap = capture({"model": model, "optim": opt})
    got = {e.path: t for e, t in zip(cap.layout.entries, cap.tensors, strict=True)}
    assert got["model/lin.weight"].data_ptr() == model.lin.weight.data_ptr()
    buf = got["model/bn.running_mean"]
    assert buf.is_cuda and buf.data_ptr() != model.bn.running_mean.data_ptr()
    assert "__rng__/cuda/0" in got
    layout, skeleton, stored = store(cap)
    first = torch.rand(3, device="cuda")
    torch.manual_seed(1)
    model2 = Net().cuda()
    opt2 = torch.optim.AdamW(model2.parameters())
    ptr = model2.lin.weight.data_ptr()
    restore({"model": model2, "optim": opt2}, layout, skeleton, stored)
    assert torch.equal(torch.rand(3, device="cuda"), first)
    assert model2.lin.weight.data_ptr() == ptr and opt2.state[model2.lin.weight]["exp_avg"].is_cuda
    assert same(dict(model.state_dict()), dict(model2.state_dict()))
    assert same(opt.state_dict(), opt2.state_dict())


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = math.prod(shape) * dtype.itemsize
    raw = torch.tensor(list(draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
    t = (raw % 2 if dtype == torch.bool else raw).view(dtype).reshape(shape)
    return t.mT if t.dim() >= 2 and draw(st.booleans()) else t  # sometimes not contiguous


leaves = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.binary(max_size=6)
          | tensors() | tensors().filter(lambda t: t.dtype != torch.bfloat16).map(lambda t: t.numpy().copy()))
plain = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                     | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3), inner, max_size=3), max_leaves=12)


@settings(deadline=None, max_examples=50)
@given(plain)
def test_plain_values_and_tensors_round_trip(value: object) -> None:
    cap = capture({"v": [value]}, rng=False)
    assert len(cap.tensors) == len(cap.layout.entries)
    live: dict = {"v": []}
    restore(live, *store(cap))
    assert same(live["v"][0], value)
