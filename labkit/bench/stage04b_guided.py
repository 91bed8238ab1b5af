"""Stage 04 part 2 on SmolLM2's 49,152-token vocabulary: the course's guided decoding beside llguidance and
XGrammar, the libraries vLLM and SGLang ship (`make guided` installs them; without them their columns are
empty), all in one run, one thread.

    python -m labkit.bench 04b_guided [--quick]     (LABS_IMPL=solution for the answer key)

A. Three constraint classes, one token path each (the tokenizer's encoding of a text that matches, then
   EOS), fed to every backend: compile time (pattern or schema -> what computes masks; medians of
   repeats, caches cleared, one compile thread), and the mask of each step of the path: median and worst. For the course
   the row is computed cold at every step (state_mask, no memo: the cost a new state pays), and the dict
   walk the arrays replaced is timed on a few of the same states. Compiles are timed in the process's CPU
   time and masks in this thread's (each token's mask the best of the repeats): on a shared machine a
   wall-clock worst case mostly measures preemption; the wall-clock median of the masks is kept beside it. The floor: the course's row (3 bytes per token) and a bitmask
   (1 bit per token) written at the memory bandwidth measured here.
B. One decode step of LLMEngine on SmolLM2, free vs all rows guided, batch 1 and 8 (medians, interleaved).
C. The server on SmolLM2: a streaming bystander's inter-token latency p99 alone, beside three clients
   generating free text, and beside three clients generating under printable-class constraints (the
   same batch size: the difference is what the constraints cost the others).
"""

import json
import random
import re
import statistics
import threading
import time
from concurrent.futures import Future

import numpy as np

from labkit import bench
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import load

PRINTABLE = "[ -~]*a[ -~]{10}"  # about 2,048 DFA states: which of the last 11 bytes were 'a'
PRINTABLE_TEXT = "Once upon a time there was a robot who liked to read books in the park, all a long day."
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
}
SCHEMA_TEXT = json.dumps({"name": "Ada Lovelace, Countess of Lovelace", "city": "London, England", "age": 36})
ADDRESS = (
    r"[0-9]{1,5} [A-Z][a-z]+ (Street|Avenue|Road|Lane), [A-Z][a-z]+, [A-Z]{2} [0-9]{5}, "
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
)
ADDRESS_TEXT = "221 Baker Street, Springfield, IL 62704, 2024-03-15"
CASES = [  # class, course regex (None: from the schema), llguidance/XGrammar input, text on the path
    ("printable class, counted repetition", PRINTABLE, PRINTABLE, PRINTABLE_TEXT),
    ("3-field JSON schema, free strings", None, SCHEMA, SCHEMA_TEXT),
    ("literal-heavy address and date", ADDRESS, ADDRESS, ADDRESS_TEXT),
]
PROMPT = "Write one sentence about a robot:"


def ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 3)


