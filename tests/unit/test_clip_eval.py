"""Retrieval recall@k against a naive sort-based reference, with unique and repeated captions."""

import torch

from vitscale.tasks.clip_eval import caption_ids, recall_at_k


def naive_recall(img, txt, cap, ks=(1, 5, 10)):
    sim = (img @ txt.T).tolist()
    out = {}
    for name, rows, same in (
        ("i2t", sim, lambda q, c: cap[q] == cap[c]),
        ("t2i", [list(col) for col in zip(*sim)], lambda q, c: cap[c] == cap[q]),
    ):
        for k in ks:
            hits = 0
            for q, row in enumerate(rows):
                order = sorted(range(len(row)), key=lambda c: -row[c])
                hits += any(same(q, c) for c in order[:k])
            out[f"{name}_r{k}"] = hits / len(rows)
    return out


def test_recall_matches_naive_reference_unique_and_repeated_captions():
    torch.manual_seed(0)
    n, d = 40, 8
    img = torch.nn.functional.normalize(torch.randn(n, d, dtype=torch.float64), dim=-1)
    txt = torch.nn.functional.normalize(img + 0.8 * torch.randn(n, d, dtype=torch.float64), dim=-1)
    for cap in (
        torch.arange(n),
        torch.arange(n) % 7,
    ):  # unique captions; 7 repeated "class" captions
        got, want = recall_at_k(img, txt, cap), naive_recall(img, txt, cap.tolist())
        assert got.keys() == want.keys()
        for k in want:
            assert abs(got[k] - want[k]) < 1e-12, (k, got[k], want[k])
        chunked = recall_at_k(img, txt, cap, chunk=7)  # queries in uneven chunks: the same numbers
        assert chunked == got
    # perfect features: every recall is 1
    assert set(recall_at_k(img, img, torch.arange(n)).values()) == {1.0}


def test_caption_ids_equal_exactly_for_equal_token_rows():
    t = torch.tensor([[1, 5, 2, 0], [1, 6, 2, 0], [1, 5, 2, 0], [1, 5, 2, 7]])
    ids = caption_ids(t)
    assert ids[0] == ids[2] and len({ids[0].item(), ids[1].item(), ids[3].item()}) == 3
