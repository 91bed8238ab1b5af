"""§4 of lab8.ipynb: MoEfication on the tiny models. Balanced clustering recovers planted neuron groups and
beats a random partition; the router is the closed-form ridge solution (torch.linalg.lstsq on the augmented
system); a random transformers Llama MoEfied with k = E gives transformers' logits, and with k < E the
fitted router stays closer to the dense model than a random one."""

import pytest
import torch

from labkit.testing import FP32_MARGIN, labkit_from_hf, random_llama, random_tokens

MODULE = "stage07_tensor_parallel.moe.moefy"
SEED = 58


def _planted(seed: int, neurons: int, experts: int, dim: int):
    """Rows in `experts` equal groups around random directions, shuffled and rescaled -> (w, group of each row)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(experts, dim, generator=g)
    group = torch.randperm(neurons, generator=g) % experts
    w = centers[group] + 0.05 * torch.randn(neurons, dim, generator=g)
    return w * torch.exp(torch.randn(neurons, 1, generator=g)), group  # scales from ~0.1 to ~10


def _spread(w: torch.Tensor, labels: torch.Tensor) -> float:
    """Sum of squared distances of the normalised rows to their cluster's mean."""
    v = torch.nn.functional.normalize(w, dim=1)
    return sum(float(((v[labels == e] - v[labels == e].mean(0)) ** 2).sum()) for e in labels.unique())


@pytest.mark.parametrize("neurons,experts,dim", [(48, 4, 16), (60, 6, 20), (64, 8, 12)])
def test_balanced_clusters_recover_planted_groups(impl, neurons, experts, dim):
    mod = impl(MODULE)
    w, group = _planted(SEED + experts, neurons, experts, dim)
    labels = mod.balanced_clusters(w, experts, seed=SEED)
    sizes = torch.bincount(labels, minlength=experts).tolist()
    assert sizes == [neurons // experts] * experts, f"expert sizes {sizes}, expected {neurons // experts} each"
    pairs = {(int(a), int(b)) for a, b in zip(labels, group, strict=True)}
    assert len(pairs) == experts, (
        f"{neurons} neurons in {experts} planted groups of directions (rows rescaled by up to ~10x; seed="
        f"{SEED + experts}): the clusters mix groups ({len(pairs)} label/group pairs, expected {experts}). "
        "Rows normalised? Centroids moved to their neurons' mean?"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_clusters_place_the_closest_rows_first(impl, seed):
    """6 rows at 0°, 2 at 20°, 4 at 90° (shuffled), experts of 6: the 0° expert keeps its 6 closest rows,
    so the two 20° rows, not two of the 0° ones, go to the 90° expert."""
    mod = impl(MODULE)
    angles = torch.tensor([0.0] * 6 + [20.0] * 2 + [90.0] * 4).deg2rad()
    g = torch.Generator().manual_seed(seed)
    rows = torch.cat([angles.cos()[:, None], angles.sin()[:, None], 0.02 * torch.randn(12, 4, generator=g)], 1)
    perm = torch.randperm(12, generator=g)
    labels = torch.empty(12, dtype=torch.long)
    labels[perm] = mod.balanced_clusters(rows[perm], 2, seed=seed)  # back in the order above
    assert len(set(labels[:6].tolist())) == 1 and set(labels[6:].tolist()) == {1 - int(labels[0])}, (
        f"seed={seed}: experts by row (0° x6, 20° x2, 90° x4) {labels.tolist()}: a full expert must accept "
        "its closest proposers, not the first ones"
    )


@pytest.mark.parametrize("neurons,experts", [(96, 4), (120, 8)])
def test_balanced_clusters_beat_a_random_partition(impl, neurons, experts):
    mod = impl(MODULE)
    w = torch.randn(neurons, 24, generator=torch.Generator().manual_seed(SEED))
    labels = mod.balanced_clusters(w, experts, seed=SEED)
    assert torch.bincount(labels, minlength=experts).tolist() == [neurons // experts] * experts
    random_labels = torch.randperm(neurons, generator=torch.Generator().manual_seed(SEED)) % experts
    got, chance = _spread(w, labels), _spread(w, random_labels)
    assert got < 0.97 * chance, (
        f"balanced k-means leaves a spread of {got:.2f} on {neurons} random rows, a random balanced partition "
        f"{chance:.2f} (seed={SEED}): the iterations do not tighten the clusters"
    )


@pytest.mark.parametrize("n,dim,experts,ridge", [(200, 16, 4, 1e-2), (90, 24, 8, 0.5), (300, 8, 6, 1e-4)])
def test_fit_router_is_the_ridge_solution(impl, n, dim, experts, ridge):
    mod = impl(MODULE)
    g = torch.Generator().manual_seed(SEED + n)
    x = torch.randn(n, dim, generator=g) * 3 + 1
    target = (x @ torch.randn(dim, experts, generator=g)).abs() + torch.rand(n, experts, generator=g)
    a = torch.cat([x.double(), (ridge * n) ** 0.5 * torch.eye(dim, dtype=torch.float64)])
    b = torch.cat([target.double(), torch.zeros(dim, experts, dtype=torch.float64)])
    want = torch.linalg.lstsq(a, b).solution.T.float()  # (E, D)
    got = mod.fit_router(x, target, ridge)
    assert got.shape == (experts, dim), f"router {tuple(got.shape)}, expected (E, D) = {(experts, dim)}"
    torch.testing.assert_close(
        got, want, atol=1e-5, rtol=1e-4,
        msg=lambda m: f"n={n} ridge={ridge} (seed={SEED + n}): not the ridge solution (penalty ridge·N·||W||²): {m}",
    )  # fmt: skip


def _moefied(impl, seed: int, experts: int, k: int):
    mod = impl(MODULE)
    hf = random_llama(seed, intermediate_size=96, num_hidden_layers=3)
    calibration = random_tokens(seed, 64, hf.config.vocab_size, batch=4)
    return mod, hf, mod.moefy(labkit_from_hf(hf), experts, calibration, k=k, seed=seed)


@pytest.mark.parametrize("experts", [4, 8])
def test_moefied_llama_with_every_expert_equals_hf(impl, experts):
    mod, hf, model = _moefied(impl, SEED, experts, experts)
    ids = random_tokens(SEED + 1, 19, hf.config.vocab_size, batch=2)
    with torch.no_grad():
        got, want = model(ids), hf(ids).logits
    delta = float((got - want).abs().max())
    assert delta <= FP32_MARGIN, (
        f"MoEfied with k = E = {experts}: logits differ from transformers' dense Llama by {delta:.2e} (seed={SEED}); "
        "every neuron must sit in exactly one expert (a partition), so the experts' sum is the dense MLP"
    )


@pytest.mark.in_process("the test replaces the MoEfied model's routers in place, then runs it")
def test_fitted_router_beats_a_random_router(impl):
    mod, hf, model = _moefied(impl, SEED, 8, 3)
    ids = random_tokens(SEED + 2, 33, hf.config.vocab_size, batch=2)
    with torch.no_grad():
        want = hf(ids).logits
        fitted = float((model(ids) - want).pow(2).mean())
        g = torch.Generator().manual_seed(SEED)
        for layer in model.model.layers:
            layer.mlp.router.copy_(torch.randn(layer.mlp.router.shape, generator=g))
        random = float((model(ids) - want).pow(2).mean())
    assert fitted < 0.8 * random, (
        f"k = 3 of 8: the fitted routers' logits are {fitted:.3e} from the dense model's (mean square), random "
        f"routers' {random:.3e} (seed={SEED}): the router does not predict which experts contribute"
    )
