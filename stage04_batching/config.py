"""The settings of one engine, each with its default, written once (nano-vllm's Config; vLLM splits
the same fields over CacheConfig and SchedulerConfig). Given code.

    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))   # or LLMEngine(model, tokenizer, num_blocks=64)
    EngineConfig.add_cli_args(parser)                                    # serve.py: the same fields as vLLM's flags

Every part of the engine reads its setting from here: the block manager and the KV pool the block
size and pool size (the pool its format too, kv_cache_dtype: part 3, kv_quant.py), the scheduler the two batch limits, add_request and the server the context length.
"""

import argparse
import dataclasses
from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")  # vLLM's --kv-cache-dtype names (kv_quant.py stores the last two)
KERNELS = ("cpp", "torch")  # the linear layers' loops: labkit.cpu_kernels (labkit/fast_paged.py) or PyTorch's
QUANTIZATIONS = ("none", "q8_0", "q4_0", "q4_1")  # the weights' format, GGUF's type names (none: the model's float32)
CHOICES = {"kv_cache_dtype": KV_CACHE_DTYPES, "kernels": KERNELS, "quantization": QUANTIZATIONS}


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block (vLLM's default)
    num_blocks: int = 1024  # KV blocks in the pool, allocated once (vLLM sizes it from free GPU memory)
    max_num_seqs: int = 32  # sequences in the running batch
    max_num_batched_tokens: int = 512  # tokens one step computes: prefill chunks and decodes together
    max_model_len: int | None = None  # prompt + output tokens of one request; None: all the pool and the model hold
    enable_prefix_caching: bool = True
    batch_invariant: bool = False  # a token's logits independent of its batch, bit for bit (batch_invariant.py); slower
    kv_cache_dtype: str = "auto"  # the KV pool's format (kv_quant.py): auto (the model's), fp8_e4m3 or int8
    kernels: str = "cpp"  # the linear layers through labkit.cpu_kernels (PyTorch's where they cannot build)
    quantization: str = "none"  # q8_0, q4_0 or q4_1: the weights in llama.cpp's blocks of 32, through the same kernels

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(
                f"max_model_len must be an integer >= 2 (a prompt token and an output), got {self.max_model_len!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        for name, choices in (("kernels", KERNELS), ("quantization", QUANTIZATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.batch_invariant and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"batch_invariant reads the float pool only; kv_cache_dtype={self.kv_cache_dtype!r} needs it off"
            )

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest request (prompt + max_tokens) an engine with this pool can serve on a model with
        `max_position_embeddings` positions; ValueError if max_model_len asks for more than either holds."""
        room = min(max_position_embeddings, self.num_blocks * self.block_size)
        if self.max_model_len is None:
            return room
        if self.max_model_len > room:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds what this engine can hold: the model has "
                f"{max_position_embeddings} positions and the pool {self.num_blocks} blocks x {self.block_size} "
                f"tokens = {self.num_blocks * self.block_size}; lower max_model_len or raise num_blocks"
            )
        return self.max_model_len

    def replace(self, **settings) -> "EngineConfig":
        """A copy with some fields changed; TypeError naming a field that does not exist."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise TypeError(f"no engine setting {', '.join(unknown)}; the settings are {', '.join(sorted(names))}")
        return dataclasses.replace(self, **settings)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, under vLLM's name (`--block-size`, `--max-num-seqs`, ...), with its default.
        The pool size also answers to vLLM's `--num-gpu-blocks-override`."""
        group = parser.add_argument_group("engine (EngineConfig)")
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-")]
            if f.name == "num_blocks":
                flags.append("--num-gpu-blocks-override")
            if f.type == "bool" or f.type is bool:
                group.add_argument(*flags, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction)
            elif f.name in CHOICES:
                group.add_argument(
                    *flags, dest=f.name, choices=CHOICES[f.name], default=f.default, help=f"default: {f.default}"
                )
            else:
                group.add_argument(*flags, dest=f.name, type=int, default=f.default, help=f"default: {f.default}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