def anchors(tok, vocab_size: int, eos: int):
    """(llguidance's tokenizer, XGrammar's TokenizerInfo), each None if that package is not installed."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tok.id_to_token(eos))
    try:
        import llguidance.hf

        llg = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    except ImportError:
        llg = None
    try:
        import xgrammar

        xgr = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
    except ImportError:
        xgr = None
    return llg, xgr


def course_backend(byte_dfa, structured, trie, vocab_size: int, eos: int):
    def compile_(spec):
        return byte_dfa.compile_regex(spec if isinstance(spec, str) else structured.schema_to_regex(spec))

    def masks(dfa, path: list[int], clock) -> list[float]:
        state, times = dfa.initial, []
        for token in path:
            start = clock()
            _, nxt = structured.state_mask(dfa, trie, state, vocab_size, eos)  # cold: no memo
            times.append(clock() - start)
            state = int(nxt[token])
            assert state >= 0, f"the course's mask refuses token {token} of the path"
        return times

    return compile_, masks


def llguidance_backend(llg_tok):
    import llguidance
    import llguidance.numpy

    def compile_(spec):
        if isinstance(spec, str):
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:  # compact JSON, as the path's text is written
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=options)
        matcher = llguidance.LLMatcher(llg_tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def masks(grammar, path: list[int], clock) -> list[float]:
        matcher = llguidance.LLMatcher(llg_tok, grammar)
        bitmask = llguidance.numpy.allocate_token_bitmask(1, llg_tok.vocab_size)
        times = []
        for token in path:
            start = clock()
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
            times.append(clock() - start)
            assert matcher.consume_token(token), f"llguidance refuses token {token}: {matcher.get_error()}"
        return times

    return compile_, masks


def xgrammar_backend(info):
    import xgrammar

    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_(spec):
        if isinstance(spec, str):
            return compiler.compile_regex(spec)
        return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(", ", ": "))

    def masks(compiled, path: list[int], clock) -> list[float]:
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        times = []
        for token in path:
            start = clock()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(clock() - start)
            assert matcher.accept_token(token), f"XGrammar refuses token {token}"
        return times

    return compile_, masks


def dict_walk_ms(structured, vocab, dfa, states: list[int]) -> float:
    """Median ms of the previous design: a depth-first walk of a trie of Python dicts (kept here to measure)."""
    root: dict = {}
    for data in vocab:
        node = root
        for byte in data or b"":
            node = node.setdefault(byte, {})
    times = []
    for state in states:
        start = time.perf_counter()
        todo = [(root, state)]
        while todo:
            node, at = todo.pop()
            step = dfa.transitions[at]
            for byte, child in node.items():
                nxt = step.get(byte)
                if nxt is not None:
                    todo.append((child, nxt))
        times.append(time.perf_counter() - start)
    return ms(statistics.median(times))


def mask_rows(tok, vocab_size: int, eos: int, repeats: int) -> tuple[list[dict], dict]:
    byte_dfa, structured = load("stage04_batching.byte_dfa"), load("stage04_batching.structured")
    vocab = structured.token_bytes(tok, vocab_size)
    start = time.perf_counter()
    trie = structured.token_trie(vocab)
    once = {"course_trie_build_s": round(time.perf_counter() - start, 3)}
    start = time.perf_counter()
    llg_tok, xgr_info = anchors(tok, vocab_size, eos)
    once["anchors_tokenizer_setup_s"] = round(time.perf_counter() - start, 3)
    backends = {"course": course_backend(byte_dfa, structured, trie, vocab_size, eos)}
    if llg_tok is not None:
        backends["llguidance"] = llguidance_backend(llg_tok)
    if xgr_info is not None:
        backends["xgrammar"] = xgrammar_backend(xgr_info)
    rows = []
    for label, regex, spec, text in CASES:
        course_spec = regex if regex is not None else SCHEMA
        assert re.fullmatch(structured.schema_to_regex(SCHEMA) if regex is None else regex, text), text
        path = [*tok.encode(text).ids, eos]
        row = {"constraint": label, "path_tokens": len(path)}
        for name, (compile_, masks) in backends.items():
            compiles = []
            for _ in range(repeats):  # process CPU time: a library may compile on a thread of its own
                start = time.process_time()
                compiled = compile_(course_spec if name == "course" else spec)
                compiles.append(time.process_time() - start)
            cpu = [min(t) for t in zip(*(masks(compiled, path, time.thread_time) for _ in range(repeats)), strict=True)]
            wall = masks(compiled, path, time.perf_counter)
            row[f"{name}_compile_ms"] = ms(statistics.median(compiles))
            row[f"{name}_mask_median_ms"] = ms(statistics.median(cpu))
            row[f"{name}_mask_worst_ms"] = ms(max(cpu))
            row[f"{name}_mask_wall_median_ms"] = ms(statistics.median(wall))
            if name == "course":
                row["dfa_states"] = compiled.num_states
                states = [compiled.initial]
                for token in path[:-1]:
                    states.append(compiled.walk(states[-1], vocab[token]))
                row["course_dict_walk_median_ms"] = dict_walk_ms(
                    structured, vocab, compiled, states[:: len(states) // 4]
                )
        if "llguidance_mask_median_ms" in row:
            row["course_over_llguidance_median"] = round(
                row["course_mask_median_ms"] / row["llguidance_mask_median_ms"], 1
            )
        # The floor: writing the mask at this core's streaming rate (labkit.bench.floors), the course's row (3 bytes
        # per token) for its masks, a bitmask (1 bit per token) for the libraries'; in us (a bitmask's is ~0.3)
        for name, size in (("course", 3 * vocab_size), ("llguidance", vocab_size / 8), ("xgrammar", vocab_size / 8)):
            if f"{name}_mask_median_ms" in row:
                floor = floors.floor_s(bytes=size)
                row[f"{name}_mask_floor_us"] = round(floor * 1e6, 2)
                row[f"{name}_mask_median_vs_floor"] = round(row[f"{name}_mask_median_ms"] / 1e3 / floor, 1)
        rows.append(row)
    bandwidth = floors.bandwidth()
    once |= {
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "floor_course_row_us": round(3 * vocab_size / bandwidth * 1e6, 1),
        "floor_bitmask_us": round(vocab_size / 8 / bandwidth * 1e6, 2),
    }
    return rows, once


class Inline:
    """An executor that runs the mask rows at once, before the forward: the step without the overlap."""

    def submit(self, fn, *args) -> Future:
        fn(*args)
        done = Future()
        done.set_result(None)
        return done


def decode_steps(model, tok, batch: int, guided: bool, letter: str, tokens: int, overlap: bool = True) -> float:
    """Median seconds of one decode step of `batch` rows, all guided (a fresh pattern: masks cold) or none."""
    engine_mod, sequence = load("stage04_batching.engine"), load("stage04_batching.sequence")
    engine = engine_mod.LLMEngine(model, tok, num_blocks=256, max_num_seqs=8)
    if not overlap:
        engine._mask_thread = Inline()
    pattern = f"[ -~]*{letter}[ -~]{{10}}" if guided else None
    for i in range(batch):
        params = sequence.SamplingParams(
            max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, guided_regex=pattern
        )
        engine.add_request(f"{PROMPT} {i}", params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_rows(model, tok, rounds: int, tokens: int) -> list[dict]:
    rows = []
    for batch in (1, 8):
        free, guided, serial = [], [], []
        for r in range(rounds):  # interleaved, a new letter (pattern) every time: every mask is cold
            free.append(decode_steps(model, tok, batch, False, "", tokens))
            guided.append(decode_steps(model, tok, batch, True, "bcdefghijk"[r % 10], tokens))
            serial.append(decode_steps(model, tok, batch, True, "lmnopqrstu"[r % 10], tokens, overlap=False))
        f, g, s = (statistics.median(x) for x in (free, guided, serial))
        rows.append(
            {
                "batch": batch,
                "free_step_ms": ms(f),
                "guided_step_ms": ms(g),
                "guided_masks_before_forward_ms": ms(s),
                "guided_over_free": round(g / f, 2),
                "serial_over_free": round(s / f, 2),
                # floor: the weights and each row's cache (its prompt's K/V at least) read once per step
                **floors.row(f, bytes=floors.decode_bytes(model, len(tok.encode(PROMPT).ids), batch), name="free_step"),
            }
        )
    return rows


def bystander_itl(model, tok, rounds: int) -> dict:
    """A streaming bystander's inter-token gaps: alone, beside three free clients, beside three guided ones."""
    import httpx

    from labkit.serving import serving

    api, engine_mod = load("stage04_batching.api_server"), load("stage04_batching.engine")

    def gaps(url: str) -> list[float]:
        body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True}
        stamps = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        return list(np.diff(stamps[1:]))  # from the second token on: the decode steps

    def beside(url: str, letters: str | None) -> list[float]:
        """The bystander's gaps while three clients generate back to back (guided: a new pattern per letter)."""
        stop = threading.Event()

        def client(c: str | None) -> None:
            while not stop.is_set():
                body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 1.0, "ignore_eos": True}
                if c is not None:
                    body["guided_regex"] = f"[ -~]*{c}[ -~]{{10}}"
                httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()

        clients = [threading.Thread(target=client, args=(c,)) for c in (letters or [None] * 3)]
        for t in clients:
            t.start()
        time.sleep(1.0)  # let them compile and start generating
        result = gaps(url)
        stop.set()
        for t in clients:
            t.join()
        return result

    alone, free, guided = [], [], []
    engine = engine_mod.LLMEngine(model, tok, num_blocks=256, max_num_seqs=8)
    with serving(api.create_app(engine, tok), timeout=120) as url:
        gaps(url)  # warm up
        for r in range(rounds):
            alone += gaps(url)
            free += beside(url, None)
            guided += beside(url, "".join(random.Random(r).sample("abcdefghijklmnopqrstuvwxyz", 3)))
    p99 = {name: float(np.percentile(g, 99)) for name, g in (("alone", alone), ("free", free), ("guided", guided))}
    return {
        "rounds": rounds,
        "bystander_gaps": [len(alone), len(free), len(guided)],
        "itl_p99_alone_ms": ms(p99["alone"]),
        "itl_p99_beside_3_free_ms": ms(p99["free"]),
        "itl_p99_beside_3_guided_ms": ms(p99["guided"]),
        "guided_over_alone_p99": round(p99["guided"] / p99["alone"], 2),
        "guided_over_free_p99": round(p99["guided"] / p99["free"], 2),
        "itl_median_ms": {
            k: ms(statistics.median(v)) for k, v in (("alone", alone), ("free", free), ("guided", guided))
        },
    }


def main(quick: bool = False) -> bench.Result:
    from labkit.checkpoint import load_tokenizer, real_model_folder
    from labkit.model import from_pretrained

    pin_threads(1)
    real = real_model_folder()
    if not (real / "tokenizer.json").is_file():
        raise SystemExit("this benchmark runs on SmolLM2: run `make setup` first")
    tok = load_tokenizer(real)
    model = from_pretrained(real)
    rows, once = mask_rows(tok, model.config.vocab_size, model.config.eos_token_id, 3 if quick else 5)
    print(bench.table(rows, title="stage 04b: compile and mask per token, SmolLM2 (49,152 tokens), one thread"))
    steps = step_rows(model, tok, 1 if quick else 3, 12 if quick else 24)
    print(bench.table(steps, title="one decode step, free vs all rows guided"))
    server = bystander_itl(model, tok, 1 if quick else 8)  # 8 rounds: ~230 gaps each, so p99 is not the maximum
    print(server)
    return bench.Result(rows, {"model": "SmolLM2-135M-Instruct", **once, "decode_steps": steps, "server": server})
