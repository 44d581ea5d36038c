"""CLIP's evaluation: retrieval on the held-out pairs (image->text and text->image recall@1/5/10)
and zero-shot classification. Captions with identical tokens are indistinguishable, so any of them
counts as a hit (with unique captions this is the usual index match; with captions built from class
names it is class retrieval). Each zero-shot class's text embedding is the normalized mean of its
prompts' normalized embeddings (CLIP's recipe). Every rank encodes its shard; the strategy's
collectives put the numbers together."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.tokenizer import tokenize
from .base import padding_forwards

RECALL_K = (1, 5, 10)


def recall_at_k(
    img: torch.Tensor, txt: torch.Tensor, caption_ids: torch.Tensor, ks=RECALL_K, chunk: int = 1024
) -> dict:
    """img, txt: [N, E] normalized features of N pairs; caption_ids [N]: equal ids = same caption.
    Returns {'i2t_r1': ..., 't2i_r1': ..., ...} as fractions. Queries go in chunks of `chunk` rows,
    so memory stays O(chunk * N) for large held-out sets."""
    img, txt = img.float(), txt.float()
    out = {}
    for name, queries, keys in (("i2t", img, txt), ("t2i", txt, img)):
        ranks = []
        for lo in range(0, len(queries), chunk):
            s = queries[lo : lo + chunk] @ keys.T  # [c, N]
            pos = caption_ids[lo : lo + chunk, None] == caption_ids[None, :]  # [c, N] positives
            # rank of the best positive = the number of items scoring strictly higher than it
            best = s.masked_fill(~pos, float("-inf")).max(dim=1, keepdim=True).values
            ranks.append((s > best).sum(dim=1))
        rank = torch.cat(ranks)
        for k in ks:
            out[f"{name}_r{k}"] = (rank < k).double().mean().item()
    return out


def caption_ids(tokens: torch.Tensor) -> torch.Tensor:
    """[N, L] token rows -> [N] ids, equal exactly where the rows are equal."""
    return torch.unique(tokens, dim=0, return_inverse=True)[1]


@torch.no_grad()
def encode(model, loader, autocast, prepare, batches: int, pairs: bool):
    """This rank's shard: (image features, text features or None, tokens or labels).
    `batches`: run at least this many forwards (sharded engines need every rank in every
    forward): past the end of the shard, forwards of one sample whose outputs are dropped
    (never an empty batch: flash attention on older torch refuses a batch of 0)."""

    def encode(b):
        with autocast():
            return model(prepare(b[0]), b[1] if pairs else None)

    img, txt, second, first, n = [], [], [], None, 0
    for n, b in enumerate(loader.iterate(), 1):  # noqa: B007 - n is read after the loop
        first = first or b
        i, t, _ = encode(b)
        img.append(i.float().cpu())
        if pairs:
            txt.append(t.float().cpu())
        second.append(b[1].cpu())
    padding_forwards(loader, first, batches - n, encode)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)  # noqa: E731
    return cat(img), cat(txt), cat(second)


@torch.no_grad()
def evaluate_clip(s, data, prompt_templates: str, context_length: int) -> dict:
    """Metrics over the whole held-out set and every zero-shot set (all ranks get them):
    retrieval on the held-out pairs, zero-shot accuracy with clip.prompt_templates' prompts."""
    model = s.eval_module()
    was_training = model.training
    model.eval()
    out = {}
    batches = max(s.gather_objects(len(data.test)))
    if batches:
        pad = batches if s.forward_is_collective else 0
        parts = s.gather_dp(encode(model, data.test, s.autocast, s.prepare, pad, True))
        parts = [p for p in parts if len(p[0])]
        img, txt = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        width = max(p[2].shape[1] for p in parts)
        toks = torch.cat([F.pad(p[2], (0, width - p[2].shape[1])) for p in parts])
        r = recall_at_k(img, txt, caption_ids(toks))
        out["retrieval_r1"] = (r["i2t_r1"] + r["t2i_r1"]) / 2
        out.update({f"test_{k}": v for k, v in r.items()})
        out["test_pairs"] = len(img)
    for name, zs in getattr(data, "zeroshot", {}).items():
        out.update(zeroshot(s, model, name, zs, prompt_templates, context_length))
    model.train(was_training)
    return out


def zeroshot(s, model, name: str, zs, prompt_templates: str, context_length: int) -> dict:
    """Top-1 / top-5 accuracy of zero-shot set `name` (every rank gets the counts summed)."""
    templates = zs.templates if prompt_templates == "default" else ["a photo of a {}."]
    prompts = [t.format(c) for c in zs.class_names for t in templates]
    tokens = tokenize(prompts, context_length).to(s.device)
    with s.autocast():
        _, txt, _ = model(None, tokens)
    classes = F.normalize(txt.float().view(len(zs.class_names), len(templates), -1).mean(1), dim=-1)
    batches = max(s.gather_objects(len(zs.loader))) if s.forward_is_collective else 0
    img, _, labels = encode(model, zs.loader, s.autocast, s.prepare, batches, False)
    k = min(5, len(zs.class_names))
    hits = [0, 0]
    if len(labels):  # (a rank whose shard is empty ran no forward)
        top = (img @ classes.cpu().T).topk(k, dim=1).indices  # [n, k]
        hit = top == labels[:, None]
        hits = [hit[:, 0].sum().item(), hit.any(1).sum().item()]
    counts = torch.tensor([*hits, len(labels)], dtype=torch.float64, device=s.device)
    c1, c5, n = s.all_reduce_dp(counts).tolist()
    return {
        f"zeroshot_{name}_top1": c1 / max(1, n),
        f"zeroshot_{name}_top5": c5 / max(1, n),
        f"zeroshot_{name}_count": int(n),
    }
