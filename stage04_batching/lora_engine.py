"""The engine that serves many LoRA adapters at once (given code; vLLM: LoRA in its engine and scheduler).

    registry = AdapterRegistry(model.config, {"zoe": LORA / "zoe", "turtles": LORA / "turtles"}, max_loras=2)
    engine = LoRAEngine(model, tokenizer, registry)
    engine.generate(prompts, [SamplingParams(lora="zoe"), SamplingParams(), SamplingParams(lora="turtles")])

A request names its adapter in SamplingParams.lora (None: the base model). It waits in `parked` until
the registry can pin its adapter in a slot, then joins the scheduler like any request; its pin is
dropped when it finishes or is aborted. Before each forward pass, every token is mapped to its
request's slot, and the model's linear layers (wrapped by add_lora_layers) add that slot's term.
"""

from collections import deque

import torch

from labkit.model import Llama

from .engine import LLMEngine, RequestOutput
from .lora import AdapterRegistry, LoRAMapping, add_lora_layers
from .sequence import SamplingParams, Sequence


class LoRAEngine(LLMEngine):
    def __init__(self, model: Llama, tokenizer=None, registry: AdapterRegistry | None = None, config=None, **settings):
        """Like LLMEngine; `model`'s linear layers are wrapped in place (unchanged while no adapter runs)."""
        super().__init__(model, tokenizer, config, **settings)
        self.registry = registry or AdapterRegistry(model.config, {})
        self.mapping = LoRAMapping()
        add_lora_layers(self.model, self.registry, self.mapping)
        self.parked: deque[Sequence] = deque()  # requests whose adapter waits for a slot
        self.pinned: dict[str, str] = {}  # request id -> the adapter it pins

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; ValueError naming an adapter the registry does not know."""
        name = params.lora if params else None
        if name is not None:
            self.registry.check_known(name)
            if params.n > 1:  # forked siblings would run on an adapter pin that only the first holds
                raise ValueError("n > 1 is not supported with a LoRA adapter; send n requests")
        request_id = super().add_request(prompt, params, request_id)
        if name is not None:
            seq = self.requests[request_id]
            self.scheduler.waiting.remove(seq)
            self.parked.append(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq in self.parked:
            self.parked.remove(seq)
        super().abort(request_id)
        self._unpin_finished()

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self.parked)

    def step(self) -> list[RequestOutput]:
        self._admit()
        outputs = super().step()
        self._unpin_finished()
        return outputs

    def _admit(self) -> None:
        """Hand the scheduler every parked request whose adapter the registry can pin now (in arrival order;
        one that must wait does not hold back a later one whose adapter is loaded)."""
        for seq in list(self.parked):
            if self.registry.acquire(seq.params.lora) is not None:
                self.parked.remove(seq)
                self.pinned[seq.request_id] = seq.params.lora
                self.scheduler.add(seq)

    def _unpin_finished(self) -> None:
        for request_id in [r for r in self.pinned if r not in self.requests]:
            self.registry.release(self.pinned.pop(request_id))

    def before_forward(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        """Each token's adapter slot, in the order run_batch packs the tokens."""
        slots = [self.registry.slots[s.params.lora] if s.params.lora is not None else -1 for s in seqs]
        if max(slots) < 0:
            self.mapping.indices = None
        else:
            self.mapping.indices = torch.tensor(slots).repeat_interleave(torch.tensor(num_tokens))

    def _forward(self, seqs: list[Sequence], num_tokens: list[int]) -> list[torch.Tensor | Exception]:
        try:
            return super()._forward(seqs, num_tokens)
        finally:
            self.mapping.indices = None  # outside the engine the model is the base model again
