"""Stage 06 part 2 learner bugs, one edit each, planted in solutions/stage06_speculative (see labkit/grading/mutants.py)."""

MUTANTS = [
    # batch_verify.py: verify_batch
    dict(
        file="batch_verify.py",
        find="chunks = [t[store.length(s) :] + d for s, t, d in zip(seq_ids, tokens, drafts, strict=True)]",
        replace="chunks = [t[-1:] + d for s, t, d in zip(seq_ids, tokens, drafts, strict=True)]",
        bug="verify_batch feeds only the last token (forgets the unread tokens of a new or preempted sequence)",
    ),
    dict(
        file="batch_verify.py",
        find="scores = logits[i][-(k + 1) :]",
        replace="scores = logits[i][: k + 1]",
        bug="verify_batch scores the first k + 1 rows of the chunk, not the last (wrong when the chunk has unread tokens)",
    ),
    dict(
        file="batch_verify.py",
        find="            while n < k and drafted[n] == choice[n]:\n                n += 1\n",
        replace="            n = sum(d == c for d, c in zip(drafted, choice))\n",
        bug="verify_batch (greedy) counts matching drafts anywhere, not the leading run",
    ),
    dict(
        file="batch_verify.py",
        find="new.append(drafted[:n] + [choice[n]])",
        replace="new.append(drafted[:n] + ([choice[n]] if n < k else []))",
        bug="verify_batch (greedy) forgets the bonus token when every draft is accepted",
    ),
    dict(
        file="batch_verify.py",
        find="new.append(drafted[:n] + [choice[n]])",
        replace="new.append(drafted[:n] + [choice[max(n - 1, 0)]])",
        bug="verify_batch (greedy) takes the replacement token from the last accepted draft's row",
    ),
    dict(
        file="batch_verify.py",
        find="store.truncate(sid, len(toks) + n)",
        replace="store.truncate(sid, len(toks) + n + 1)",
        bug="verify_batch keeps the first rejected draft's K/V in the store",
    ),
    dict(
        file="batch_verify.py",
        find="store.truncate(sid, len(toks) + n)",
        replace="store.truncate(sid, len(toks) + n - 1)",
        bug="verify_batch rolls back one position too many (loses the last accepted token's K/V)",
    ),
    dict(
        file="batch_verify.py",
        find="        store.truncate(sid, len(toks) + n)\n",
        replace="",
        bug="verify_batch never rolls back: rejected drafts keep their K/V and blocks",
    ),
    dict(
        file="batch_verify.py",
        find="p = warp(scores, temperature, top_p)",
        replace="p = warp(scores, temperature)",
        bug="verify_batch (sampled) ignores top_p for the target distribution",
    ),
    dict(
        file="batch_verify.py",
        find="p = warp(scores, temperature, top_p)",
        replace="p = warp(scores, 1.0, top_p)",
        bug="verify_batch (sampled) ignores the temperature for the target distribution",
    ),
    dict(
        file="batch_verify.py",
        find="u = torch.rand(k, generator=generator)",
        replace="u = torch.rand(k)",
        bug="verify_batch (sampled) draws the uniforms without the generator",
    ),
    dict(
        file="batch_verify.py",
        find="new.append(drafted[:n] + [sample(dist, generator)])",
        replace="new.append(drafted[:n] + [sample(p[n], generator)])",
        bug="verify_batch (sampled) resamples from p instead of the residual accept_reject returns",
    ),
    dict(
        file="batch_verify.py",
        find="u = torch.rand(k, generator=generator)",
        replace="u = torch.rand(k + 1, generator=generator)[:k]",
        bug="verify_batch (sampled) draws k + 1 uniforms per sequence (the documented draws drift)",
    ),
    dict(
        file="batch_verify.py",
        find="new.append(drafted[:n] + [sample(dist, generator)])",
        replace="new.append(drafted[:n] + [int(dist.argmax())])",
        bug="verify_batch (sampled) takes the argmax of the next-token distribution instead of sampling it",
    ),
    # batch_verify.py: choose_k
    dict(
        file="batch_verify.py",
        find="step = k * costs.draft(batch_size) + costs.target(batch_size, k + 1)",
        replace="step = k * costs.draft(batch_size) + costs.target(batch_size, k)",
        bug="choose_k prices the verify pass at k tokens, forgetting the bonus position",
    ),
    dict(
        file="batch_verify.py",
        find="step = k * costs.draft(batch_size) + costs.target(batch_size, k + 1)",
        replace="step = costs.draft(batch_size) + costs.target(batch_size, k + 1)",
        bug="choose_k charges one draft forward whatever k",
    ),
    dict(
        file="batch_verify.py",
        find="step = k * costs.draft(batch_size) + costs.target(batch_size, k + 1)",
        replace="step = k * costs.draft(1) + costs.target(batch_size, k + 1)",
        bug="choose_k prices the draft forward at batch 1",
    ),
    dict(
        file="batch_verify.py",
        find="return expected_tokens_per_step(alpha, k) * plain / step",
        replace="return (expected_tokens_per_step(alpha, k) - 1) * plain / step",
        bug="choose_k counts only the accepted drafts, not the target's own token",
    ),
    dict(
        file="batch_verify.py",
        find="return max(range(k_max + 1), key=lambda k: (speedup(k), -k))",
        replace="return max(range(1, k_max + 1), key=lambda k: (speedup(k), -k))",
        bug="choose_k never answers 0 (always speculates)",
    ),
    dict(
        file="batch_verify.py",
        find="return max(range(k_max + 1), key=lambda k: (speedup(k), -k))",
        replace="return max(range(k_max + 1), key=lambda k: (speedup(k), k))",
        bug="choose_k breaks ties towards the largest k",
    ),
    # medusa.py: candidate_tree
    dict(
        file="medusa.py",
        find="tokens = [root] + [int(ranked[len(p) - 1, p[-1]]) for p in paths]",
        replace="tokens = [root] + [int(ranked[len(p) - 1, p[0]]) for p in paths]",
        bug="candidate_tree takes the first rank of the path instead of its last",
    ),
    dict(
        file="medusa.py",
        find="ranked = head_logits.topk(max(p[-1] for p in paths) + 1, dim=-1).indices",
        replace="ranked = head_logits.argsort(dim=-1)",
        bug="candidate_tree ranks the heads' guesses in ascending order (rank 0 = least likely)",
    ),
    dict(
        file="medusa.py",
        find="parents = [-1] + [index[p[:-1]] for p in paths]",
        replace="parents = [-1] + [len(p) - 1 for p in paths]",
        bug="candidate_tree uses the parent's depth as its node index",
    ),
    dict(
        file="medusa.py",
        find="depths = [0] + [len(p) for p in paths]",
        replace="depths = list(range(len(paths) + 1))",
        bug="candidate_tree gives each node its index as depth",
    ),
    # medusa.py: tree_attention_mask
    dict(
        file="medusa.py",
        find="mask[i] |= mask[parents[i]]",
        replace="mask[i, parents[i]] = True",
        bug="tree_attention_mask lets a node see its parent but not the ancestors above it",
    ),
    dict(
        file="medusa.py",
        find="mask = torch.eye(N, dtype=torch.bool)",
        replace="mask = torch.ones(N, N, dtype=torch.bool).tril()",
        bug="tree_attention_mask is a causal mask: a node sees its siblings and cousins too",
    ),
    dict(
        file="medusa.py",
        find="mask = torch.eye(N, dtype=torch.bool)",
        replace="mask = torch.zeros(N, N, dtype=torch.bool)",
        bug="tree_attention_mask forgets that a node attends to itself",
    ),
    dict(
        file="medusa.py",
        find="        mask[i] |= mask[parents[i]]  # the parent's row already holds every ancestor\n    return mask",
        replace="        mask[i] |= mask[parents[i]]\n    return mask.T",
        bug="tree_attention_mask is transposed: a node sees its descendants instead of its ancestors",
    ),
    # medusa.py: verify_tree
    dict(
        file="medusa.py",
        find="positions = L + torch.tensor(depths)",
        replace="positions = L + torch.arange(len(depths))",
        bug="verify_tree places the nodes at tree-order positions, not prefix + depth",
    ),
    dict(
        file="medusa.py",
        find="positions = L + torch.tensor(depths)",
        replace="positions = torch.tensor(depths)",
        bug="verify_tree forgets the prefix length in the positions",
    ),
    dict(
        file="medusa.py",
        find="prefix = torch.ones(len(parents), L, dtype=torch.bool)",
        replace="prefix = torch.zeros(len(parents), L, dtype=torch.bool)",
        bug="verify_tree's mask hides the cached prefix from the tree",
    ),
    dict(
        file="medusa.py",
        find="mask = torch.cat([prefix, tree_attention_mask(parents)], dim=1)",
        replace="mask = torch.cat([tree_attention_mask(parents), prefix], dim=1)",
        bug="verify_tree puts the tree's mask columns before the prefix's",
    ),
    # medusa.py: accept_path
    dict(
        file="medusa.py",
        find="int(tokens[i]) == choice[path[-1]]]",
        replace="int(tokens[i]) == choice[i]]",
        bug="accept_path compares a node with the target's argmax after the node itself, not after its parent",
    ),
    dict(
        file="medusa.py",
        find="            return path, choice[path[-1]]\n",
        replace="            return path, int(tokens[path[-1]])\n",
        bug="accept_path returns the last accepted token again instead of the target's next one",
    ),
    dict(
        file="medusa.py",
        find=(
            "    path = [0]\n    while True:\n"
            "        children = [i for i, p in enumerate(parents) if p == path[-1] and int(tokens[i]) == choice[path[-1]]]\n"
            "        if not children:\n            return path, choice[path[-1]]\n        path.append(children[0])\n"
        ),
        replace=(
            "    def up(i):\n        return [] if i < 0 else up(parents[i]) + [i]\n\n"
            "    ok = [i for i in range(len(parents)) if i == 0 or int(tokens[i]) == choice[parents[i]]]\n"
            "    last = max(ok, key=lambda i: len(up(i)))\n"
            "    return up(last), choice[last]\n"
        ),
        bug="accept_path takes the deepest node that matches its parent's argmax without checking its whole path",
    ),
    # medusa.py: commit_path
    dict(
        file="medusa.py",
        find="src = start + torch.tensor(path)",
        replace="src = torch.tensor(path)",
        bug="commit_path reads the node slots without the prefix offset",
    ),
    dict(
        file="medusa.py",
        find="k[:, :, dst] = k[:, :, src]",
        replace="k[:, :, src] = k[:, :, dst]",
        bug="commit_path copies the keys the wrong way (consecutive slots into the node slots)",
    ),
    dict(
        file="medusa.py",
        find="        v[:, :, dst] = v[:, :, src]\n",
        replace="",
        bug="commit_path moves the keys but not the values",
    ),
    dict(
        file="medusa.py",
        find="cache.truncate(start + len(path))",
        replace="cache.truncate(start + path[-1] + 1)",
        bug="commit_path truncates after the last accepted node's old slot, keeping rejected nodes",
    ),
    # eagle.py: draft_forward
    dict(
        file="eagle.py",
        find="cos, sin = head.target[0].rope(L, T)",
        replace="cos, sin = head.target[0].rope(0, T)",
        bug="draft_forward rotates every chunk from position 0, not from the draft cache's length",
    ),
    dict(
        file="eagle.py",
        find="x = head.layer(x, cos, sin, causal_mask(L, T), cache, 0)[0]",
        replace="x = head.layer(x, cos, sin, None, cache, 0)[0]",
        bug="draft_forward has no causal mask: a chunk's positions see the ones after them",
    ),
    dict(
        file="eagle.py",
        find="x = head.fc(torch.cat([feats, head.embed(next_ids)], dim=-1))[None]",
        replace="x = head.fc(torch.cat([head.embed(next_ids), feats], dim=-1))[None]",
        bug="draft_forward concatenates the token embedding before the feature (fc was trained the other way)",
    ),
    dict(
        file="eagle.py",
        find="    cache.length += T\n    logits = torch.full",
        replace="    logits = torch.full",
        bug="draft_forward writes the cache but never advances its length",
    ),
    dict(
        file="eagle.py",
        find="logits[:, head.vocab] = head.lm_head(x).float()",
        replace="logits[:, : len(head.vocab)] = head.lm_head(x).float()",
        bug="draft_forward takes the reduced head's row index for the token id",
    ),
    # eagle.py: propose
    dict(
        file="eagle.py",
        find="feat, logits = feats[-1], logits[-1]",
        replace="feat, logits = feats[0], logits[0]",
        bug="propose drafts from the first pending position's prediction, not the last",
    ),
    dict(
        file="eagle.py",
        find="draft_forward(head, cache, feat[None], torch.tensor(drafted[-1:]))",
        replace="draft_forward(head, cache, feats[-1:], torch.tensor(drafted[-1:]))",
        bug="propose feeds back the first predicted feature at every step, not the latest",
    ),
    dict(
        file="eagle.py",
        find="draft_forward(head, cache, feat[None], torch.tensor(drafted[-1:]))",
        replace="draft_forward(head, cache, feat[None], torch.tensor(drafted[:1]))",
        bug="propose feeds back the first drafted token at every step",
    ),
    dict(
        file="eagle.py",
        find="            q.append(warp(logits, temperature, top_p))\n            drafted.append(sample(q[-1], generator))",
        replace="            q.append(torch.softmax(logits, -1))\n            drafted.append(sample(warp(logits, temperature, top_p), generator))",
        bug="propose samples from the warped distribution but hands the verification the unwarped one",
    ),
    dict(
        file="eagle.py",
        find="        confidence *= float(torch.softmax(logits, -1)[drafted[-1]])",
        replace="        confidence = float(torch.softmax(logits, -1)[drafted[-1]])",
        bug="propose stops on the last draft's own probability, not the running product (EAGLE-2's confidence)",
    ),
    dict(
        file="eagle.py",
        find="        confidence *= float(torch.softmax(logits, -1)[drafted[-1]])",
        replace="        confidence *= float(q[-1][drafted[-1]])",
        bug="propose measures confidence on q, a one-hot at temperature 0, so the threshold never stops it",
    ),
    dict(
        file="eagle.py",
        find="        confidence *= float(torch.softmax(logits, -1)[drafted[-1]])\n        if i == k - 1 or confidence < threshold:",
        replace="        if i == k - 1 or confidence < threshold:\n            break\n        confidence *= float(torch.softmax(logits, -1)[drafted[-1]])\n        if False:",
        bug="propose checks the confidence before the newest draft's probability, one draft late",
    ),
    # eagle.py: verify
    dict(
        file="eagle.py",
        find="return drafted[:n] + [nxt], feats[: n + 1]",
        replace="return drafted[:n] + [nxt], feats[1 : n + 2]",
        bug="verify hands back the features one position late",
    ),
    dict(
        file="eagle.py",
        find="cache.truncate(len(tokens) + n)\n    return drafted[:n] + [nxt]",
        replace="cache.truncate(len(tokens) + n + 1)\n    return drafted[:n] + [nxt]",
        bug="verify keeps the first rejected draft's K/V in the target's cache",
    ),
    dict(
        file="eagle.py",
        find="        while n < k and drafted[n] == choice[n]:\n            n += 1\n        nxt",
        replace="        n = sum(d == c for d, c in zip(drafted, choice))\n        nxt",
        bug="verify (greedy) counts matching drafts anywhere, not the leading run",
    ),
    dict(
        file="eagle.py",
        find="n, dist = accept_reject(warp(logits, temperature, top_p), q,",
        replace="n, dist = accept_reject(torch.softmax(logits, -1), q,",
        bug="verify (sampled) compares with the target's unwarped distribution",
    ),
]
