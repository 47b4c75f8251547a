"""The lab's JSON report, its text table and its PNG figures (matplotlib, the ``lab`` extra)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# Required keys of the report and of each arch / arm row (tests/fidelity checks them).
REPORT_KEYS = ("schema", "command", "config", "arches", "notes")
ARCH_KEYS = (
    "arch",
    "n_items",
    "layers",
    "canonical_bytes",
    "flip_rate_blind",
    "energy_by_rank",
    "arms",
    "seconds",
)
ARM_KEYS = (
    "arm",
    "family",
    "kl",
    "eta",
    "eta_vs_relocate",
    "flip_recover",
    "flip_recover_vs_relocate",
    "extra_bytes",
    "stored_bytes",
    "extra_tokens",
    "kv_rel_err_by_layer",
)


def method_of(arm: str) -> str:
    """Group label of an arm for the plots: patch@8 -> patch, cacheblend@5% -> cacheblend."""
    base = arm.split("@")[0]
    return base.split("-")[0] if base.startswith(("mpic-", "epic-")) else base


def validate(report: dict[str, Any]) -> list[str]:
    """Missing keys / bad values of a report (empty: well-formed)."""
    errs = [f"report.{k}" for k in REPORT_KEYS if k not in report]
    for a in report.get("arches", []):
        errs += [f"{a.get('arch')}.{k}" for k in ARCH_KEYS if k not in a]
        for r in a.get("arms", []):
            errs += [f"{a.get('arch')}.{r.get('arm')}.{k}" for k in ARM_KEYS if k not in r]
            if len(r.get("kv_rel_err_by_layer", [])) != a.get("layers"):
                errs.append(f"{a.get('arch')}.{r.get('arm')}.kv_rel_err_by_layer length")
    return errs


def _fmt(x: Any, spec: str = ".3f") -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else format(x, spec)
    return str(x)


def table(report: dict[str, Any], markdown: bool = False) -> str:
    cols = [
        "arm",
        "KL",
        "eta",
        "eta_reloc",
        "flip_rec",
        "extra_bytes%",
        "extra_tok%",
        "patch_eta@bytes",
    ]
    lines = []
    for a in report["arches"]:
        has_acc = any("accuracy" in r for r in a["arms"])
        head = cols + (["acc"] if has_acc else [])
        rows = []
        for r in a["arms"]:
            row = [
                r["arm"],
                _fmt(r["kl"], ".3g"),
                _fmt(r["eta"]),
                _fmt(r["eta_vs_relocate"]),
                _fmt(r["flip_recover"], ".2f"),
                _fmt(100 * r["extra_bytes"] / a["canonical_bytes"], ".1f"),
                _fmt(100 * r["extra_tokens"] / max(1e-9, a["reused_tokens"]), ".1f"),
                _fmt(r["patch_eta_at_same_bytes"]) if r["family"] == "token" else "-",
            ]
            if has_acc:
                row.append(_fmt(r.get("accuracy", float("nan")), ".3f"))
            rows.append(row)
        title = (
            f"{a['arch']}: {a['n_items']} items, {a['chunks']} chunks, {a['reused_tokens']:.0f} reused tokens, "
            f"blind flips {a['n_flipped_blind']}/{a['n_items']}, {a['seconds']} s"
        )
        if markdown:
            lines += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
        else:
            widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
            lines.append(title)
            lines += [
                "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                for line in [head, *rows]
            ]
        lines.append("")
    return "\n".join(lines)


COLORS = {
    "patch": "C0",
    "patch-deep": "C9",
    "cacheblend": "C1",
    "vlcache": "C2",
    "mpic": "C3",
    "epic": "C4",
    "mm-shiftkv": "C5",
    "kvcapsule": "C6",
    "relocate": "C7",
    "blind": "k",
    "ceiling": "C8",
}


def plots(report: dict[str, Any], out_dir: str | Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arches = report["arches"]
    files = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, a in enumerate(arches):
        pts = [
            (int(r["arm"].split("@")[1]), r["kl"])
            for r in a["arms"]
            if r["arm"].startswith("patch@") and r["arm"] != "patch@full"
        ]
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [max(p[1], 1e-9) for p in pts],
            "o-",
            color=f"C{i}",
            label=a["arch"],
        )
        reloc = next(r["kl"] for r in a["arms"] if r["arm"] == "relocate")
        ax.axhline(max(reloc, 1e-9), color=f"C{i}", ls=":", lw=1)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="patch rank m",
        ylabel="next-token KL to re-prefill",
        title="KL vs patch rank (dotted: relocate-only)",
    )
    ax.set_xticks([8, 16, 32, 64], ["8", "16", "32", "64"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, out / "kl_vs_rank.png"))

    n = len(arches)
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, a in zip(axes.flat, arches, strict=False):
        seen = set()
        for r in a["arms"]:
            m = method_of(r["arm"])
            if m in ("ceiling", "blind"):
                continue
            x = r["stored_bytes"] / a["canonical_bytes"]
            ax.scatter(
                x,
                max(r["eta"], -1.0),
                color=COLORS.get(m, "C7"),
                label=None if m in seen else m,
                s=22,
            )
            seen.add(m)
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.axvline(1.0, color="grey", lw=0.6)
        ax.set(
            xscale="log",
            xlabel="stored bytes / canonical chunk KV",
            ylabel="eta (clipped at -1)",
            title=a["arch"],
            ylim=(-1.05, 1.05),
        )
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        "eta vs bytes per method (token arms: byte-equivalent of recomputed rows)", fontsize=9
    )
    fig.tight_layout()
    files.append(_save(fig, out / "eta_vs_bytes.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, a in enumerate(arches):
        e = a["energy_by_rank"]
        ks = sorted(e, key=int)
        ax.plot([int(k) for k in ks], [e[k] for k in ks], "o-", color=f"C{i}", label=a["arch"])
    ax.set(
        xscale="log",
        xlabel="rank",
        ylabel="deficit energy captured",
        title="Deficit energy vs rank",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, out / "energy_vs_rank.png"))

    for a in arches:
        if not any("accuracy" in r for r in a["arms"]):
            continue
        arms = [r for r in a["arms"] if "accuracy" in r]
        qts = sorted(k.removeprefix("accuracy_") for k in arms[0] if k.startswith("accuracy_"))
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(arms)), 4))
        width = 0.8 / (len(qts) + 1)
        for j, key in enumerate(["accuracy", *[f"accuracy_{q}" for q in qts]]):
            xs = [i + (j - len(qts) / 2) * width for i in range(len(arms))]
            ax.bar(
                xs,
                [r[key] for r in arms],
                width,
                label="all" if key == "accuracy" else key.split("_")[1],
            )
        ax.set_xticks(
            range(len(arms)), [r["arm"] for r in arms], rotation=60, ha="right", fontsize=7
        )
        ax.set(ylabel="accuracy", title=f"{a['arch']} model: accuracy per arm", ylim=(0, 1))
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(_save(fig, out / f"accuracy_{a['arch']}.png"))
    return files


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
