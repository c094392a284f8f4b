"""The cost model (needle.cost_model): op kinds and their work from specs alone, the cached calibration, and the
seconds it predicts. No timing is asserted here (benchmarks/bench_cost_model.py compares predictions with
measurements); the calibration is only checked to give positive, finite rates."""
import dataclasses
import json
import math

import numpy as np
import pytest

import needle as ndl
from needle import autograd, ops
from needle.toolbox import cost_model
from needle.autograd import TensorOp, infer_spec, placeholder
from needle.toolbox.cost_model import FLOP_KINDS, KINDS, Calibration, CostModel, device_copies_overlap, op_work

from conftest import device_params
from models import LanguageModel


def language_model_graph():
    """A small Transformer LM's forward graph (the full head with SoftmaxLoss and the fused head) and the gradient
    graph of every forward node, built lazily: nothing is computed."""
    np.random.seed(0)
    model = LanguageModel(16, 50, 32, num_layers=2, seq_model="transformer", seq_len=8, num_head=2, dim_head=8,
                          device=ndl.cpu())
    rs = np.random.RandomState(0)
    x = ndl.Tensor(rs.randint(0, 50, (8, 4)).astype(np.float32), requires_grad=False)
    y = ndl.Tensor(rs.randint(0, 50, (32,)).astype(np.float32), requires_grad=False)
    with autograd.lazy_mode(True):
        logits, _ = model(x)
        roots = [ndl.nn.SoftmaxLoss()(logits, y), model.loss(x, y)[0]]
        for node in autograd.find_topo_sort(list(roots)):
            if node.op is not None and node.requires_grad:
                roots.extend(g for g in node.op.gradient_as_tuple(stand_in_grad(node), node) if g is not None)
    return autograd.find_topo_sort(roots)


def stand_in_grad(node):
    shape, dtype, device = infer_spec(node)
    if autograd.element_shapes(shape) is None:
        return placeholder((shape, dtype, device), requires_grad=False)
    return ops.make_tuple(*(placeholder((s, dtype, device), requires_grad=False) for s in shape))


def lazy(fn, *shapes):
    """fn applied lazily to leaves of these shapes (values present, so only the result is a missing value)."""
    rng = np.random.default_rng(0)
    with autograd.lazy_mode(True):
        return fn(*(ndl.Tensor(rng.random(s).astype(np.float32), requires_grad=False) for s in shapes))


# ----- op_work ----------------------------------------------------------------------------------------------------
def test_every_node_of_a_language_model_graph_gets_a_kind_and_nothing_is_computed():
    order = language_model_graph()
    computed = [n for n in order if n.op is not None]
    works = {id(n): op_work(n) for n in computed}
    assert {w[0] for w in works.values()} <= set(KINDS)
    # the fused ops and their gradients each land in their own kind, and the graph has them all
    kinds = {type(n.op).__name__: works[id(n)][0] for n in computed}
    assert kinds["Linear"] == "matmul"
    assert kinds["LinearCrossEntropy"] == kinds["LinearCrossEntropyGrad"] == "linear_cross_entropy"
    assert kinds["ScaledDotProductAttention"] == kinds["ScaledDotProductAttentionGrad"] == "attention"
    assert kinds["LayerNorm"] == kinds["LayerNormGrad"] == "layernorm"
    assert kinds["SoftmaxCrossEntropy"] == kinds["SoftmaxCrossEntropyGrad"] == "cross_entropy"
    assert kinds["Reshape"] == kinds["Transpose"] == kinds["TupleGetItem"] == "view"
    assert kinds["EWiseAdd"] == "elementwise" and kinds["Summation"] == "reduction"
    assert kinds["GatherRows"] == "copy"
    for n in computed:
        kind, flops, nbytes = works[id(n)]
        assert (flops > 0) == (kind in FLOP_KINDS), type(n.op).__name__
        assert (nbytes > 0) == (kind != "view"), type(n.op).__name__
    assert all(n.cached_data is None for n in computed)  # from specs alone


