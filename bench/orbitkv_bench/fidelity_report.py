"""What ``bench fidelity`` prints and draws from a run's document: the table per arm and
operation (text or Markdown), the plot of agreement against tokens computed, and a saved run's
results recomputed from its per-step rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orbitkv_bench import fidelity_metrics as fm


def merged(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' documents as one: their steps together (runs of other seeds add questions).
    Runs of another model or other arms are refused."""
    first = docs[0]
    for d in docs[1:]:
        for key in ("model_fingerprint", "max_tokens", "window"):
            if d["config"][key] != first["config"][key]:
                raise ValueError(
                    f"runs differ in {key}: {first['config'][key]} vs {d['config'][key]}"
                )
        if d["arms"] != first["arms"]:
            raise ValueError("runs differ in their arms")
    if len(docs) == 1:
        return first
    # A document merged before brings its own runs.
    runs = [run for d in docs for run in d["config"].get("runs") or [
        {**{k: d["config"][k] for k in ("seed", "episodes", "steps_per_episode")},
         "first_episode": d["config"].get("first_episode", 0)}]]
    out = {**first, "steps": [s for d in docs for s in d["steps"]]}
    out["config"] = {**first["config"], "runs": runs, "episodes": sum(r["episodes"] for r in runs)}
    out.pop("partial", None)
    return out


def joined(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of other arms on the same questions, side by side: the questions every run asked (the
    same episode, step and question text), each with every run's arms. The reference must have
    answered each of them alike in every run (else the arms were not measured against one
    reference); an arm in several runs (exact, run as a control) is the first run's. The model fingerprint is not compared: it
    hashes the model's path, and runs of one checkpoint from two directories are one model; the
    reference's answers, all equal, are the check."""
    first = docs[0]
    for d in docs[1:]:
        for key in ("max_tokens", "window"):
            if d["config"][key] != first["config"][key]:
                raise ValueError(
                    f"runs differ in {key}: {first['config'][key]} vs {d['config'][key]}"
                )
    arms: dict[str, Any] = {}
    owner: dict[str, int] = {}  # an arm in several runs (exact, a control) is the first run's
    for i, d in enumerate(docs):
        for name, spec in d["arms"].items():
            if name in arms and arms[name] != spec:
                raise ValueError(f"arm {name} is another arm in run {i}")
            arms.setdefault(name, spec)
            owner.setdefault(name, i)

    def key(step: dict[str, Any]) -> tuple[Any, ...]:
        return step["episode"], step["index"], step["question"]["text"]

    by_run = [{key(s): s for s in d["steps"]} for d in docs]
    steps = []
    for k, step in by_run[0].items():
        if not all(k in run for run in by_run[1:]):
            continue
        rows = {
            name: row
            for i, run in enumerate(by_run)
            for name, row in run[k]["arms"].items()
            if owner[name] == i
        }
        references = {row["reference_answer"] for row in rows.values()}
        if len(references) > 1:
            raise ValueError(f"the reference answered {k} differently across runs: {references}")
        steps.append({**step, "arms": rows})
    config = {**first["config"], "joined": [d["config"] for d in docs]}
    return {"config": config, "arms": arms, "steps": steps}


def recomputed(doc: dict[str, Any]) -> dict[str, Any]:
    """A saved run's results from its per-step rows (so a report reflects today's metrics)."""
    rows = []
    for step in doc["steps"]:
        for arm, row in step["arms"].items():
            c = fm.Comparison.from_json(row)
            c.mode_tokens = fm.mode_tokens(doc["arms"][arm]["mode"], c.reused_by_mode)
            rows.append(c)
    return fm.frontier(rows)


def plot(doc: dict[str, Any], out_dir: Path) -> Path:
    """Agreement vs tokens computed per arm: over all questions, then per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ops = ["all"] + [
        op
        for op in ("slide", "reorder", "revisit", "recall")
        if any(op in r["by_op"] for r in doc["results"].values())
    ]
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3.8), sharey=True, squeeze=False)
    markers = "osD^v<>Ph*X"
    for ax, op in zip(axes[0], ops, strict=True):
        for i, (arm, res) in enumerate(doc["results"].items()):
            s = res["all"] if op == "all" else res["by_op"].get(op)
            if not s or s["tokens_computed_ratio"] is None or s["agreement"] is None:
                continue
            ax.scatter(
                s["tokens_computed_ratio"],
                s["agreement"],
                s=50,
                marker=markers[i % len(markers)],
                label=arm,
                color=f"C{i}",
            )
        ax.axhline(fm.BUDGET["min_agreement"], color="grey", linestyle="--", linewidth=1)
        ax.set_title(op)
        ax.set_xlim(-0.03, 1.05)
        ax.set_ylim(-0.03, 1.05)
        ax.set_xlabel("tokens computed / full prefill")
    axes[0][0].set_ylabel("greedy answer agreement")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"bench fidelity: {Path(doc['config']['model']).name}, "
        f"{doc['config']['max_tokens']}-token greedy answers vs a full prefill",
        fontsize=10,
    )
    path = out_dir / "fidelity.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


COLUMNS = (  # (title, summary key, decimals; None: an integer)
    ("n", "num_questions", None),
    ("served", "num_served", None),
    ("agree", "agreement", 2),
    ("2-hop", "agreement_two_hop", 2),
    ("agree served", "agreement_served", 2),
    ("top-1", "top1_agreement", 2),
    ("KL", "kl_mean", 4),
    ("acc", "accuracy", 2),
    ("ref acc", "reference_accuracy", 2),
    ("computed", "tokens_computed_ratio", 2),
    ("TTFT s", "ttft_p50_s", 2),
    ("ref TTFT s", "reference_ttft_p50_s", 2),
)


def format_table(doc: dict[str, Any], *, markdown: bool = False) -> str:
    """Per arm and operation (``all``: every question but the start step's); ``computed``: tokens
    computed over the full prefill's."""

    def cell(v: Any, p: int | None) -> str:
        return "-" if v is None else (str(v) if p is None else f"{v:.{p}f}")

    rows = [["arm", "op", *(t for t, _, _ in COLUMNS)]]
    for arm, res in doc["results"].items():
        for op, s in [("all", res["all"]), *res["by_op"].items()]:
            rows.append([arm, op, *(cell(s.get(k), p) for _, k, p in COLUMNS)])
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join([lines[0], "|" + "---|" * len(rows[0]), *lines[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        " ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )
