"""The benchmark's image side: scene prompts, grounded-token acceptance and the visual-token sweep of `laspec`
(used by the other benchmark modules, `bench.run`, `bench.stats` and `bench.report` among them; this module
imports none of them).

Grounded tokens: a scene's description names colours and shapes (`scenes.dataset.grounded_words`) that only the image
decides. A generated token is *grounded* when its decoded characters overlap such a word (whole words,
case-insensitive) in the decoded answer; every other token is *other*. For a speculative run at batch 1 each
token is either a drafted-and-accepted one or one the target made (the prefill token, and each round's bonus or
correction token), so the acceptance share of a class is ``accepted / tokens`` over that class: an image-blind
drafter should lose on grounded tokens and keep up on the others.

Visual-token sweep: ``--visual-tokens 0 1 2 4 8 16 64`` adds one method per M (``laspec_m8``, ...) that runs
strategy `laspec` with ``spec_config["num_visual_tokens"] = M``: M visual tokens selected per round for the
drafter's cross-attention (0: the visual branch off).
"""

from __future__ import annotations

import re
from typing import Callable, Optional


__all__ = [
    "SCENES",
    "SCENES_DEFAULT_LIMIT",
    "accepted_mask",
    "grounded_counts",
    "grounded_mask",
    "grounded_table",
    "plot_visual_sweep",
    "pool_grounded",
    "scene_prompts",
    "sweep_methods",
    "sweep_rows",
    "sweep_table",
]

SCENES = "scenes"
SCENES_DEFAULT_LIMIT = 24
SCENES_CATEGORY = "describe"
SWEPT_STRATEGY = "laspec"
VISUAL_SELECTIONS = ("prefill", "round")
CLASSES = ("grounded", "other")


# ----------------------------------------------------------------------------
# Prompts and inputs
# ----------------------------------------------------------------------------
def scene_prompts(limit: Optional[int] = None) -> list:
    """Held-out scenes (`make_scenes("test", limit)`, default 24) as `Prompt`s asking for their description."""
    from ..registry.data import Prompt
    from ..scenes.dataset import DESCRIBE_REQUEST, make_scenes, scene_messages

    count = SCENES_DEFAULT_LIMIT if limit is None else limit
    return [Prompt(scene.id, SCENES, SCENES_CATEGORY, scene_messages(DESCRIBE_REQUEST), image=scene.image)
            for scene in make_scenes("test", count)]


# ----------------------------------------------------------------------------
# Grounded-token acceptance
# ----------------------------------------------------------------------------
def accepted_mask(num_tokens: int, accepted_lengths: list) -> list:
    """Which of the `num_tokens` new tokens of a batch-1 speculative run were drafted and accepted.

    Layout: the prefill's token (target), then per round r `accepted_lengths[r]` accepted drafts followed by
    the round's bonus or correction token (target); the end may be cut (max_new_tokens, EOS).

    Raises:
        ValueError: the rounds account for fewer tokens than `num_tokens` (not a batch-1 layout).
    """
    mask = [False]  # the prefill's token
    for accepted in accepted_lengths:
        mask += [True] * int(accepted) + [False]
    if num_tokens and len(mask) < num_tokens:
        raise ValueError(f"{len(accepted_lengths)} rounds give at most {len(mask)} tokens, the run has {num_tokens}.")
    return mask[:num_tokens]


def grounded_mask(decode: Callable[[list], str], tokens: list, words) -> list:
    """Which `tokens` are grounded: their characters in `decode(tokens)` overlap one of `words` (whole words,
    case-insensitive). A token's characters are where the decoded prefix grows when it is added."""
    if not tokens or not words:
        return [False] * len(tokens)
    text = decode(tokens)
    pattern = re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, words), key=len, reverse=True)) + r")\b",
                         re.IGNORECASE)
    matches = [m.span() for m in pattern.finditer(text)]
    ends = [len(decode(tokens[: i + 1])) for i in range(len(tokens) - 1)] + [len(text)]
    starts = [0] + ends[:-1]
    return [any(start < match_end and match_start < end for match_start, match_end in matches)
            for start, end in zip(starts, ends)]


