"""Rules on layouts beyond one mesh dimension, on four gloo processes on the CPU.

One launch runs three layouts of the same small model, each against that model in one
process on the joined batch of 8 examples:

* ``fsdp_tp``: FSDP2 (dp=2) x tensor parallelism (tp=2): every Linear colwise or rowwise,
  then ``fully_shard`` on the dp mesh; each dp group backpropagates its half of the batch.
* ``mixed``: the same with the head left outside tensor parallelism: its parameters live
  on the 1-D dp mesh, the others on the 2-D one (torch's own ``clip_grad_norm_`` raises).
* ``hsdp``: hybrid sharding (replicate 2 x shard 2), each rank a quarter of the batch.

The head (3 output rows) is cut unevenly: some ranks hold an empty piece of it.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers import free_port, spawn_ranks
from torch import nn

from gradmod.hooks import attach

pytestmark = pytest.mark.slow

MAX_NORM = 0.05  # below the gradient's norm: the clip bites
BOUND = 0.02
LAYOUTS = ("fsdp_tp", "mixed", "hsdp")
PARTS = {"fsdp_tp": 2, "mixed": 2, "hsdp": 4}  # data-parallel degree: how the batch is split


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def loss_of(net: nn.Module, part: int, parts: int, scale: float = 1.0) -> torch.Tensor:
    x, y = batch()
    rows = slice(part * 8 // parts, (part + 1) * 8 // parts)
    return scale * ((net(x[rows]) - y[rows]) ** 2).mean()


RULES = {
    "norm": {"norm": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": MAX_NORM}]}},
    "norm_inf": {
        "n": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.02, "norm_type": "inf"}]}
    },
    "log": {
        "watch": {
            "params": "*",
            "stage": "fused",
            "transforms": ["log", {"name": "clamp", "min": -BOUND, "max": BOUND}, "log"],
        }
    },
    "agc": {"agc": {"params": "*", "transforms": [{"name": "agc", "clip_factor": 0.05}]}},
    "centralize": {"c": {"params": "*", "stage": "fused", "transforms": ["centralize"]}},
    "norm_clip": {"t": {"params": "*", "stage": "fused", "transforms": [{"name": "norm_clip", "max_norm": 0.3}]}},
    "hook_clamp": {"out": {"modules": "1", "transforms": [{"name": "clamp", "min": -BOUND, "max": BOUND}]}},
}
ZCLIP = {"z": {"params": "*", "transforms": [{"name": "zclip", "warmup_steps": 2, "z_threshold": 0.1}]}}
REFUSED = {
    "hook_param": {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -BOUND, "max": BOUND}]}},
    "per_sample": {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}},
    "per_loss": {"mtl": {"params": "*", "transforms": ["pcgrad"]}},
}


@functools.cache
def _mesh(name: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard") if name == "hsdp" else ("dp", "tp"))


def _layout(name: str):
    """(sharded model, this rank's dp part, the mesh)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    net = model()
    if name == "hsdp":
        mesh = _mesh(name)
        for layer in net[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, torch.distributed.get_rank(), mesh
    mesh = _mesh(name)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    if name == "fsdp_tp":
        plan["4"] = ColwiseParallel(output_layouts=Replicate())  # 3 rows over 2 ranks: uneven
    parallelize_module(net, mesh["tp"], plan)
    for layer in net[::2]:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net, mesh.get_coordinate()[0], mesh


def _full(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in net.named_parameters()}


def _case(name: str, rules: dict) -> dict:
    net, part, _ = _layout(name)
    hooks = attach(net, rules)
    loss_of(net, part, PARTS[name]).backward()
    hooks.after_backward()
    return {"grads": _full(net), "stats": hooks.read_stats()}


def _zclip(name: str) -> dict[str, torch.Tensor]:
    net, part, _ = _layout(name)
    hooks = attach(net, ZCLIP)
    for scale in (1.0, 1.5, 4.0):  # the third is a spike
        net.zero_grad()
        loss_of(net, part, PARTS[name], scale).backward()
        hooks.after_backward()
    return _full(net)


def _noise(name: str) -> dict:
    """Each rank's drawn noise per parameter, twice from the same seed, with its coordinates."""
    draws = []
    for _ in range(2):
        net, part, mesh = _layout(name)
        hooks = attach(net, {"n": {"params": "*", "stage": "fused", "transforms": [{"name": "noise", "std": 1.0}]}})
        loss_of(net, part, PARTS[name]).backward()
        before = {n: p.grad.to_local().clone() for n, p in net.named_parameters()}
        torch.manual_seed(5)
        hooks.after_backward()
        draws.append({n: p.grad.to_local() - before[n] for n, p in net.named_parameters()})
    kinds = {n: [pl.is_replicate() for pl in p.placements] for n, p in net.named_parameters()}
    return {
        "draws": draws,
        "meshes": {n: p.device_mesh.get_coordinate() for n, p in net.named_parameters()},
        "replicated": kinds,
    }


def _nonfinite(name: str) -> list[float]:
    """Every rank fills its pieces of two gradients with nan; the counts summed over the ranks."""
    from gradmod.training.nonfinite import count_nonfinite

    net, part, _ = _layout(name)
    loss_of(net, part, PARTS[name]).backward()
    for p in (net[2].weight, net[2].bias):  # a bias replicated over tp (fsdp_tp), HSDP's replicas
        p.grad.to_local().fill_(float("nan"))
    counts = torch.stack(count_nonfinite([p.grad for p in net.parameters()]))
    torch.distributed.all_reduce(counts)
    return counts.tolist()


def gpt() -> nn.Module:
    from gradmod.models import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(num_classes=11, width=16, depth=1, heads=4, max_len=8)


def gpt_loss(net: nn.Module, rows: slice) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 11, (8, 6), generator=g)
    return torch.nn.functional.cross_entropy(net(x[rows]), y[rows])


def _tiny_gpt(rank: int) -> dict:
    """The trainer's own layout code (``Dist.wrap``) on tiny_gpt: replicate 2 x shard 1 x tp 2,
    its embeddings, norms and head outside tensor parallelism."""
    from gradmod.training.distributed.strategy import Dist

    dist = Dist("fsdp", rank, 4, rank, torch.device("cpu"), tp=2, replicate=2)
    net = dist.wrap(gpt())
    hooks = attach(net, RULES["norm"])
    gpt_loss(net, slice(4 * dist.data_rank, 4 * dist.data_rank + 4)).backward()
    hooks.after_backward()
    meshes = {n: p.device_mesh.ndim for n, p in net.named_parameters()}
    return {"grads": _full(net), "stats": hooks.read_stats(), "meshes": meshes}


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _torch_clip_error(name: str) -> str | None:
    net, part, _ = _layout(name)
    loss_of(net, part, PARTS[name]).backward()
    try:
        torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
    except Exception as e:  # torch's own error, whatever its type
        return str(e)
    return None


def _attach_before_tp() -> str | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    net = model()
    attach(net, RULES["norm"])
    parallelize_module(net, init_device_mesh("cpu", (4,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return _error(lambda: loss_of(net, 0, 1).backward())


def _pipeline_stage(rank: int) -> str | None:
    from torch.distributed.pipelining import PipelineStage

    net = model()
    stage = PipelineStage(net, stage_index=rank, num_stages=4, device=torch.device("cpu"))
    refused = _error(lambda: attach(net, RULES["norm"]))
    del stage
    return refused


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    try:
        results: dict = {}
        for name in LAYOUTS:
            got = {case: _case(name, rules) for case, rules in RULES.items()}
            got["zclip"] = _zclip(name)
            got["noise"] = _noise(name)
            net = _layout(name)[0]
            got["refused"] = {case: _error(lambda r=r, n=net: attach(n, r)) for case, r in REFUSED.items()}
            got["torch_clip"] = _torch_clip_error(name)
            got["nonfinite"] = _nonfinite(name)
            results[name] = got
        results["attach_before_tp"] = _attach_before_tp()
        results["pipeline"] = _pipeline_stage(rank)
        results["tiny_gpt"] = _tiny_gpt(rank)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    spawn_ranks(_worker, 4, free_port(), str(out), nprocs=4)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def reference(rules: dict | None = None, parts: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model in one process: the mean of ``parts`` backward passes of equal parts of the
    batch (``rules`` attached: their hook stage acts on each part), raw gradients returned."""
    net = model()
    hooks = attach(net, rules) if rules else None
    for part in range(parts):  # each rank's own loss: its hooks see that gradient, unscaled
        loss_of(net, part, parts).backward()
    if hooks is not None:
        hooks.remove()
    for p in net.parameters():
        p.grad /= parts  # FSDP2's average over the data-parallel ranks
    return net, {n: p.grad.clone() for n, p in net.named_parameters()}


def close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item() + 1e-12, msg=name)


def each(ranks):
    for layout in LAYOUTS:
        for rank in ranks:
            yield layout, rank[layout]


def test_the_head_is_cut_unevenly_and_one_layout_mixes_meshes(ranks):
    assert model()[4].weight.shape[0] == 3  # 3 rows over 2 ranks, then over 2 again
    assert ranks[0]["fsdp_tp"]["torch_clip"] is None and ranks[0]["hsdp"]["torch_clip"] is None
    assert "same mesh" in ranks[0]["mixed"]["torch_clip"]  # torch's clip_grad_norm_ raises here


def test_global_norm_clip_equals_clip_grad_norm_on_the_full_model(ranks):
    net, _ = reference()
    total = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM).item()
    assert total > 2 * MAX_NORM
    for layout, got in each(ranks):
        record = got["norm"]["stats"]["norm/global_norm_clip"]
        assert abs(record["norm"] - total) <= 1e-6 * total, layout
        for name, p in net.named_parameters():
            close(got["norm"]["grads"][name], p.grad, f"{layout} {name}")


def test_global_norm_clip_inf_norm_is_the_largest_entry_over_every_shard(ranks):
    net, _ = reference()
    total = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.02, norm_type="inf").item()
    for layout, got in each(ranks):
        assert got["norm_inf"]["stats"]["n/global_norm_clip"]["norm"] == pytest.approx(total, rel=1e-6), layout
        for name, p in net.named_parameters():
            close(got["norm_inf"]["grads"][name], p.grad, f"{layout} {name}")


def test_log_statistics_are_the_full_tensors_counted_once_per_shard(ranks):
    _, raw = reference()
    for layout, got in each(ranks):
        stats = got["log"]["stats"]
        for name, g in raw.items():
            pre, post = stats[f"{name}/pre"], stats[f"{name}/post"]
            assert pre["norm"] == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-5), (layout, name)
            assert (pre["min"], pre["max"]) == pytest.approx((g.min().item(), g.max().item()), rel=1e-5)
            assert pre["mean"] == pytest.approx(g.mean().item(), abs=1e-6 * g.abs().max().item())
            assert pre["frac_negative"] == pytest.approx((g < 0).float().mean().item())
            assert post["frac_clipped"] == pytest.approx((g.abs() > BOUND).float().mean().item())
            close(got["log"]["grads"][name], g.clamp(-BOUND, BOUND), f"{layout} {name}")
    for layout in LAYOUTS:
        assert all(r[layout]["log"]["stats"] == ranks[0][layout]["log"]["stats"] for r in ranks)


def test_agc_rows_split_by_tensor_parallelism_are_whole(ranks):
    net, raw = reference()
    clipped = 0
    for p in net.parameters():  # by hand: each output unit's norm capped at 0.05 x its weights'
        dims = tuple(range(1, p.dim())) if p.dim() > 1 else None
        w = torch.linalg.vector_norm(p.detach(), dim=dims, keepdim=p.dim() > 1).clamp_min(1e-3)
        g = torch.linalg.vector_norm(p.grad, dim=dims, keepdim=p.dim() > 1)
        coef = (0.05 * w / g.clamp_min(1e-6)).clamp_max(1.0)
        clipped += int((coef < 1).sum())
        p.grad.mul_(coef)
    assert clipped > 0
    for layout, got in each(ranks):
        for name, p in net.named_parameters():
            close(got["agc"]["grads"][name], p.grad, f"{layout} {name}")


def test_centralize_subtracts_whole_rows_means(ranks):
    _, raw = reference()
    for layout, got in each(ranks):
        for name, g in raw.items():
            want = g - g.mean(1, keepdim=True) if g.dim() > 1 else g
            torch.testing.assert_close(
                got["centralize"]["grads"][name], want, rtol=1e-5, atol=1e-7, msg=f"{layout} {name}"
            )


def test_norm_clip_scales_each_whole_tensor(ranks):
    _, raw = reference()
    scaled = 0
    for name, g in raw.items():
        coef = min(1.0, 0.3 / (torch.linalg.vector_norm(g).item() + 1e-6))
        scaled += coef < 1
        for layout, got in each(ranks):
            close(got["norm_clip"]["grads"][name], g * coef, f"{layout} {name}")
    assert 0 < scaled < len(raw)


def test_zclip_clips_the_same_spike(ranks):
    net = model()
    hooks = attach(net, ZCLIP)
    for scale in (1.0, 1.5, 4.0):
        net.zero_grad()
        loss_of(net, 0, 1, scale).backward()
        hooks.after_backward()
    _, raw = reference()
    assert not torch.allclose(net[0].weight.grad, 4.0 * raw["0.weight"])  # the spike was clipped
    for layout, got in each(ranks):
        for name, p in net.named_parameters():
            torch.testing.assert_close(got["zclip"][name], p.grad, rtol=1e-5, atol=1e-7, msg=f"{layout} {name}")


def test_hook_stage_clamp_of_a_layer_output_acts_on_each_ranks_part(ranks):
    for layout in LAYOUTS:
        _, want = reference(RULES["hook_clamp"], parts=PARTS[layout])
        _, unclamped = reference(parts=PARTS[layout])
        assert not torch.allclose(want["0.weight"], unclamped["0.weight"])  # the clamp bites
        for rank in ranks:
            for name, g in want.items():
                got = rank[layout]["hook_clamp"]["grads"][name]
                torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-7, msg=f"{layout} {name}")


def test_noise_differs_per_piece_agrees_per_replica_and_repeats(ranks):
    for layout in LAYOUTS:
        for name in ranks[0][layout]["noise"]["draws"][0]:
            seen = []
            for rank in ranks:
                noise = rank[layout]["noise"]
                first, second = noise["draws"][0][name], noise["draws"][1][name]
                assert torch.equal(first, second)  # the same seed: the same draw
                cut = [c for c, rep in zip(noise["meshes"][name], noise["replicated"][name]) if not rep]
                seen.append((cut, first))
            for cut_a, a in seen:
                for cut_b, b in seen:
                    if a.numel() and b.numel() and a.shape == b.shape:
                        assert torch.equal(a, b) == (cut_a == cut_b), (layout, name)


def test_nonfinite_entries_are_counted_once_per_piece_not_per_replica(ranks):
    sizes = [p.numel() for p in model().parameters()]
    for layout, got in each(ranks):
        want = [float(n) if i in (2, 3) else 0.0 for i, n in enumerate(sizes)]
        assert got["nonfinite"] == want, layout


def test_what_cannot_run_is_refused_in_one_line(ranks):
    for layout, got in each(ranks):
        refused = got["refused"]
        assert all(m is not None and "\n" not in m for m in refused.values()), (layout, refused)
        assert "stage 'hook'" in refused["hook_param"] and "modules:" in refused["hook_param"]
        assert "stage 'per_sample'" in refused["per_sample"]
        assert "per_loss" in refused["per_loss"]


def test_tiny_gpt_under_the_trainers_hsdp_x_tp_layout_clips_like_one_process(ranks):
    net = gpt()
    gpt_loss(net, slice(0, 8)).backward()
    total = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM).item()
    assert total > 2 * MAX_NORM
    for rank in ranks:
        got = rank["tiny_gpt"]
        assert got["meshes"]["blocks.0.attn.q.weight"] == 3 and got["meshes"]["head.weight"] == 2  # two meshes
        assert abs(got["stats"]["norm/global_norm_clip"]["norm"] - total) <= 1e-6 * total
        for name, p in net.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-6 * MAX_NORM, msg=name)


def test_a_pipeline_stage_is_refused(ranks):
    for rank in ranks:
        assert "pipeline" in rank["pipeline"] and "\n" not in rank["pipeline"]


def test_rules_attached_before_parallelize_module_fail_at_backward(ranks):
    for rank in ranks:
        assert "parallelize_module" in rank["attach_before_tp"] and "\n" not in rank["attach_before_tp"]
