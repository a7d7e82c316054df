"""The MoE layer: routing, the auxiliary losses, capacity, and expert parallel against the local
layer."""

import copy
import math

import pytest
import torch
from helpers import spawn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer import build_model
from trainer.models.moe import MoE, _expert_swiglu_loop, expert_swiglu, update_expert_biases
from trainer.models.routing import Routing, choose_experts
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import parallelize_moe


def skewed_layer(**kwargs) -> tuple[MoE, torch.Tensor]:
    """Four tokens whose router logits are all [3, 2, 0, 0]: every token picks experts 0 and 1."""
    layer = MoE(dim=4, ffn_dim=8, n_experts=4, top_k=2, **kwargs)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.tensor([3.0, 2.0, 0.0, 0.0])
    x = torch.zeros(1, 4, 4)
    x[..., 0] = 1.0
    return layer, x


def test_load_balancing_loss_equals_the_hand_computed_value():
    layer, x = skewed_layer(aux_loss_coef=0.1)
    layer.aux_loss_scale = 0.5  # as with two microbatches per step
    layer(x).backward(torch.zeros(1, 4, 4))
    e2, e3 = math.exp(2), math.exp(3)
    # n_experts * sum_e (share of slots to e) * (mean router probability of e); shares 1, 1, 0, 0.
    expected = 4 * (e3 + e2) / (e3 + e2 + 2)
    ((routed, balance, dropped),) = layer.routing_records
    assert balance.item() == pytest.approx(expected, rel=1e-6)
    assert routed.tolist() == [4, 4, 0, 0] and dropped.item() == 0
    # The router's gradient is that of coefficient *
    # scale * the loss (the output's gradient is zero).
    weight = layer.router.weight.detach().clone().requires_grad_()
    probs = (x.view(4, 4) @ weight.T).softmax(-1).mean(0)
    (0.1 * 0.5 * 4 * (torch.tensor([1.0, 1.0, 0.0, 0.0]) * probs).sum()).backward()
    torch.testing.assert_close(layer.router.weight.grad, weight.grad)


def test_capacity_drops_the_overflow_and_counts_it():
    # ceil(1.0 * 4 tokens * 2 / 4 experts) = 2 slots each
    layer, x = skewed_layer(capacity_factor=1.0)
    out = layer(x)
    out.sum().backward()
    ((routed, _, dropped),) = layer.routing_records
    assert routed.tolist() == [4, 4, 0, 0] and dropped.item() == 4
    # Experts 0 and 1 take the first two tokens; the last two go nowhere.
    assert out[0, 2:].abs().max() == 0 and out[0, :2].abs().min() > 0


class HostSyncs(TorchDispatchMode):
    """Counts what makes a GPU wait for the host: reading a value (`item`, `tolist`) and the ops
    whose output size depends on the data (nonzero, boolean masks, bincount, repeat_interleave
    without `output_size`). On the CPU nothing waits, so the calls themselves are counted."""

    SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
               "aten::bincount", "aten::unique_consecutive", "aten::_unique2"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        bool_index = name == "aten::index" and any(i is not None and i.dtype == torch.bool
                                                   for i in args[1])
        sized_later = (name == "aten::repeat_interleave" and kwargs.get("output_size") is None
                       and len(args) < 3)
        if name in self.SYNCING or bool_index or sized_later:
            self.seen.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        original = torch.Tensor.tolist
        self._restore = original

        def tolist(tensor):
            self.seen.append("tolist")
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._restore
        return super().__exit__(*exc)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_an_moe_layer_never_waits_for_the_host(capacity_factor):
    layer, x = skewed_layer(capacity_factor=capacity_factor, aux_loss_coef=0.1, z_loss_coef=0.01)
    x.requires_grad_()
    with HostSyncs() as syncs:
        layer(x).square().sum().backward()
    assert syncs.seen == []
    assert x.grad.abs().max() > 0


def test_top_k_weights_are_a_softmax_over_the_chosen_logits():
    layer, x = skewed_layer()
    out = layer(x)
    chosen = torch.tensor([3.0, 2.0]).softmax(0)
    experts = layer.experts
    h = x.view(4, 4)
    expected = sum(
        w * ((torch.nn.functional.silu(h @ experts.w1[e].T) * (h @ experts.w3[e].T))
             @ experts.w2[e].T)
        for w, e in zip(chosen, (0, 1))
    )
    torch.testing.assert_close(out.view(4, 4), expected)


