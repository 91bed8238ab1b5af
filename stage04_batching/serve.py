"""Start the server:  python -m stage04_batching.serve [--model PATH] [--port 8000]

    make serve                              # SmolLM2-135M-Instruct, the real model make setup converted
    MODEL=tiny make serve                   # labkit's tiny target (MODEL=path/to/hf-folder: any Llama folder)
    python -m stage04_batching.serve        # --model defaults to $MODEL, else labkit's tiny target
    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "Once upon a time", "max_tokens": 40, "stream": true}'
    python -m stage04_batching.serve --lora-modules course     # then "model": "tiny-target:zoe"
"""

import argparse
import os
from pathlib import Path

import torch
import uvicorn

from labkit import LORA, TARGET
from labkit.checkpoint import load_tokenizer
from labkit.model import from_pretrained
from labkit.serving import fail_on_marker

from .api_server import create_app
from .config import EngineConfig
from .engine import LLMEngine
from .guided_backends import BACKENDS, LibraryBackend
from .lora import AdapterRegistry
from .lora_engine import LoRAEngine
from .protocol import load_chat_template


def lora_modules(specs: list[str]) -> dict[str, Path]:
    """{name: folder} from `name=path` pairs; `course` stands for every adapter in labkit/assets/lora."""
    if specs == ["course"]:
        return {folder.name: folder for folder in sorted(LORA.iterdir())}
    if not all("=" in spec for spec in specs):
        raise SystemExit(f"--lora-modules takes NAME=PATH pairs (or `course`), got {specs}")
    return {name: Path(path) for name, path in (spec.split("=", 1) for spec in specs)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("MODEL") or str(TARGET), help="a Llama-family HF folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-waiting", type=int, default=128, help="requests that may wait for admission before 429")
    ap.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve, as vLLM takes them; "
        "`--lora-modules course` serves labkit's own (zoe, excited, turtles)",
    )
    ap.add_argument("--max-loras", type=int, default=2, help="adapter slots: how many are loaded at once")
    ap.add_argument(
        "--fault-marker",
        help="requests whose prompt holds this text fail inside the engine step "
        "(to check fault isolation with labkit.bench.loadtest --chaos)",
    )
    ap.add_argument(
        "--guided-decoding-backend",
        choices=BACKENDS,
        default="course",
        help="what computes guided_regex / response_format masks: your token index (course), or the optional "
        "llguidance or XGrammar (`make guided`), as vLLM's flag of that name",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the engine's step (default: $OMP_NUM_THREADS if set, else every core, as "
        "llama-server's -t; on two cores both made a served token faster than one, with the event loop beside them)",
    )
    EngineConfig.add_cli_args(ap)
    args = ap.parse_args(argv)
    threads = args.threads or (torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else os.cpu_count() or 1)
    # Load and pack on this thread alone, so that only the engine's step thread (AsyncEngine.stepper) ever starts
    # OpenMP threads: with a second team alive (this thread's), libgomp sees more threads than cores and stops
    # spinning between parallel regions, and every region of a step waits for its threads to wake.
    torch.set_num_threads(1)
    if args.lora_modules and args.batch_invariant:
        ap.error("--batch-invariant does not cover LoRA adapters (batch_invariant.py tiles the base model's matmuls)")
    tokenizer = load_tokenizer(args.model)
    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        ap.error(str(e))
    model = from_pretrained(args.model)
    if args.lora_modules:
        registry = AdapterRegistry(model.config, lora_modules(args.lora_modules), max_loras=args.max_loras)
        engine = LoRAEngine(model, tokenizer, registry, config)
    else:
        engine = LLMEngine(model, tokenizer, config)
    if args.guided_decoding_backend != "course":
        engine.guided_backend = LibraryBackend(
            args.guided_decoding_backend, tokenizer, model.config.vocab_size, model.config.eos_token_id
        )
    if args.fault_marker:
        engine.fault_hook = fail_on_marker(tokenizer, args.fault_marker)
    torch.set_num_threads(threads)  # what the step thread's team takes
    app = create_app(
        engine,
        tokenizer,
        model_name=Path(args.model).name,
        max_waiting=args.max_waiting,
        chat_template=load_chat_template(args.model),
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
