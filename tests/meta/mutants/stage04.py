"""Stage 04 learner bugs, one edit each, planted in solutions/stage04_batching (see labkit/grading/mutants.py)."""

MUTANTS = [
    # block_manager.py
    dict(
        file="block_manager.py",
        find="return hash((parent_hash, tuple(token_ids)))",
        replace="return hash(tuple(token_ids))",
        bug="hash_block ignores the parent hash (equal blocks, different prefixes collide)",
    ),
    dict(
        file="block_manager.py",
        find="            if self.hash_to_block_id.get(block.block_hash) == block_id:\n                del self.hash_to_block_id[block.block_hash]\n",
        replace="",
        bug="_pop_free evicts a block but leaves its hash in the cache table",
    ),
    dict(
        file="block_manager.py",
        find="            block.block_hash, block.token_ids = None, ()\n",
        replace="",
        bug="_pop_free reuses an evicted block without clearing its hash",
    ),
    dict(
        file="block_manager.py",
        find="block_id, _ = self.free_queue.popitem(last=False)",
        replace="block_id, _ = self.free_queue.popitem()",
        bug="_pop_free takes the most recently freed block (MRU, evicts hot prefixes)",
    ),
    dict(
        file="block_manager.py",
        find="        block.ref_count = 1\n        return block",
        replace="        block.ref_count += 1\n        return block",
        bug="_pop_free increments a stale ref_count instead of setting it to 1",
        equivalent="a block in the free queue always has ref_count 0 (the random-operations test checks it), so += 1 and = 1 agree",
    ),
    dict(
        file="block_manager.py",
        find="for i in range((len(token_ids) - 1) // self.block_size):",
        replace="for i in range(len(token_ids) // self.block_size):",
        bug="match_prefix lets a full hit cover the last prompt token (nothing left to compute)",
    ),
    dict(
        file="block_manager.py",
        find="if block_id is None or self.blocks[block_id].token_ids != chunk:",
        replace="if block_id is None:",
        bug="match_prefix trusts a hash hit without checking the tokens",
    ),
    dict(
        file="block_manager.py",
        find="            if block_id is None or self.blocks[block_id].token_ids != chunk:\n                break",
        replace="            if block_id is None or self.blocks[block_id].token_ids != chunk:\n                continue",
        bug="match_prefix skips a missing block and keeps matching later ones",
    ),
    dict(
        file="block_manager.py",
        find="        if not self.enable_prefix_caching:\n            return []\n        hits",
        replace="        hits",
        bug="match_prefix ignores enable_prefix_caching",
        equivalent="with caching off cache_blocks registers nothing, so the lookup finds no hit either way",
    ),
    dict(
        file="block_manager.py",
        find="revived = sum(self.blocks[b].ref_count == 0 for b in hits)",
        replace="revived = 0",
        bug="can_allocate forgets that reviving a cached free block takes it from the queue",
    ),
    dict(
        file="block_manager.py",
        find="return seq.num_blocks_needed(self.block_size) - len(hits) + revived <= len(self.free_queue)",
        replace="return seq.num_blocks_needed(self.block_size) - len(hits) + revived < len(self.free_queue)",
        bug="can_allocate off by one (refuses when exactly enough blocks are free)",
    ),
    dict(
        file="block_manager.py",
        find="            if block.ref_count == 0:\n                del self.free_queue[block_id]\n            block.ref_count += 1",
        replace="            block.ref_count += 1",
        bug="allocate revives a cached block without taking it off the free queue",
    ),
    dict(
        file="block_manager.py",
        find="seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size",
        replace="seq.num_computed_tokens = seq.num_cached_tokens = 0",
        bug="allocate does not skip the cached prefix (recomputes it)",
    ),
    dict(
        file="block_manager.py",
        find="fresh = [self._pop_free().block_id for _ in range(seq.num_blocks_needed(self.block_size) - len(hits))]",
        replace="fresh = [self._pop_free().block_id for _ in range(seq.num_blocks_needed(self.block_size))]",
        bug="allocate takes fresh blocks for the cached prefix too",
    ),
    dict(
        file="block_manager.py",
        find="shared_tail = not needs_block and self.blocks[seq.block_table[-1]].ref_count > 1",
        replace="shared_tail = False",
        bug="can_append ignores copy-on-write of a shared last block",
    ),
    dict(
        file="block_manager.py",
        find="        if last.ref_count == 1:\n            return None\n        last.ref_count -= 1",
        replace="        if last.ref_count == 1:\n            return None",
        bug="append_slot copy-on-write keeps the reference to the shared block",
    ),
    dict(
        file="block_manager.py",
        find="        if last.ref_count == 1:\n            return None\n",
        replace="        if last.ref_count <= 2:\n            return None\n",
        bug="append_slot shares the last block with one other sequence without copying",
    ),
    dict(
        file="block_manager.py",
        find="        return last.block_id, copy.block_id",
        replace="        return copy.block_id, last.block_id",
        bug="append_slot returns the copy as (dst, src)",
    ),
    dict(
        file="block_manager.py",
        find="        child.num_computed_tokens = parent.num_computed_tokens\n",
        replace="",
        bug="fork forgets the computed count (the child recomputes into shared blocks)",
    ),
    dict(
        file="block_manager.py",
        find="        for block_id in parent.block_table:\n            self.blocks[block_id].ref_count += 1\n",
        replace="",
        bug="fork shares blocks without counting the references",
    ),
    dict(
        file="block_manager.py",
        find="child.block_table = list(parent.block_table)",
        replace="child.block_table = parent.block_table",
        bug="fork aliases the parent's block table list",
    ),
    dict(
        file="block_manager.py",
        find="for i in range(seq.num_computed_tokens // bs):",
        replace="for i in range(seq.num_blocks_needed(bs)):",
        bug="cache_blocks hashes blocks that are not full or not computed yet",
    ),
    dict(
        file="block_manager.py",
        find="parent = self.blocks[seq.block_table[i - 1]].block_hash if i else None",
        replace="parent = None",
        bug="cache_blocks does not chain the hashes",
    ),
    dict(
        file="block_manager.py",
        find="            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])\n",
        replace="",
        bug="cache_blocks records the hash but not the tokens",
    ),
    dict(
        file="block_manager.py",
        find="self.hash_to_block_id.setdefault(block.block_hash, block.block_id)",
        replace="self.hash_to_block_id[block.block_hash] = block.block_id",
        bug="cache_blocks overwrites the entry of an identical cached block",
        equivalent="two blocks under one hash hold the same tokens and K/V; which of them a hit names changes no output",
    ),
    dict(
        file="block_manager.py",
        find="        for block_id in reversed(seq.block_table):",
        replace="        for block_id in seq.block_table:",
        bug="free returns a cached chain head first (its tail then outlives the head)",
    ),
    dict(
        file="block_manager.py",
        find="                if block.block_hash is None:\n                    self.free_queue.move_to_end(block_id, last=False)\n",
        replace="",
        bug="free puts uncached blocks at the tail (cached prefixes evicted first)",
    ),
    dict(
        file="block_manager.py",
        find="        seq.block_table = []\n",
        replace="",
        bug="free leaves the sequence's stale block table behind",
    ),
    dict(
        file="block_manager.py",
        find="            if block.ref_count == 0:\n                self.free_queue[block_id] = None",
        replace="            if block.ref_count <= 1:\n                self.free_queue[block_id] = None",
        bug="free returns a block to the queue while another sequence still shares it",
    ),
    # scheduler.py
    dict(
        file="scheduler.py",
        find="n = min(seq.num_tokens - seq.num_computed_tokens, budget)\n            out.seqs.append(seq)\n            out.num_tokens.append(n)\n            budget -= n\n            i += 1",
        replace="n = 1\n            out.seqs.append(seq)\n            out.num_tokens.append(n)\n            budget -= n\n            i += 1",
        bug="running sequences always get one token (an unfinished prefill chunk advances one token per step)",
    ),
    dict(
        file="scheduler.py",
        find="                victim = self.running[-1]",
        replace="                victim = self.running[0]",
        bug="preempts the oldest running sequence instead of the newest",
    ),
    dict(
        file="scheduler.py",
        find="            if seq.status is not Status.RUNNING:\n                break\n",
        replace="",
        bug="keeps scheduling a sequence it just preempted",
    ),
    dict(
        file="scheduler.py",
        find="len(self.running) < self.max_num_seqs and not out.preempted:",
        replace="len(self.running) < self.max_num_seqs:",
        bug="admits waiting sequences in a step that preempted",
    ),
    dict(
        file="scheduler.py",
        find="len(self.running) < self.max_num_seqs and not out.preempted:",
        replace="len(self.running) <= self.max_num_seqs and not out.preempted:",
        bug="max_num_seqs off by one",
    ),
    dict(
        file="scheduler.py",
        find="            n = min(seq.num_tokens - seq.num_computed_tokens, budget)\n            out.seqs.append(seq)\n            out.num_tokens.append(n)\n            budget -= n\n        return out",
        replace="            n = seq.num_tokens - seq.num_computed_tokens\n            out.seqs.append(seq)\n            out.num_tokens.append(n)\n            budget -= n\n        return out",
        bug="a new prefill ignores the token budget (no chunking)",
    ),
    dict(
        file="scheduler.py",
        find="            if not self.block_manager.can_allocate(seq):\n                break\n",
        replace="",
        bug="admits a sequence without checking there are blocks for it",
    ),
    dict(
        file="scheduler.py",
        find="        seq.num_computed_tokens = 0\n        seq.status = Status.WAITING",
        replace="        seq.status = Status.WAITING",
        bug="preempt keeps num_computed_tokens (no recompute after its blocks are freed)",
    ),
    dict(
        file="scheduler.py",
        find="        self.waiting.appendleft(seq)",
        replace="        self.waiting.append(seq)",
        bug="preempt puts the sequence at the back of the queue",
    ),
    dict(
        file="scheduler.py",
        find="        self.block_manager.free(seq)\n        seq.num_computed_tokens = 0",
        replace="        seq.num_computed_tokens = 0",
        bug="preempt does not free the sequence's blocks",
    ),
    dict(
        file="scheduler.py",
        find="        while i < len(self.running) and budget > 0:",
        replace="        while i < len(self.running):",
        bug="running sequences are scheduled past the token budget",
        equivalent="a sequence is admitted only while budget is left after everything running before it, and each takes at least one token, so the running list never outgrows the budget and the loop ends before it runs dry (argued, not proven; test_more_running_sequences_than_tokens_in_the_budget_wait_their_turn checks it)",
    ),
    # paged_attention.py
    dict(
        file="paged_attention.py",
        find="self.v[layer].view(-1, n_kv, d)[slot_mapping] = v",
        replace="self.v[layer].view(-1, n_kv, d)[slot_mapping] = k",
        bug="PagedKVCache.write stores keys as values",
    ),
    dict(
        file="paged_attention.py",
        find="return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]",
        replace="return [block_table[p // block_size] + p % block_size for p in range(start, end)]",
        bug="slot_mapping forgets to multiply the block id by block_size",
    ),
    dict(
        file="paged_attention.py",
        find="return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]",
        replace="return [block_table[p // block_size] * block_size + p % block_size for p in range(start + 1, end + 1)]",
        bug="slot_mapping off by one position",
    ),
    dict(
        file="paged_attention.py",
        find="mask = (key <= pos[:, :, None]) & (key < context_lens[:, None, None])",
        replace="mask = key < context_lens[:, None, None]",
        bug="paged_attention is not causal within a prefill chunk",
    ),
    dict(
        file="paged_attention.py",
        find="pos = context_lens[:, None] - query_lens[:, None] + torch.arange(Tq)",
        replace="pos = torch.arange(Tq).expand(B, Tq)",
        bug="paged_attention numbers chunk queries from 0, ignoring the cached context",
    ),
    dict(
        file="paged_attention.py",
        find="mask = (key <= pos[:, :, None]) & (key < context_lens[:, None, None])",
        replace="mask = key <= pos[:, :, None]",
        bug="paged_attention reads padded query rows past the context (no length mask)",
        equivalent="a real query sits at a position below its context length, so key <= position already keeps it inside; only padded query rows see further, and they are dropped",
    ),
    dict(
        file="paged_attention.py",
        find="qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], enable_gqa=n_heads != n_kv",
        replace="qp.transpose(1, 2), k.transpose(1, 2).repeat(1, n_heads // n_kv, 1, 1), v.transpose(1, 2).repeat(1, n_heads // n_kv, 1, 1), attn_mask=mask[:, None]",
        bug="paged_attention tiles GQA heads (head h reads kv head h % n_kv)",
    ),
    dict(
        file="paged_attention.py",
        find="for group, attend in ((query_lens == 1, _decode), (query_lens > 1, _attend)):",
        replace="for group, attend in ((query_lens >= 1, _attend),):",
        bug="equivalent: decodes and prefills attended in one padded group",
        equivalent="one padded group computes the same attention; the split only saves padding",
    ),
    dict(
        file="paged_attention.py",
        find="rows = torch.repeat_interleave(starts[b], query_lens[b]) + _offsets(query_lens[b])",
        replace="rows = torch.repeat_interleave(starts[b], query_lens[b])",
        bug="paged_attention's mixed batch sends every row of a chunk to its first query",
    ),
    # sampling.py
    dict(
        file="sampling.py",
        find="        return int(logits.argmax())\n    logits = logits.float() / params.temperature",
        replace="        return int(logits.float().flip(0).argmax().neg() + logits.numel() - 1)\n    logits = logits.float() / params.temperature",
        bug="greedy sample breaks ties toward the highest id",
    ),
    dict(
        file="sampling.py",
        find='logits = logits.masked_fill(logits < kth, float("-inf"))',
        replace='logits = logits.masked_fill(logits <= kth, float("-inf"))',
        bug="top-k keeps k - 1 tokens",
    ),
    dict(
        file="sampling.py",
        find="outside = torch.cumsum(probs, -1) - probs >= params.top_p",
        replace="outside = torch.cumsum(probs, -1) > params.top_p",
        bug="top-p drops the token that crosses the threshold",
    ),
    dict(
        file="sampling.py",
        find='logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))',
        replace='logits = sorted_logits.masked_fill(outside, float("-inf"))',
        bug="top-p forgets to unsort (returns the rank, not the token id)",
    ),
    dict(
        file="sampling.py",
        find="    if params.top_k > 0:\n        kth",
        replace="    if params.top_k > 1:\n        kth",
        bug="top_k = 1 treated as off",
    ),
    dict(
        file="sampling.py",
        find="return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))",
        replace="return int(torch.multinomial(torch.softmax(logits, -1), 1))",
        bug="sample ignores the request's generator (seed)",
    ),
    dict(
        file="sampling.py",
        find="return min(found) if found else None",
        replace="return found[0] if found else None",
        bug="find_stop returns the first listed stop, not the earliest in the text",
    ),
    dict(
        file="sampling.py",
        find="found = [i for i in (text.find(s) for s in stops) if i >= 0]",
        replace="found = [i for i in (text.find(s) for s in stops) if i > 0]",
        bug="find_stop misses a stop string at index 0",
    ),
    dict(
        file="sampling.py",
        find="held = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)",
        replace="held = max((k for s in stops for k in range(1, len(s) - 1) if text[:end].endswith(s[:k])), default=0)",
        bug="safe_length lets all but one char of a stop string reach the client",
    ),
    dict(
        file="sampling.py",
        find='    while end and text[end - 1] == "\\ufffd":\n        end -= 1\n',
        replace="",
        bug="safe_length streams a broken UTF-8 tail (U+FFFD)",
    ),
    dict(
        file="sampling.py",
        find="held = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)",
        replace="held = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[-k:])), default=0)",
        bug="safe_length holds back suffixes of the stop string instead of prefixes",
    ),
    dict(
        file="sampling.py",
        find="- params.presence_penalty * (counts > 0)",
        replace="- params.presence_penalty * counts",
        bug="apply_penalties charges the presence penalty once per occurrence",
    ),
    dict(
        file="sampling.py",
        find="params.frequency_penalty * counts",
        replace="params.frequency_penalty * (counts > 0)",
        bug="apply_penalties charges the frequency penalty once, however often the token occurs",
    ),
    dict(
        file="sampling.py",
        find="logits = logits - params.frequency_penalty * counts",
        replace="logits = logits + params.frequency_penalty * counts",
        bug="apply_penalties rewards frequent tokens (frequency penalty sign flipped)",
    ),
    dict(
        file="sampling.py",
        find="(counts > 0)",
        replace="(counts > 1)",
        bug="apply_penalties skips the presence penalty for a token seen once",
    ),
    dict(
        file="sampling.py",
        find="logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)",
        replace="logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)",
        bug="apply_penalties changes the caller's logits in place (the logprobs then report penalized values)",
    ),
    dict(
        file="sampling.py",
        find="logits[ids] += torch.tensor(",
        replace="logits[ids] -= torch.tensor(",
        bug="apply_penalties subtracts logit_bias",
    ),
    dict(
        file="sampling.py",
        find="    if params.logit_bias:\n",
        replace="    if False:\n",
        bug="apply_penalties ignores logit_bias",
    ),
    dict(
        file="sampling.py",
        find="logprobs = torch.log_softmax(logits.float(), dim=-1)",
        replace="logprobs = torch.log(torch.softmax(logits.float(), dim=-1))",
        bug="logprobs_of takes the log of a float32 softmax (-inf once it underflows)",
    ),
    dict(
        file="sampling.py",
        find="logprobs = torch.log_softmax(logits.float(), dim=-1)",
        replace="logprobs = torch.log_softmax(logits.float(), dim=0)",
        bug="logprobs_of normalizes over positions instead of the vocabulary",
    ),
    dict(
        file="sampling.py",
        find="logprobs = torch.log_softmax(logits.float(), dim=-1)",
        replace="logprobs = logits.float() - logits.float().max(-1, keepdim=True).values",
        bug="logprobs_of shifts by the max but never normalizes",
    ),
    dict(
        file="sampling.py",
        find="top = logprobs.topk(k, dim=-1)",
        replace="top = logits.topk(k, dim=-1)",
        bug="logprobs_of reports the top tokens' logits, not their logprobs",
    ),
    dict(
        file="sampling.py",
        find="top = logprobs.topk(k, dim=-1)",
        replace="top = logprobs.topk(k, dim=-1, largest=False)",
        bug="logprobs_of reports the least likely tokens",
    ),
    dict(
        file="sampling.py",
        find="logprobs.gather(1, token_ids[:, None])",
        replace="logprobs.gather(1, token_ids.roll(1)[:, None])",
        bug="logprobs_of pairs each row with the previous position's token",
    ),
    # async_engine.py (TODO functions submit, _loop, stream_events)
    dict(
        file="async_engine.py",
        find="        if self.num_waiting >= self.max_waiting:",
        replace="        if self.num_waiting > self.max_waiting:",
        bug="submit admits one request over max_waiting",
    ),
    dict(
        file="async_engine.py",
        find="        self.pending.append((prompt_ids, params, request_id))\n        self.wakeup.set()",
        replace="        self.pending.append((prompt_ids, params, request_id))",
        bug="submit does not wake the loop",
    ),
    dict(
        file="async_engine.py",
        find="            for request_id in self.aborts:\n                self.engine.abort(request_id)",
        replace="            for request_id in []:\n                self.engine.abort(request_id)",
        bug="the loop never applies aborts (blocks of gone clients leak)",
    ),
    dict(
        file="async_engine.py",
        find="                if out.finished:\n                    del self.queues[out.request_id]",
        replace="                if False:\n                    del self.queues[out.request_id]",
        bug="the loop keeps finished requests' queues forever",
    ),
    dict(
        file="async_engine.py",
        find="            if item.delta_text or finished:",
        replace="            if item.delta_text:",
        bug="stream_events drops the final chunk that carries only the finish reason",
    ),
    dict(
        file="async_engine.py",
        find="        if not finished:\n            core.abort(request_id)",
        replace="        pass",
        bug="stream_events does not abort when the client disconnects",
    ),
    dict(
        file="async_engine.py",
        find="        yield SSE_DONE",
        replace="        pass",
        bug="stream_events never sends [DONE]",
    ),
    dict(
        file="paged_attention.py",
        find="(torch.arange(K) < context_lens[:, None])",
        replace="(torch.arange(K) <= context_lens[:, None])",
        bug="paged_attention's decode path reads one slot past each shorter sequence's context",
    ),
    dict(
        file="paged_attention.py",
        find="n_kv, K = k_pool.shape[2], int(context_lens.max())",
        replace="n_kv, K = k_pool.shape[2], int(context_lens.max()) + 1",
        bug="paged_attention's decode path reads one unwritten slot past the longest context (unmasked alone)",
    ),
    # issue #37: edges (test_04_edges.py)
    dict(
        file="block_manager.py",
        find="for i in range(seq.num_computed_tokens // bs):",
        replace="for i in range(seq.num_tokens // bs):",
        bug="cache_blocks registers every full block of the prompt, computed or not (a request arriving mid-prefill hits empty K/V)",
    ),
    dict(
        file="sampling.py",
        find=(
            "    logits = logits.float() / params.temperature\n"
            "    if params.top_k > 0:\n"
            "        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]\n"
            '        logits = logits.masked_fill(logits < kth, float("-inf"))\n'
            "    if params.top_p < 1:\n"
            "        sorted_logits, order = torch.sort(logits, descending=True)\n"
            "        probs = torch.softmax(sorted_logits, -1)\n"
            "        outside = torch.cumsum(probs, -1) - probs >= params.top_p  # the mass before it already reaches top_p\n"
            '        logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))\n'
            "    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))"
        ),
        replace=(
            "    logits = logits.float()\n"
            "    if params.top_k > 0:\n"
            "        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]\n"
            '        logits = logits.masked_fill(logits < kth, float("-inf"))\n'
            "    if params.top_p < 1:\n"
            "        sorted_logits, order = torch.sort(logits, descending=True)\n"
            "        probs = torch.softmax(sorted_logits, -1)\n"
            "        outside = torch.cumsum(probs, -1) - probs >= params.top_p  # the mass before it already reaches top_p\n"
            '        logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))\n'
            "    return int(torch.multinomial(torch.softmax(logits / params.temperature, -1), 1, generator=generator))"
        ),
        bug="sample applies the temperature after top-p has chosen the nucleus",
    ),
    dict(
        file="sampling.py",
        find=(
            "    if params.top_k > 0:\n"
            "        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]\n"
            '        logits = logits.masked_fill(logits < kth, float("-inf"))\n'
            "    if params.top_p < 1:\n"
            "        sorted_logits, order = torch.sort(logits, descending=True)\n"
            "        probs = torch.softmax(sorted_logits, -1)\n"
            "        outside = torch.cumsum(probs, -1) - probs >= params.top_p  # the mass before it already reaches top_p\n"
            '        logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))\n'
        ),
        replace=(
            "    if params.top_p < 1:\n"
            "        sorted_logits, order = torch.sort(logits, descending=True)\n"
            "        probs = torch.softmax(sorted_logits, -1)\n"
            "        outside = torch.cumsum(probs, -1) - probs >= params.top_p  # the mass before it already reaches top_p\n"
            '        logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))\n'
            "    if params.top_k > 0:\n"
            "        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]\n"
            '        logits = logits.masked_fill(logits < kth, float("-inf"))\n'
        ),
        bug="sample measures the top-p mass over the whole vocabulary, before top-k",
    ),
    # The sampler at its bounds (issue 47): clients send top_k 100 or 1,000 whatever the vocabulary.
    dict(
        file="sampling.py",
        find="kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]",
        replace="kth = torch.topk(logits, params.top_k).values[-1]",
        bug="sample assumes top_k is at most the vocabulary (topk raises for top_k 1,000 on a small one)",
    ),
    dict(
        file="sampling.py",
        find="kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]",
        replace="kth = torch.topk(logits, min(params.top_k, logits.numel() - 1)).values[-1]",
        bug="sample clamps a top_k past the vocabulary to V - 1, dropping the least likely token",
    ),
    dict(
        file="sampling.py",
        find="outside = torch.cumsum(probs, -1) - probs >= params.top_p",
        replace="outside = torch.cumsum(probs, -1) - probs > params.top_p",
        bug="top-p keeps a token whose preceding mass already equals top_p (> for >=: not the smallest set)",
    ),
]