def grounded_counts(accepted: list, grounded: list) -> dict:
    """``{"grounded": {"tokens", "accepted"}, "other": {...}}`` from per-token flags (equal lengths)."""
    if len(accepted) != len(grounded):
        raise ValueError(f"{len(accepted)} acceptance flags for {len(grounded)} grounded flags.")
    out = {name: {"tokens": 0, "accepted": 0} for name in CLASSES}
    for was_accepted, is_grounded in zip(accepted, grounded):
        entry = out["grounded" if is_grounded else "other"]
        entry["tokens"] += 1
        entry["accepted"] += int(was_accepted)
    return out


def pool_grounded(records: list) -> Optional[dict]:
    """Pooled grounded / other counts of `records` (those that have them) with ``acceptance`` = accepted /
    tokens; None when no record has them."""
    rows = [r for r in records if r.get("grounded") is not None]
    if not rows:
        return None
    out = {}
    for name in CLASSES:
        tokens = sum(r[name]["tokens"] for r in rows)
        accepted = sum(r[name]["accepted"] for r in rows)
        out[name] = {"tokens": tokens, "accepted": accepted, "acceptance": accepted / tokens if tokens else None}
    return out


def _fmt(value, digits=2, suffix="") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def grounded_table(group: dict) -> list:
    """Markdown rows: per method of `group` (method -> summary) with grounded counts, both classes' acceptance."""
    lines = ["| method | grounded tokens | accepted | share | other tokens | accepted | share |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, summary in group.items():
        pooled = summary.get("grounded_acceptance")
        if not pooled:
            continue
        cells = [name]
        for kind in CLASSES:
            entry = pooled[kind]
            cells += [str(entry["tokens"]), str(entry["accepted"]), _fmt(entry["acceptance"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


# ----------------------------------------------------------------------------
# Visual-token sweep
# ----------------------------------------------------------------------------
def sweep_methods(visual_tokens: list, strategies: list, base_configs: dict, swept: Optional[str] = None,
                  selections: Optional[list] = None) -> list:
    """``[(method name, strategy, M, selection, spec_config)]`` of a `--visual-tokens` sweep, M in the given order
    (duplicates once).

    The swept strategy is `swept`, else laspec when it runs (``spec_config["num_visual_tokens"] = M``: its block
    drafter's per-round selection). Another strategy drafts with an independent VLM drafter
    (``spec_config["visual_tokens"] = M``), once per `selections` entry (``"prefill"``: chosen once, the default;
    ``"round"``: after every round); its methods are named ``{strategy}_m{M}`` and ``{strategy}_m{M}_round``.

    Raises:
        ValueError: the swept strategy is not among `strategies`, an M is negative, or selections are given for
            laspec (it always selects per round).
    """
    if swept is None:
        if SWEPT_STRATEGY not in strategies:
            raise ValueError(f"--visual-tokens sweeps {SWEPT_STRATEGY} (with a LaSpec drafter) or the strategy of "
                             f"--visual-strategy; --strategies {list(strategies)} has no {SWEPT_STRATEGY}.")
        swept = SWEPT_STRATEGY
    if swept not in strategies:
        raise ValueError(f"--visual-strategy {swept!r} is not among --strategies {list(strategies)}.")
    if swept == SWEPT_STRATEGY and selections:
        raise ValueError(f"--visual-selection applies to independent VLM drafters; {SWEPT_STRATEGY} selects per round.")
    base = base_configs.get(swept) or {}
    out = []
    for count in dict.fromkeys(visual_tokens):
        if count < 0:
            raise ValueError(f"--visual-tokens must be >= 0, got {count}.")
        if swept == SWEPT_STRATEGY:
            out.append((f"{swept}_m{count}", swept, count, None, {**base, "num_visual_tokens": count}))
            continue
        for selection in dict.fromkeys(selections or ["prefill"]):
            if selection not in VISUAL_SELECTIONS:
                raise ValueError(f"--visual-selection must be among {VISUAL_SELECTIONS}, got {selection!r}.")
            suffix = "" if selection == "prefill" else f"_{selection}"
            out.append((f"{swept}_m{count}{suffix}", swept, count, selection,
                        {**base, "visual_tokens": count, "visual_selection": selection}))
    return out


def sweep_rows(methods: dict, overall: dict, records: list) -> list:
    """One row per swept M (ascending): tau, speedup over plain, grounded / other acceptance and the visual-token
    selection cost (seconds per round and share of the run's time, pooled over the method's timed runs).

    `methods`: results["methods"] (name -> info with ``visual_tokens``); `overall`: method -> pooled summary.
    """
    rows = []
    for name, info in methods.items():
        if info.get("visual_tokens") is None or name not in overall:
            continue
        summary = overall[name]
        spec = [r["spec_stats"] for r in records
                if r["method"] == name and r["error"] is None and r.get("spec_stats")]
        rounds = sum(s["rounds"] for s in spec)
        total = sum(s["time_total"] for s in spec)
        visual = sum(s["time_visual"] for s in spec)
        pooled = summary.get("grounded_acceptance") or {}
        rows.append({
            "method": name, "visual_tokens": info["visual_tokens"], "selection": info.get("visual_selection"),
            "tau": summary["tau"],
            "speedup_vs_plain": summary["speedup_vs_plain"],
            "speedup_vs_plain_mode": summary.get("speedup_vs_plain_mode"),
            "grounded_acceptance": (pooled.get("grounded") or {}).get("acceptance"),
            "other_acceptance": (pooled.get("other") or {}).get("acceptance"),
            "acceptance_rate": summary.get("acceptance_rate"),
            "visual_s_per_round": visual / rounds if rounds else None,
            "visual_share": visual / total if total else None,
            "failures": summary["failures"],
        })
    return sorted(rows, key=lambda row: (row["selection"] or "", row["visual_tokens"]))


def sweep_table(rows: list, overall: dict | None = None) -> list:
    """Markdown rows of the sweep: one line per M. `overall` (method -> pooled summary) fills the speedup over the
    plain mode of rows recorded without it."""
    lines = ["| M | method | chosen | tau | vs plain | vs plain mode | grounded accept | other accept | "
             "selection per round | selection share | failures |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        per_round = row["visual_s_per_round"]
        over_mode = row.get("speedup_vs_plain_mode")
        if over_mode is None and overall is not None:
            over_mode = (overall.get(row["method"]) or {}).get("speedup_vs_plain_mode")
        lines.append("| " + " | ".join([
            str(row["visual_tokens"]), row["method"], row.get("selection") or "per round (laspec)", _fmt(row["tau"]),
            "–" if row["speedup_vs_plain"] is None else f"{row['speedup_vs_plain']:.2f}x",
            "–" if over_mode is None else f"{over_mode:.2f}x",
            _fmt(row["grounded_acceptance"]), _fmt(row["other_acceptance"]),
            "–" if per_round is None else f"{1e3 * per_round:.3f} ms",
            "–" if row["visual_share"] is None else f"{100 * row['visual_share']:.1f}%",
            f"**FAIL {row['failures']}**" if row["failures"] else "0",
        ]) + " |")
    return lines


def plot_visual_sweep(rows: list, figure: Callable, title: str = ""):
    """Acceptance share of grounded and other tokens against M (a figure from `figure(width, height)`); None
    without any measured share."""
    groups = list(dict.fromkeys(row.get("selection") for row in rows))
    points = {(kind, group): [(row["visual_tokens"], row[f"{kind}_acceptance"]) for row in rows
                              if row.get("selection") == group and row[f"{kind}_acceptance"] is not None]
              for kind in CLASSES for group in groups}
    if not any(points.values()):
        return None
    fig = figure(5.5, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    for (kind, group), line in points.items():
        if line:
            xs, ys = zip(*line)
            label = f"{kind} tokens" + (f" ({group})" if group else "")
            ax.plot(xs, ys, marker="o" if kind == "grounded" else "s",
                    linestyle="-" if group in (None, "prefill") else "--", label=label)
    counts = sorted({row["visual_tokens"] for row in rows})
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(counts)
    ax.set_xticks([], minor=True)
    ax.set_xticklabels([str(c) for c in counts])
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("visual tokens per round (M)")
    ax.set_ylabel("drafted and accepted / tokens")
    ax.set_title(title or "acceptance against visual tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