def test_linear_flops_in_the_language_model_are_2mnk():
    order = language_model_graph()
    linears = [n for n in order if isinstance(n.op, ops.Linear)]
    assert len(linears) >= 8  # q, k, v, out and two MLP layers per layer, and the head
    for n in linears:
        x, w = (infer_spec(i)[0] for i in n.inputs[:2])
        assert op_work(n)[1] == 2 * math.prod(x[:-1]) * w[0] * w[1]
    (head,) = [n for n in order if isinstance(n.op, ops.LinearCrossEntropy)]
    (head_grad,) = [n for n in order if isinstance(n.op, ops.LinearCrossEntropyGrad)]
    assert op_work(head)[1] == 2 * 32 * 16 * 50  # tokens x embedding x vocabulary: the logits h W
    assert op_work(head_grad)[1] == 3 * op_work(head)[1]  # the logits again, dz W^T, h^T dz


def test_matmul_flops_and_bytes_for_known_shapes():
    batched = lazy(ops.matmul, (3, 4, 5), (5, 6))  # the weight broadcast over 3 batches
    assert op_work(batched) == ("matmul", 2 * 3 * 4 * 5 * 6, 4 * (3 * 4 * 5 + 5 * 6 + 3 * 4 * 6))
    both_batched = lazy(ops.matmul, (2, 7, 3), (2, 3, 9))
    assert op_work(both_batched)[:2] == ("matmul", 2 * 2 * 7 * 3 * 9)


def test_attention_flops_count_the_pairs_the_kernel_visits():
    B, H, T, D = 2, 3, 8, 4
    full = lazy(lambda q, k, v: ops.scaled_dot_product_attention(q, k, v), *[(B, H, T, D)] * 3).inputs[0]
    causal = lazy(lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=True), *[(B, H, T, D)] * 3)
    assert op_work(full)[:2] == ("attention", 4 * B * H * T * T * D)
    assert op_work(causal.inputs[0])[:2] == ("attention", 4 * B * H * (T * (T + 1) // 2) * D)
    with autograd.lazy_mode(True):
        grads = full.op.gradient_as_tuple(stand_in_grad(full), full)
    assert op_work(grads[0].inputs[0])[:2] == ("attention", 2 * B * H * T * T * 5 * D)  # five products per tile


def test_a_linear_with_gelu_is_a_matmul_that_writes_both_its_outputs():
    node = lazy(lambda x, w: ops.linear(x, w, activation="gelu"), (4, 8), (8, 5)).inputs[0]  # the tuple node
    assert op_work(node) == ("matmul", 2 * 4 * 5 * 8, 4 * (4 * 8 + 8 * 5 + 2 * 4 * 5))  # f(z) and z written


def test_conv_flops_are_im2col_matmul_flops():
    node = lazy(lambda z, w: ops.conv(z, w, padding=1), (2, 6, 6, 3), (3, 3, 3, 5))
    assert op_work(node)[:2] == ("conv", 2 * (2 * 6 * 6 * 5) * 3 * 3 * 3)


def test_elementwise_bytes_are_read_plus_written_and_views_move_nothing():
    add = lazy(ops.add, (4, 5), (4, 5))
    assert op_work(add) == ("elementwise", 0, 3 * 4 * 5 * 4)
    cast = lazy(lambda a: ops.cast(a, "bfloat16"), (4, 5))
    assert op_work(cast) == ("cast", 0, 4 * 5 * (4 + 2))  # dtype sizes via autograd.itemsize
    assert op_work(lazy(lambda a: ops.reshape(a, (20,)), (4, 5))) == ("view", 0, 0)


class Unlisted(TensorOp):
    """An op the cost model has never heard of."""

    elementwise = True

    def compute(self, a):
        return a


def test_an_unknown_op_is_elementwise_by_its_bytes_and_a_leaf_has_no_work():
    node = lazy(lambda a: Unlisted()(a), (3, 4))
    assert op_work(node) == ("elementwise", 0, 2 * 3 * 4 * 4)
    with pytest.raises(ValueError, match="leaf"):
        op_work(ndl.Tensor([1.0]))


# ----- the calibration and its cache ------------------------------------------------------------------------------
@pytest.mark.parametrize("device", device_params("cpu", "cpu_numpy"))
def test_a_quick_measurement_gives_positive_finite_rates_and_leaves_the_global_rng_alone(device):
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    calibration = Calibration.measure(device, quick=True)
    assert set(calibration.rates) == set(KINDS) - {"view"}
    figures = list(calibration.rates.values()) + list(calibration.host_bandwidth.values())
    assert all(math.isfinite(r) and r > 0 for r in figures)
    assert math.isfinite(calibration.overhead_seconds) and calibration.overhead_seconds > 0
    assert calibration.machine == cost_model.machine_key(device, quick=True)
    assert (np.random.get_state()[1] == before).all()
    assert 0.0 <= calibration.copy_overlap <= 1.0
    if not device_copies_overlap(device):
        assert calibration.copy_overlap == 0.0  # synchronous copies hide under nothing


class CopyStreamModule:
    """A backend module with asynchronous host copies."""

    def copy_from_host_async(self, *args):
        pass


class FakeDevice:
    """A device with a copy stream, as far as the cost model looks."""

    name = "fake"
    mod = CopyStreamModule()


def fail_if_measured(*args, **kwargs):
    raise AssertionError("measured again: the cached calibration should have been read")


def test_the_calibration_is_cached_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path))
    first = Calibration.load_or_measure(ndl.cpu(), quick=True)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == first.to_dict()
    monkeypatch.setattr(Calibration, "measure", classmethod(fail_if_measured))
    assert Calibration.load_or_measure(ndl.cpu(), quick=True) == first
    assert list(tmp_path.glob("*")) == files  # nothing rewritten, no temporary left


