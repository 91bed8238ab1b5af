"""What the distributed pipeline tests share: the costs a partition is balanced by, and a counter of the
point-to-point traffic a rank makes (torch.distributed's own functions, wrapped inside the worker)."""

import torch.distributed as dist

from labkit.model import Config

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "all_to_all")


def weight_costs(config: Config) -> list[float]:
    """A cost per unit proportional to its weights read per token: the embedding reads one row, a layer its
    matrices, the head the whole vocabulary. Deterministic, so every rank computes the same partition."""
    c = config
    layer = c.hidden_size * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    layer += 3 * c.hidden_size * c.intermediate_size
    return [c.hidden_size, *[layer] * c.num_hidden_layers, c.vocab_size * c.hidden_size]


class Traffic:
    """Counts point-to-point calls and the bytes they carry, and every collective called (barrier aside)."""

    def __init__(self):
        self.reset()
        for name in P2P + COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in P2P:
                tensor = args[0] if args else kwargs["tensor"]
                self.bytes[name] = self.bytes.get(name, 0) + tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    def reset(self):
        self.calls, self.bytes = {}, {}

    def collectives(self) -> dict:
        return {k: v for k, v in self.calls.items() if k in COLLECTIVES}