def test_grouped_matmul_experts_equal_one_matmul_per_expert():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    w1, w3 = torch.randn(2, 4, 12, 8, generator=g).requires_grad_().unbind(0)
    w2 = torch.randn(4, 8, 12, generator=g, requires_grad=True)
    counts = torch.tensor([3, 0, 7, 0])  # experts without tokens too
    grads = []
    for fn in (expert_swiglu, _expert_swiglu_loop):
        out = fn(x, counts, w1, w2, w3)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (x, w1, w2, w3))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # Groups padded to start at multiples of 8 rows (what CUDA's kernel wants) give the same.
    with HostSyncs() as syncs:
        out = expert_swiglu(x, counts, w1, w2, w3, align=8)
        padded = (out, *torch.autograd.grad(out.square().sum(), (x, w1, w2, w3)))
    assert syncs.seen == []
    for a, b in zip(grads[0], padded):  # the kernel blocks a padded group differently: rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3)
    # No tokens at all (an expert-parallel rank nobody routes to).
    out = expert_swiglu(x[:0], torch.zeros(4, dtype=torch.long), w1, w2, w3)
    assert out.shape == (0, 8)
    assert torch.autograd.grad(out.sum(), w2)[0].abs().max() == 0


def test_mixtral_debug_is_a_small_mixtral():
    model = build_model("mixtral_debug")
    assert isinstance(model.layers["0"].feed_forward, MoE)
    assert model(torch.randint(0, 2048, (2, 8))).shape == (2, 8, 2048)


# --- DeepSeek-V3 routing ------------------------------------------------------------------------


def test_sigmoid_scores_renormalised_scaled_within_the_best_groups():
    """Router logits [3, 2, 0, 0] over 4 experts in 2 groups ({0, 1}, {2, 3}); a bias that favours
    experts 2 and 3 for the choice moves their group ahead, but weights come from the scores."""
    routing = Routing(score="sigmoid", scale=2.5, n_groups=2, top_groups=1, bias_update_speed=0.1)
    layer, x = skewed_layer(routing=routing)
    scores, chosen, weights = choose_experts(layer.router(x.view(4, 4)), routing, 2,
                                             layer.expert_bias)
    assert chosen.tolist() == [[0, 1]] * 4
    s = torch.tensor([3.0, 2.0]).sigmoid()
    torch.testing.assert_close(weights, (2.5 * s / s.sum()).expand(4, 2))
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.6, 0.6]))
    scores, chosen, weights = choose_experts(layer.router(x.view(4, 4)), routing, 2,
                                             layer.expert_bias)
    assert chosen.sort(-1).values.tolist() == [[2, 3]] * 4
    # sigmoid(0) each, renormalised
    torch.testing.assert_close(weights, torch.full((4, 2), 2.5 / 2))


def test_shared_experts_run_on_every_token_beside_the_routed_ones():
    layer, x = skewed_layer(n_shared_experts=2)
    plain = MoE(dim=4, ffn_dim=8, n_experts=4, top_k=2)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items()
                           if not k.startswith("shared.")})
    assert layer.shared.w1.weight.shape == (16, 4)  # two experts 8 wide, as one
    torch.testing.assert_close(layer(x), plain(x) + layer.shared(x))


def favoured_expert_run(steps: int, speed: float) -> tuple[torch.Tensor, list[float]]:
    """A layer of 8 experts (top 2, sigmoid) whose router favours expert 0 for every token of the
    data; the biases move after each step. -> (each step's slots per expert over the mean, expert
    0's bias per step)."""
    torch.manual_seed(0)
    layer = MoE(dim=16, ffn_dim=8, n_experts=8, top_k=2,
                routing=Routing(score="sigmoid", bias_update_speed=speed))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
        layer.router.weight[0] = 0.5  # the data below points along the ones vector
    loads, biases = [], []
    for _ in range(steps):
        x = 0.2 + 0.5 * torch.randn(4, 32, 16)
        layer(x).sum().backward()
        load = layer.routing_records[-1][0]
        loads.append(load / load.mean())
        update_expert_biases([layer], microbatches=1, skip=torch.tensor(0.0))
        biases.append(0.0 if layer.expert_bias is None else layer.expert_bias[0].item())
        layer.routing_records.clear()
    return torch.stack(loads), biases