def test_another_machine_key_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path))
    measured = []

    def count(cls, device=None, quick=False, repeats=3):
        measured.append(cost_model.machine_key(device, quick))
        return Calibration(Calibration.nominal().rates, 1e-5, {"to_host": 1e9, "to_device": 1e9}, measured[-1])

    monkeypatch.setattr(Calibration, "measure", classmethod(count))
    Calibration.load_or_measure(ndl.cpu(), quick=True)
    Calibration.load_or_measure(ndl.cpu(), quick=True)
    assert len(measured) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "97")  # another thread count: another machine as far as rates go
    Calibration.load_or_measure(ndl.cpu(), quick=True)
    Calibration.load_or_measure(FakeDevice(), quick=True)  # another device
    assert len(measured) == 3 and measured[1]["omp_threads"] == "97" and measured[2]["device"] == "fake"
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_an_unreadable_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path))
    first = Calibration.load_or_measure(ndl.cpu(), quick=True)
    (path,) = tmp_path.glob("*.json")
    path.write_text('{"rates": {"matmul": -1}')
    second = Calibration.load_or_measure(ndl.cpu(), quick=True)
    assert json.loads(path.read_text()) == second.to_dict() and second.machine == first.machine


def test_the_cache_folder_follows_xdg_unless_needle_cache_dir_says(tmp_path, monkeypatch):
    monkeypatch.delenv("NEEDLE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cost_model.cache_dir() == tmp_path / "xdg" / "needle"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cost_model.cache_dir() == tmp_path / "home" / ".cache" / "needle"
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path / "mine"))
    assert cost_model.cache_dir() == tmp_path / "mine"


def test_a_calibration_without_every_rate_or_with_a_bad_one_is_refused():
    nominal = Calibration.nominal()
    rates = dict(nominal.rates)
    del rates["conv"]
    with pytest.raises(ValueError, match="conv"):
        Calibration(rates, 1e-5, nominal.host_bandwidth)
    with pytest.raises(ValueError, match="to_device"):
        Calibration(nominal.rates, 1e-5, {"to_host": 1e9})
    with pytest.raises(ValueError, match="matmul"):
        Calibration({**nominal.rates, "matmul": float("nan")}, 1e-5, nominal.host_bandwidth)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="copy_overlap"):
            dataclasses.replace(nominal, copy_overlap=bad)


