"""PNG figures for ``kvconvert analyze`` (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def plot_spectra(analysis: dict[str, Any], path: Path) -> None:
    """σ_i/σ_1 of W_K and W_V per layer, shallow layers dark, deep layers light."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    layers = analysis["layers"]
    cmap = plt.get_cmap("viridis")
    for ax, side, title in ((axes[0], "k", "W_K"), (axes[1], "v", "W_V")):
        for row in layers:
            svals = row[f"singular_values_{side}"]
            ax.semilogy(range(1, len(svals) + 1), [s / svals[0] for s in svals],
                        color=cmap(row["layer"] / max(1, len(layers) - 1)), lw=1)  # fmt: skip
        ax.set_title(f"{title} spectra (colour = layer, dark = shallow)")
        ax.set_xlabel("singular value index")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("σ_i / σ_1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_condition(analysis: dict[str, Any], path: Path) -> None:
    """κ(W_K), κ(W_V) per layer and the cumulative log10 κ̃ of LoRC eq. 12."""
    plt = _pyplot()
    layers = analysis["layers"]
    x = [r["layer"] for r in layers]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.semilogy(x, [r["kappa_k"] for r in layers], "o-", label="κ(W_K)")
    ax.semilogy(x, [r["kappa_v"] for r in layers], "s-", label="κ(W_V)")
    ax.set_xlabel("layer")
    ax.set_ylabel("condition number")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(x, [r["log10_kappa_cum"] for r in layers], "k--", label="log10 κ̃ (cumulative)")
    twin.set_ylabel("log10 κ̃")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="upper right")
    ax.set_title("Condition numbers per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ranks(analysis: dict[str, Any], path: Path) -> None:
    """LoRC's per-layer ranks, progressive (solid) vs uniform (dashed), at each budget; with
    ``analysis["lorc_auto"]`` also auto's K (circles) and V (squares) ranks, dotted; with
    ``analysis["lorc_joint"]`` the joint latent's rank per layer (triangles, dash-dotted)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    colours = plt.get_cmap("tab10")
    budgets = sorted({key.split("@")[1] for key in analysis["lorc_rank_plans"]}, reverse=True)
    for i, budget in enumerate(budgets):
        for schedule, style in (("progressive", "-"), ("uniform", "--")):
            ranks = analysis["lorc_rank_plans"].get(f"{schedule}@{budget}")
            if ranks is not None:
                ax.plot(range(len(ranks)), ranks, style, color=colours(i), label=f"{schedule} @ {budget}")
    for i, (budget, plan) in enumerate(analysis.get("lorc_auto", {}).items()):
        colour = colours(len(budgets) + i)
        for side, marker in (("k", "o"), ("v", "s")):
            ranks = [analysis["kv_width"] if r is None else r for r in plan[f"rank_{side}"]]
            ax.plot(range(len(ranks)), ranks, ":", marker=marker, ms=3, color=colour,
                    label=f"auto {side.upper()} @ {budget}")  # fmt: skip
    shown = len(budgets) + len(analysis.get("lorc_auto", {}))
    for i, (budget, plan) in enumerate(analysis.get("lorc_joint", {}).items()):
        ranks = [2 * analysis["kv_width"] if r is None else r for r in plan["rank_k"]]
        ax.plot(range(len(ranks)), ranks, "-.", marker="^", ms=3, color=colours(shown + i),
                label=f"joint K+V latent @ {budget}")  # fmt: skip
    ax.axhline(analysis["kv_width"], color="grey", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("rank")
    ax.set_title("LoRC rank plans: K and V alike by κ; auto per side by measured loss (grey: full width)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_zack_allocation(result: dict[str, Any], path: Path) -> None:
    """ZACK ``--schedule auto``'s widths as heat maps (layers × KV heads), K and V side by side, one row
    per budget; the colour scale is the head dimension (full width) down to zero."""
    plt = _pyplot()
    rows = len(result)
    layers = len(next(iter(result.values()))["rank_k"])
    fig, axes = plt.subplots(rows, 2, figsize=(8, rows * (0.22 * layers + 1.6)), squeeze=False)
    for row, (budget, plan) in enumerate(result.items()):
        for ax, side in zip(axes[row], ("k", "v"), strict=True):
            title = f"{side.upper()} widths @ {budget} (achieved {plan['budget']:.3f})"
            _heat_map(fig, ax, plan[f"rank_{side}"], title, "KV head", cmap="viridis", vmin=0, vmax=plan["head_dim"])
            ax.title.set_fontsize(9)
            ax.set_xticks(range(len(plan[f"rank_{side}"][0])))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _heat_map(fig: Any, ax: Any, data: Any, title: str, xlabel: str, **imshow: Any) -> None:
    """One layers × heads heat map with its colour bar."""
    image = ax.imshow(data, aspect="auto", origin="upper", **imshow)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    fig.colorbar(image, ax=ax, fraction=0.046)


def plot_head_scores(echo: list[list[float]], induction: list[list[float]], path: Path) -> None:
    """Heat maps (layers × heads) of RazorAttention's echo and induction scores."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.25 * len(echo) + 2.5))
    for ax, data, title in ((axes[0], echo, "echo score"), (axes[1], induction, "induction score")):
        _heat_map(fig, ax, data, title, "query head", cmap="magma")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layer_similarity(similarity: dict[str, Any], path: Path) -> None:
    """MiniCache fig. 1a for this model: mean per-token cosine of adjacent layers' K and V (all KV
    heads as one vector, per-head means as dots), and the share eq. 4 keeps unmerged at γ."""
    plt = _pyplot()
    pairs = similarity["pairs"]
    x = [p["layers"][1] for p in pairs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for side, colour in (("k", "tab:blue"), ("v", "tab:orange")):
        axes[0].plot(x, [p[f"cos_{side}"] for p in pairs], marker="o", color=colour, label=side.upper())
        for layer, p in zip(x, pairs, strict=True):
            heads = p[f"cos_{side}_heads"]
            axes[0].scatter([layer] * len(heads), heads, s=8, color=colour, alpha=0.35)
        axes[1].plot(x, [p[f"retained_{side}"] for p in pairs], marker="o", color=colour, label=side.upper())
    axes[0].axhline(0.0, color="grey", linewidth=0.8)
    axes[0].set_ylim(-1.05, 1.05)
    axes[0].set_title("cosine similarity of layer l-1 and l (dots: per KV head)")
    axes[1].set_title(f"tokens kept unmerged at γ = {similarity['gamma']}")
    for ax in axes:
        ax.set_xlabel("layer l")
        ax.legend()
    fig.suptitle(f"{similarity['calib']} · {similarity['tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