def test_aux_loss_free_bias_evens_out_a_favoured_experts_load():
    loads, biases = favoured_expert_run(steps=60, speed=0.05)
    late = loads[-10:].mean(0)
    print(f"aux-free bias: expert 0's load over the mean {loads[0, 0]:.2f} at step 1, "
          f"{late[0]:.2f} over the last 10 steps; the busiest expert's {loads[0].max():.2f} -> "
          f"{late.max():.2f}; expert 0's bias {biases[-1]:.2f}")
    assert loads[0, 0] > 3.5  # nearly every token takes expert 0 (4.0: every token)
    before = 0.0
    # it falls by the speed after each overloaded step
    for load, bias in zip(loads[:, 0].tolist(), biases):
        if load > 1:
            assert bias == pytest.approx(before - 0.05)
        before = bias
    assert biases[3] == pytest.approx(-0.2)
    assert late[0] < 1.6 and late.max() < 1.6
    # Without the bias the load stays where the router put it.
    fixed, _ = favoured_expert_run(steps=60, speed=0.0)
    assert fixed[-10:].mean(0)[0] > 3.5


def test_a_skipped_step_leaves_the_bias_where_it_was():
    layer, x = skewed_layer(routing=Routing(bias_update_speed=0.1))
    layer(x).sum().backward()
    update_expert_biases([layer], microbatches=1, skip=torch.tensor(1.0))
    assert layer.expert_bias.abs().max() == 0
    update_expert_biases([layer], microbatches=1, skip=torch.tensor(0.0))
    # Experts 0 and 1 took every slot: they fall, 2 and 3 rise.
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))


# --- expert parallel ----------------------------------------------------------------------------


def _ep_matches_local(rank, ep, case):
    torch.manual_seed(0)  # the same weights and inputs on every rank
    # No auxiliary loss: under data parallel it counts the whole batch's routing (see test_parity).
    layer = MoE(dim=16, ffn_dim=24, n_experts=8, top_k=2)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        xs = torch.randn(ep, 2, 5, 16).abs()  # positive, so a negative router row is never chosen
        grads = torch.randn(ep, 2, 5, 16)
        if case == "an_unused_expert":
            layer.router.weight[3] = -1.0
        if case == "a_rank_without_tokens":
            layer.router.weight[8 - 8 // ep:] = -1.0  # the last rank's experts
    reference = copy.deepcopy(layer)
    dims = ParallelDims(dp_replicate=1, dp_shard=ep, cp=1, tp=1, pp=1, ep=ep, world_size=ep,
                        moe=True)
    dims.build_mesh("cpu")
    parallelize_moe(layer, dims)

    x = xs[rank].clone().requires_grad_()
    with HostSyncs() as syncs:
        out = layer(x)
        out.backward(grads[rank])
    # The all-to-all's split sizes, once; nothing else waits for the host.
    assert syncs.seen == ["tolist"], syncs.seen

    # The local layer on each rank's tokens: this rank's output and input gradient, and the expert
    # gradients averaged over the ranks, as data parallel averages every gradient.
    for r in range(ep):
        reference.router.weight.grad = None
        x_ref = xs[r].clone().requires_grad_()
        out_ref = reference(x_ref)
        out_ref.backward(grads[r])
        if r == rank:
            torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.router.weight.grad, reference.router.weight.grad,
                                       rtol=1e-5, atol=1e-5)
    per_rank = 8 // ep
    for name in ("w1", "w2", "w3"):
        mine = getattr(layer.experts, name).grad.to_local()
        full = getattr(reference.experts, name).grad[rank * per_rank:(rank + 1) * per_rank] / ep
        torch.testing.assert_close(mine, full, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{case} d{name}: {m}")
    if case == "a_rank_without_tokens" and rank == ep - 1:
        assert layer.experts.w1.grad.to_local().abs().max() == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("case", ["routed", "an_unused_expert", "a_rank_without_tokens"])
def test_expert_parallel_equals_the_local_layer(ep, case):
    spawn(_ep_matches_local, ep, case)
