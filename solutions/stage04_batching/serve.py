"""Start the server on the tiny target:  python -m stage04_batching.serve [--port 8000]

    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "Once upon a time", "max_tokens": 40, "stream": true}'
"""

import argparse

import uvicorn

from labkit import TARGET
from labkit.evaluate import load_tokenizer
from labkit.model import load

from .engine import LLMEngine
from .server import create_app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(TARGET), help="a Llama-family HF folder (default: the tiny target)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-waiting", type=int, default=128)
    args = ap.parse_args(argv)
    engine = LLMEngine(load(args.model), load_tokenizer(args.model), args.num_blocks, max_num_seqs=args.max_num_seqs)
    app = create_app(engine, load_tokenizer(args.model), max_waiting=args.max_waiting)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
