"""Random-init targets and EAGLE heads for the stage-06 part-2 EAGLE tests."""

import torch

from labkit import eagle
from labkit.testing import LLAMA_CONFIGS, labkit_from_hf, random_llama

NO_EOS = 10**6


def make_target(config: str, seed: int, **overrides):
    """(hf_target, target): a random Llama in HF and in labkit, EOS out of reach."""
    hf = random_llama(seed, **{**LLAMA_CONFIGS[config], "eos_token_id": NO_EOS, **overrides})
    return hf, labkit_from_hf(hf)


def random_head(target, seed: int, vocab: torch.Tensor | None = None) -> eagle.EagleHead:
    """A head with random weights everywhere (attach leaves the layer's output projections at zero, which
    would hide the attention), large enough that its guesses depend on the features and context it reads."""
    vocab = torch.arange(target.config.vocab_size) if vocab is None else vocab
    head = eagle.attach(target, vocab, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.3, generator=gen)
        head.fc.weight[:, target.config.hidden_size :] *= 10  # embeddings are ~0.1, features ~1: weigh both alike
        for name, p in head.layer.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05, generator=gen)
    return head.eval()


def copying_head(target) -> eagle.EagleHead:
    """On a one-layer target: fc passes the token embedding through and the layer is the target's, so the
    draft is the target minus its first position's context: right most of the time."""
    head = eagle.attach(target, torch.arange(target.config.vocab_size))
    H = target.config.hidden_size
    head.layer.load_state_dict(target.model.layers[0].state_dict())
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1))
    return head.eval()


def true_features(target, ids: list[int]) -> torch.Tensor:
    """The target's final normed hidden states (T, H) over ids, one uncached forward."""
    seen = []
    hook = target.model.norm.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    with torch.no_grad():
        target(torch.tensor([ids]))
    hook.remove()
    return seen[0]
