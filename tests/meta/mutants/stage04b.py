"""Stage 04 part 2 learner bugs (structured output, multi-LoRA, batch invariance), one edit each, planted in
solutions/stage04_batching (see labkit/grading/mutants.py)."""

MUTANTS = [
    # lora.py: bgmv
    dict(
        file="lora.py",
        find="        if s < 0:\n            continue  # base-model tokens get no LoRA term\n",
        replace="",
        bug="bgmv gives base-model tokens (index -1) the last slot's adapter",
    ),
    dict(
        file="lora.py",
        find="out[rows] = (x[rows] @ lora_a[s].T) @ lora_b[s].T * scaling[s]",
        replace="out[rows] = (x[rows] @ lora_a[s].T) @ lora_b[s].T",
        bug="bgmv forgets the LoRA scaling (lora_alpha / r)",
    ),
    dict(
        file="lora.py",
        find="out[rows] = (x[rows] @ lora_a[s].T) @ lora_b[s].T * scaling[s]",
        replace="out[rows] = (x[rows] @ lora_a[s].T) @ lora_b[s].T * scaling[0]",
        bug="bgmv scales every token by slot 0's scaling",
    ),
    dict(
        file="lora.py",
        find="out[rows] = (x[rows] @ lora_a[s].T) @ lora_b[s].T * scaling[s]",
        replace="out[rows] = x[rows] @ (lora_b[s] @ lora_a[s]).T * scaling[s]",
        bug="bgmv builds the merged (d_out, d_in) delta B A instead of two thin matmuls",
    ),
    dict(
        file="lora.py",
        find="        if s < 0:\n            continue",
        replace="        if s <= 0:\n            continue",
        bug="bgmv treats slot 0 as 'no adapter' (off by one in the base-model check)",
    ),
    dict(
        file="lora.py",
        find="        rows = indices == s\n",
        replace="        rows = indices >= s\n",
        bug="bgmv selects the tokens of slot s and every later slot",
        equivalent="indices.unique() is sorted, so every later slot's loop overwrites the rows this one got wrong",
    ),
    # lora.py: AdapterRegistry.acquire
    dict(
        file="lora.py",
        find="victim = next((n for n in self.slots if self.pins.get(n, 0) == 0), None)",
        replace="victim = next((n for n in reversed(self.slots) if self.pins.get(n, 0) == 0), None)",
        bug="acquire evicts the most recently used unpinned adapter (MRU instead of LRU)",
    ),
    dict(
        file="lora.py",
        find="victim = next((n for n in self.slots if self.pins.get(n, 0) == 0), None)",
        replace="victim = next(iter(self.slots), None)",
        bug="acquire evicts the least recently used adapter even while a request pins it",
    ),
    dict(
        file="lora.py",
        find="        self.slots[name] = self.slots.pop(name)  # dicts keep insertion order: the end is most recent\n",
        replace="",
        bug="acquire does not make a hit the most recently used (FIFO eviction, not LRU)",
    ),
    dict(
        file="lora.py",
        find="                slot = free[0]",
        replace="                slot = free[-1]",
        bug="acquire loads into the highest free slot instead of the lowest",
    ),
    dict(
        file="lora.py",
        find="            self.load(name, slot)\n            self.slots[name] = slot\n",
        replace="            if free:\n                self.load(name, slot)\n            self.slots[name] = slot\n",
        bug="acquire reuses an evicted slot without loading the new adapter's weights into it",
    ),
    dict(
        file="lora.py",
        find="        self.pins[name] = self.pins.get(name, 0) + 1",
        replace="        self.pins[name] = 1",
        bug="acquire sets the pin count to 1 instead of adding one (a second request's pin is lost)",
    ),
    dict(
        file="lora.py",
        find="                if victim is None:\n                    return None\n",
        replace="                if victim is None:\n                    victim = next(iter(self.slots))\n",
        bug="acquire evicts a pinned adapter when every slot is pinned instead of answering None",
    ),
    dict(
        file="lora.py",
        find="            if free:\n                slot = free[0]",
        replace="            if len(free) > 1:\n                slot = free[0]",
        bug="acquire evicts while one slot is still free (uses max_loras - 1 slots)",
    ),
    # lora.py: AdapterRegistry.release
    dict(
        file="lora.py",
        find="        self.pins[name] -= 1",
        replace="        self.pins[name] = 0",
        bug="release drops every pin of the adapter, not just this request's",
    ),
    dict(
        file="lora.py",
        find="        self.pins[name] -= 1",
        replace="        pass",
        bug="release never unpins: an adapter once used can never be evicted",
    ),
    dict(
        file="lora.py",
        find="        self.pins[name] -= 1",
        replace="        self.pins[name] -= 1\n        if self.pins[name] == 0:\n            del self.slots[name], self.pins[name]",
        bug="release unloads the adapter at zero pins (the next request reloads it from disk)",
    ),
    # structured.py: token_bytes
    dict(
        file="structured.py",
        find="        if i >= vocab_size or i in special:",
        replace="        if i >= vocab_size:",
        bug="token_bytes gives special tokens (<s>, </s>) the bytes of their names",
    ),
    dict(
        file="structured.py",
        find="        table[i] = bytes(byte_of[c] for c in text)",
        replace="        table[i] = bytes(ord(c) % 256 for c in text)",
        bug="token_bytes maps a shifted character chr(256 + k) back to byte k instead of the k-th unprintable byte",
    ),
    dict(
        file="structured.py",
        find="        table[i] = bytes(byte_of[c] for c in text)",
        replace="        table[i] = text.encode()",
        bug="token_bytes UTF-8 encodes the vocabulary string instead of inverting the byte-level alphabet",
    ),
    dict(
        file="structured.py",
        find="        if i >= vocab_size or i in special:",
        replace="        if i > vocab_size or i in special:",
        bug="token_bytes keeps the token whose id equals vocab_size (off by one)",
    ),
    dict(
        file="structured.py",
        find="        if any(c not in byte_of for c in text):",
        replace="        if False:",
        bug="token_bytes skips the alphabet check (a non-byte-level tokenizer fails with a KeyError, not a ValueError naming the token)",
    ),
    # structured.py: state_mask
    dict(
        file="structured.py",
        find="    if state in dfa.accepting:\n        next_state[eos_token_id] = state\n",
        replace="",
        bug="state_mask never allows EOS (forgets the accepting states)",
    ),
    dict(
        file="structured.py",
        find="    if state in dfa.accepting:\n        next_state[eos_token_id] = state\n",
        replace="    next_state[eos_token_id] = state\n",
        bug="state_mask allows EOS in every state, accepting or not",
    ),
    dict(
        file="structured.py",
        find="        next_state[eos_token_id] = state",
        replace="        next_state[eos_token_id] = dfa.initial",
        bug="state_mask sends EOS back to the initial state",
    ),
    dict(
        file="structured.py",
        find="        at[lo:hi] = table[at[trie.parent[lo:hi]] * 256 + trie.byte[lo:hi]]",
        replace="        at[lo:hi] = table[state * 256 + trie.byte[lo:hi]]",
        bug="state_mask reads every byte of a token from the row's state (checks bytes one by one, not as a walk)",
    ),
    dict(
        file="structured.py",
        find="    next_state = at[trie.token_node]",
        replace="    next_state = at[trie.parent[np.minimum(trie.token_node, len(trie.parent) - 1)]]",
        bug="state_mask records the state before the token's last byte as its next state",
    ),
    dict(
        file="structured.py",
        find="        at[lo:hi] = table[at[trie.parent[lo:hi]] * 256 + trie.byte[lo:hi]]",
        replace="        at[lo:hi] = table[at[lo:hi] * 256 + trie.byte[lo:hi]]",
        bug="state_mask looks a node's byte up from the node's own (unset) state instead of its parent's",
    ),
    dict(
        file="structured.py",
        find="zip(trie.levels[1:-1], trie.levels[2:], strict=True)",
        replace="zip(trie.levels[1:2], trie.levels[2:3], strict=True)",
        bug="state_mask stops at the trie's first level: no token of two or more bytes is ever allowed",
    ),
    dict(
        file="structured.py",
        find="        if at[lo:hi].min() == dead:",
        replace="        if at[lo:hi].max() == dead:",
        bug="state_mask stops at the first level with any dead node, not one where every node is dead",
    ),
    dict(
        file="structured.py",
        find="    at = np.full(len(trie.parent) + 1, dead, dtype=np.int64)",
        replace="    at = np.full(len(trie.parent) + 1, state, dtype=np.int64)",
        bug="state_mask starts every node at the row's state: tokens without bytes are allowed, and nodes below a dead level keep it",
    ),
    dict(
        file="structured.py",
        find="    next_state[next_state == dead] = -1\n",
        replace="",
        bug="state_mask leaves the dead state's number (a real-looking state) for disallowed tokens instead of -1",
    ),
    # structured.py: mask_logits
    dict(
        file="structured.py",
        find='    return logits.masked_fill(~allowed, float("-inf"))',
        replace="    return logits.masked_fill(~allowed, 0.0)",
        bug="mask_logits masks with 0 instead of -inf (a disallowed token keeps probability)",
    ),
    dict(
        file="structured.py",
        find='    return logits.masked_fill(~allowed, float("-inf"))',
        replace='    return logits.masked_fill(allowed, float("-inf"))',
        bug="mask_logits masks the allowed tokens instead of the disallowed ones",
    ),
    dict(
        file="structured.py",
        find='    return logits.masked_fill(~allowed, float("-inf"))',
        replace='    return logits.masked_fill_(~allowed, float("-inf"))',
        bug="mask_logits masks the caller's logits in place",
    ),
    dict(
        file="structured.py",
        find="    allowed = torch.ones_like(logits, dtype=torch.bool)",
        replace="    allowed = torch.zeros_like(logits, dtype=torch.bool)",
        bug="mask_logits masks out every token of an unconstrained row",
    ),
    dict(
        file="structured.py",
        find="            allowed[row] = guide.allowed()",
        replace="            allowed[:] = guide.allowed()",
        bug="mask_logits applies each guide's mask to the whole batch (the last guide wins)",
    ),
    # structured.py: schema_to_regex
    dict(
        file="structured.py",
        find='        return json_literal(schema["const"])',
        replace='        return json.dumps(schema["const"])',
        bug="schema_to_regex puts a const value in the regex without escaping it",
    ),
    dict(
        file="structured.py",
        find='        return "(?:" + "|".join(json_literal(v) for v in schema["enum"]) + ")"',
        replace='        return "(?:" + "|".join(json.dumps(v) for v in schema["enum"]) + ")"',
        bug="schema_to_regex puts enum members in the regex without escaping them",
    ),
    dict(
        file="structured.py",
        find='        return "(?:" + "|".join(json_literal(v) for v in schema["enum"]) + ")"',
        replace='        return "|".join(json_literal(v) for v in schema["enum"])',
        bug="schema_to_regex leaves an enum's alternation ungrouped (it swallows the text around it)",
    ),
    dict(
        file="structured.py",
        find='members = [f"{json_literal(name)}{WS}:{WS}{schema_to_regex(sub)}"',
        replace='members = [f"{json.dumps(name)}{WS}:{WS}{schema_to_regex(sub)}"',
        bug="schema_to_regex puts property names in the regex without escaping them",
    ),
    dict(
        file="structured.py",
        find="for name, sub in properties.items()]",
        replace='for name, sub in properties.items() if name in schema.get("required", [])]',
        bug="schema_to_regex emits only the required properties",
    ),
    dict(
        file="structured.py",
        find="        if missing:\n            raise UnsupportedSchema",
        replace="        if False:\n            raise UnsupportedSchema",
        bug="schema_to_regex accepts a required key that has no property (the output can never hold it)",
    ),
    dict(
        file="structured.py",
        find="""        return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'""",
        replace="""        return f'"[^"]{{{lo},{"" if hi is None else hi}}}"'""",
        bug='schema_to_regex writes a string as "[^"]*" (no escapes, raw control characters allowed)',
    ),
    dict(
        file="structured.py",
        find="""        return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'""",
        replace="""        return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi + 1}}}"'""",
        bug="schema_to_regex lets a string run one character past maxLength",
    ),
    dict(
        file="structured.py",
        find="more = f\"(?:{WS},{WS}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}\"",
        replace="more = f\"(?:{WS},{WS}{item}){{{lo},{'' if hi is None else hi}}}\"",
        bug="schema_to_regex counts the first item twice: minItems and maxItems off by one",
    ),
    dict(
        file="structured.py",
        find='        items = f"{item}{more}" if lo > 0 else f"(?:{item}{more})?"',
        replace='        items = f"(?:{item}{more})?"',
        bug="schema_to_regex always allows an empty array, whatever minItems says",
    ),
    dict(
        file="structured.py",
        find='        if hi == 0:\n            return rf"\\[{WS}\\]"\n',
        replace="",
        bug="schema_to_regex forgets maxItems = 0 (an impossible repeat count)",
    ),
    dict(
        file="structured.py",
        find="""    for key in schema:
        if key not in SUPPORTED and key not in ANNOTATIONS:
            raise UnsupportedSchema(f"unsupported JSON Schema feature {key!r}")
""",
        replace="",
        bug="schema_to_regex silently ignores keywords it does not implement (pattern, minimum, anyOf, ...)",
    ),
    dict(
        file="structured.py",
        find="    if kind is None:\n        return any_json(2)",
        replace="    if kind is None:\n        return any_object(2)",
        bug="schema_to_regex makes a schema without a type any object instead of any JSON value",
    ),
    dict(
        file="structured.py",
        find="        if properties is None:\n            return any_object(2)",
        replace="        if properties is None:\n            return any_json(2)",
        bug="schema_to_regex makes an object without properties any JSON value, not any object",
    ),
    dict(
        file="structured.py",
        find='f"{WS},{WS}".join(members)',
        replace='",".join(members)',
        bug="schema_to_regex allows no space around the comma between members (json.dumps output rejected)",
    ),
    # issue #37: edges (test_04b_edges.py)
    dict(
        file="structured.py",
        find="    at[0] = state\n",
        replace="    at[0] = dead if state in dfa.accepting else state\n",
        bug="state_mask allows only EOS in an accepting state, even one the match can continue from",
    ),
    dict(
        file="structured.py",
        find="return int(allowed.sum()) - int(allowed[self.index.eos_token_id]) == 0",
        replace="return bool(allowed[self.index.eos_token_id])",
        bug="Guide.is_finished as soon as EOS is allowed (stops [0-9]+ after its first digit)",
    ),
    dict(
        file="structured.py",
        find="more = f\"(?:{WS},{WS}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}\"",
        replace='more = f"(?:{WS},{WS}{item}){{{max(lo - 1, 0)},{max(lo - 1, 0) if hi is None else hi - 1}}}"',
        bug="schema_to_regex reads a missing maxItems as minItems (an open array takes exactly minItems items)",
    ),
    dict(
        file="structured.py",
        find='lo, hi = schema.get("minItems", 0), schema.get("maxItems")',
        replace='lo, hi = schema.get("minItems", 0), schema.get("maxItems", 0)',
        bug="schema_to_regex reads a missing maxItems as 0 (an open array only takes [])",
    ),
    dict(
        file="structured.py",
        find="""        return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'""",
        replace="""        return f'"{STRING_CHAR}{{{lo},{lo if hi is None else hi}}}"'""",
        bug="schema_to_regex reads a missing maxLength as minLength",
    ),
    # batch_invariant.py: linear_padded
    dict(
        file="batch_invariant.py",
        find="    return F.linear(F.pad(x, (0, 0, 0, min_rows - N)), weight, bias)[:N]",
        replace="    return F.linear(x, weight, bias)",
        bug="linear_padded does not pad (a batch of one takes the BLAS's matrix-vector kernel)",
    ),
    dict(
        file="batch_invariant.py",
        find="F.pad(x, (0, 0, 0, min_rows - N))",
        replace="F.pad(x, (0, 0, 0, min_rows - 1 - N))",
        bug="linear_padded pads to one row short of min_rows",
    ),
    dict(
        file="batch_invariant.py",
        find="min_rows - N)), weight, bias)[:N]",
        replace="min_rows - N)), weight, bias)",
        bug="linear_padded returns the padding rows too",
    ),
    dict(
        file="batch_invariant.py",
        find="min_rows - N)), weight, bias)[:N]",
        replace="min_rows - N)), weight)[:N]",
        bug="linear_padded drops the bias when it pads",
    ),
    dict(
        file="batch_invariant.py",
        find="    if N >= min_rows:\n        return F.linear(x, weight, bias)",
        replace="    if N >= min_rows:\n        return F.linear(x, weight)",
        bug="linear_padded drops the bias of a batch that needs no padding",
    ),
    dict(
        file="batch_invariant.py",
        find="    if N >= min_rows:\n",
        replace="    if N >= min_rows - 2:\n",
        bug="linear_padded leaves batches just below min_rows unpadded",
    ),
    # batch_invariant.py: split_kv_attention
    dict(
        file="batch_invariant.py",
        find="    S = int(pos.max()) // split + 1  # the splits the furthest query reaches into\n",
        replace="    split *= G\n    S = int(pos.max()) // split + 1\n",
        bug="split_kv_attention's split grows with the batch (the key ranges then depend on who else is in it)",
    ),
    dict(
        file="batch_invariant.py",
        find="    S = int(pos.max()) // split + 1  # the splits the furthest query reaches into\n",
        replace="    split = max(split, n)\n    S = int(pos.max()) // split + 1\n",
        bug="split_kv_attention widens the split to the longest chunk (the key ranges depend on the chunk size)",
    ),
    dict(
        file="batch_invariant.py",
        find="    S = int(pos.max()) // split + 1  # the splits the furthest query reaches into\n",
        replace="    S = -(-int(pos.max()) // split)\n",
        bug="split_kv_attention takes ceil(pos / split) splits, one too few when the furthest query sits at a "
        "split's first key",
    ),
    dict(
        file="batch_invariant.py",
        find="masked_fill(keys.view(S, 1, 1, split) > pos",
        replace="masked_fill(keys.view(S, 1, 1, split) >= pos",
        bug="split_kv_attention masks the query's own key (off by one in the causal mask)",
    ),
    dict(
        file="batch_invariant.py",
        find="    p = torch.exp(s - s.amax((2, 4), keepdim=True))",
        replace="    p = torch.exp(s - s.amax(-1, keepdim=True))",
        bug="split_kv_attention takes each split's own max and adds the splits without rescaling them to a common one",
    ),
    dict(
        file="batch_invariant.py",
        find="        l_sum = l_sum + l[:, :, i]\n",
        replace="",
        bug="split_kv_attention divides by the first split's softmax denominator only",
    ),
    dict(
        file="batch_invariant.py",
        find="    for i in range(1, S):  # in order; a split past a row's position adds zeros\n",
        replace="    for i in range(1, S - 1):\n",
        bug="split_kv_attention leaves the last split out of the sums",
    ),
    dict(
        file="batch_invariant.py",
        find="reshape(G, n_kv, 1, n * n_rep, D) * D**-0.5",
        replace="reshape(G, n_kv, 1, n * n_rep, D)",
        bug="split_kv_attention forgets the 1/sqrt(head_dim) scale",
    ),
    dict(
        file="batch_invariant.py",
        find="q = q.view(G, n, n_kv, n_rep, D).transpose(1, 2)",
        replace="q = q.view(G, n, n_rep, n_kv, D).permute(0, 3, 1, 2, 4)",
        bug="split_kv_attention maps query head h to kv head h % n_kv instead of h // n_rep",
    ),
    dict(
        file="batch_invariant.py",
        find="    short = -(-min_rows // (H // k_pool.shape[2]))",
        replace="    short = 1",
        bug="split_kv_attention does not pad a decode's product (n_rep rows: another BLAS kernel than a chunk's)",
    ),
    dict(
        file="batch_invariant.py",
        find="        n, lens = max(int(query_lens[group].max()), short), query_lens[group, None]",
        replace="        n, lens = int(query_lens[group].max()), query_lens[group, None]",
        bug="split_kv_attention batches the decodes together but pads them only to the longest of them",
    ),
    dict(
        file="batch_invariant.py",
        find="        rows, pos = first[group, None] + j, context_lens[group, None] - lens + j",
        replace="        rows, pos = first[group, None] + j, context_lens[group, None] - 1 + j * 0",
        bug="split_kv_attention gives every query of a chunk the chunk's last position (no causal mask inside it)",
    ),
    dict(
        file="batch_invariant.py",
        find="""    gather = (slots[:, None, :] * n_kv + torch.arange(n_kv)[:, None]).flatten()
    k = k_pool.view(-1, D).index_select(0, gather).view(G, n_kv, S, split, D)
    v = v_pool.view(-1, D).index_select(0, gather).view(G, n_kv, S, split, D)""",
        replace="""    b, o = tables[:, block], keys % block_size
    k = k_pool[b, o].view(G, S, split, n_kv, D).permute(0, 3, 1, 2, 4)
    v = v_pool[b, o].view(G, S, split, n_kv, D).permute(0, 3, 1, 2, 4)""",
        bug="split_kv_attention leaves the gathered keys and values a non-contiguous view (a lone short decode takes another BLAS path)",
    ),
]
