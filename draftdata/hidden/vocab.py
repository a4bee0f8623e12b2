"""The draft vocabulary mapping (d2t, t2d) from the loss-masked token counts, as each trainer computes it.

Both keep the `n` most frequent trained tokens, sorted by id: d2t[i] = (the draft's token i's target id) - i (int64
[n]) and t2d[t] = whether target token t is in the draft vocabulary (bool [vocab]). They differ only in how a tie at
the cut is broken, so each is reproduced exactly:
- speculators 0.9.0 (speculators/train/vocab_mapping.py `build_vocab_mappings_from_distribution`): by count, then
  the lower token id; fewer than `n` tokens seen: the lowest ids not seen fill up.
- SpecForge 0.2.0 (specforge/data/preprocessing.py `process_token_dict_to_mappings`): `Counter.most_common`, whose
  ties keep the Counter's insertion order: the order its counter met the tokens (files by sorted path for offline
  features, training/vocab_mapping.py `count_effective_feature_tokens`; rows in order for a dataset,
  `generate_vocab_mapping_file`), a sample's new tokens by ascending id (`unique`); fewer than `n` seen: ids below
  `n` not seen are added with count 0.
"""

from __future__ import annotations

from collections import Counter


def mapping(selected: list[int], n: int, vocab: int):
    import torch

    used = sorted(selected)
    d2t = torch.tensor(used, dtype=torch.int64) - torch.arange(n, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def speculators_mapping(freq: Counter, n: int, vocab: int):
    chosen = sorted(freq, key=lambda t: (-freq[t], t))[:n]
    taken = set(chosen)
    return mapping(chosen + [t for t in range(n) if t not in taken][: n - len(chosen)], n, vocab)


def specforge_mapping(freq: Counter, first_seen: dict, n: int, vocab: int):
    """`first_seen[t]`: where SpecForge's counter first meets token t (a sortable key); ties go to the earlier."""
    chosen = sorted(freq, key=lambda t: (-freq[t], first_seen[t], t))[:n]
    # its fill-up walks `set(range(n)) - seen` in the set's own order (not always ascending): the same expression
    # walks it the same way
    for t in set(range(n)) - set(freq):
        if len(chosen) >= n:
            break
        chosen.append(t)
    return mapping(chosen, n, vocab)