# ----- the seconds ------------------------------------------------------------------------------------------------
def test_compute_seconds_are_overhead_plus_work_over_the_kinds_rate():
    calibration = Calibration.nominal()
    model = CostModel(calibration=calibration)
    mm = lazy(ops.matmul, (8, 16), (16, 4))
    add = lazy(ops.add, (8, 16), (8, 16))
    view = lazy(lambda a: ops.reshape(a, (128,)), (8, 16))
    o = calibration.overhead_seconds
    assert model.compute_seconds(mm) == pytest.approx(o + 2 * 8 * 16 * 4 / calibration.rates["matmul"])
    assert model.compute_seconds(add) == pytest.approx(o + 3 * 8 * 16 * 4 / calibration.rates["elementwise"])
    assert model.compute_seconds(view) == o
    assert model.compute_seconds(mm.inputs[0]) == 0.0  # a leaf is never computed
    path = [mm, add, view]
    assert model.recompute_seconds(path) == pytest.approx(sum(model.compute_seconds(n) for n in path))


def test_a_given_host_bandwidth_overrides_the_measured_one_both_ways():
    calibration = Calibration(Calibration.nominal().rates, 1e-5, {"to_host": 2e9, "to_device": 4e9})
    measured, pcie4 = CostModel(calibration=calibration), CostModel(calibration=calibration, host_bandwidth=16e9)
    assert measured.copy_seconds(8e9, "to_host") == 4.0 and measured.copy_seconds(8e9, "to_device") == 2.0
    assert measured.copy_seconds(8e9) == 4.0  # to_host unless told
    assert pcie4.copy_seconds(8e9, "to_host") == pcie4.copy_seconds(8e9, "to_device") == 0.5
    for bad in (0, -1.0, float("inf"), float("nan"), "16e9"):
        with pytest.raises(ValueError, match="host_bandwidth"):
            CostModel(calibration=calibration, host_bandwidth=bad)
    with pytest.raises(ValueError, match="direction"):
        measured.copy_seconds(1, "sideways")


def test_hidden_seconds_is_the_smaller_of_copy_and_compute():
    model = CostModel(calibration=Calibration.nominal())
    assert model.hidden_seconds(2.0, 3.0) == 2.0  # the whole copy hides
    assert model.hidden_seconds(3.0, 1.0) == 1.0  # 2 s of it are exposed
    assert model.hidden_seconds(3.0, 0.0) == 0.0  # nothing to hide under
    with pytest.raises(ValueError, match="hidden_seconds"):
        model.hidden_seconds(-1.0, 1.0)


def test_only_the_measured_share_of_a_copy_hides_unless_a_link_is_given():
    calibration = dataclasses.replace(Calibration.nominal(), copy_overlap=0.25)  # a copy thread on 2 cores
    measured, pcie4 = CostModel(calibration=calibration), CostModel(calibration=calibration, host_bandwidth=16e9)
    assert measured.copy_overlap == 0.25 and measured.hidden_seconds(2.0, 3.0) == 0.5
    assert measured.hidden_seconds(3.0, 1.0) == 0.25  # a share of the smaller of the two
    assert pcie4.copy_overlap == 1.0 and pcie4.hidden_seconds(2.0, 3.0) == 2.0  # planned as a GPU's copy engine
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))).copy_overlap == 0.25


def test_copies_overlap_compute_on_a_copy_stream_or_the_cpu_copy_thread_only():
    assert device_copies_overlap(FakeDevice())  # a copy stream
    assert device_copies_overlap(ndl.cpu()) == ndl.cpu().enabled()  # the C++ backend's copy thread
    assert not device_copies_overlap(ndl.cpu_numpy())  # the reference: synchronous copies


def test_the_cost_model_measures_only_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path))
    # the calibrated CostModel's own default (conftest prices every other test at the nominal rates)
    monkeypatch.setattr(CostModel, "default_rates", staticmethod(lambda device: Calibration.load_or_measure(device)))
    quick = Calibration.measure(ndl.cpu(), quick=True)  # stands in for the full one (seconds), under its key

    def measure(cls, device=None, quick_=False, repeats=3):
        return dataclasses.replace(quick, machine=cost_model.machine_key(device, quick_))
    monkeypatch.setattr(Calibration, "measure", classmethod(measure))
    cached = Calibration.load_or_measure(ndl.cpu())  # measured once, and cached
    monkeypatch.setattr(Calibration, "measure", classmethod(fail_if_measured))
    assert CostModel(ndl.cpu()).calibration == cached
