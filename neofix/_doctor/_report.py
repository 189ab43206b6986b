"""Rendering a doctor :class:`~neofix._doctor.Report`: the table people read, or one JSON document."""

from __future__ import annotations

import json
from typing import Any

#: Bumped when a key of the JSON document changes meaning or disappears (new keys may appear at any time).
JSON_SCHEMA = 1


def as_json(report: Any) -> str:
    document = {
        "schema": JSON_SCHEMA,
        "versions": report.versions,
        "transformers_tested_range": report.tested_range,
        "transformers_supported": report.supported,
        "patched_on_arrival": report.found_patched,
        "patch_targets": [{"target": t, "state": s, "reason": r} for t, s, r in report.targets],
        "mode": report.mode,
        "model": report.model,
        "scenarios": [
            {
                "key": row.key,
                "title": row.title,
                "vanilla": _cell(row.vanilla),
                "neofix": _cell(row.neofix),
                "expected": row.expected,
                "right": row.right,
            }
            for row in report.rows
        ],
        "family": report.family,
        "other_families": [
            {"family": title, "skipped": rows}
            if isinstance(rows, str)
            else {"family": title, "scenarios": len(rows), "right": sum(row.right for row in rows),
                  "vanilla_wrong": _vanilla_wrong(rows), "wrong": [row.key for row in rows if not row.right]}
            for title, rows in report.others
        ],
        "name_clash": report.name_clash,
        "all_right": report.all_right,
        "exit_status": report.exit_status,
        "seconds": report.seconds,
    }
    return json.dumps(document, indent=2)


def _vanilla_wrong(rows: Any) -> int:
    """Scenarios vanilla transformers gets wrong: wrong tokens, a raw error, or invalid input taken silently."""
    return sum(row.vanilla.kind in ("wrong_tokens", "error", "accepted") for row in rows)


def _wrapped(text: str, indent: str, width: int = 100) -> list[str]:
    import textwrap

    return textwrap.wrap(
        text, width=width, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False,
        break_long_words=False,
    )


def _cell(cell: Any) -> dict[str, Any]:
    return {"kind": cell.kind, "text": cell.text, "error_class": cell.error_class, "message": cell.message}


def as_table(report: Any) -> str:
    lines = ["neofix doctor", ""]
    lines += _versions_lines(report)
    lines += ["", "Patch targets"]
    target_width = max(len(t) for t, _, _ in report.targets)
    for target, state, reason in report.targets:
        lines.append(f"  {target:<{target_width}}  {state:<9}  {reason}")
    lines += _model_lines(report)
    header = ("scenario", f"vanilla transformers {report.versions['transformers']}", f"neofix ({report.mode} mode)", "")
    body = [
        (row.title, row.vanilla.text, row.neofix.text, "ok" if row.right else f"WRONG, expected {row.expected}")
        for row in report.rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(3)]
    for columns in [header, *body]:
        lines.append(("  " + "  ".join(f"{c:<{w}}" for c, w in zip(columns, widths)) + "  " + columns[3]).rstrip())
    lines += _others_lines(report)
    lines.append("")
    lines += _summary_lines(report)
    return "\n".join(lines)


def _versions_lines(report: Any) -> list[str]:
    v = report.versions
    range_verdict = (
        f"inside the tested range ({report.tested_range})"
        if report.supported
        else f"OUTSIDE the tested range ({report.tested_range}): neofix leaves every family unpatched"
    )
    arrival = (
        "patched in this process"
        if report.found_patched
        else "was not patched on arrival (NEOFIX_DISABLE=1 or neofix.unpatch()?); patched for the check, then "
        "put back"
    )
    width = max(len(v[name]) for name in ("python", "torch", "transformers", "neofix"))
    lines = [
        f"  Python        {v['python']}",
        f"  torch         {v['torch']}",
        f"  transformers  {v['transformers']:<{width}}  {range_verdict}",
        f"  neofix        {v['neofix']:<{width}}  {arrival}",
    ]
    if report.name_clash:
        lines += ["", *_wrapped(f"WARNING: {report.name_clash}", "  ")]
    return lines


def _model_lines(report: Any) -> list[str]:
    m = report.model
    kinds = m["attention_layers"]  # GPT-Neo's global and local layers; empty for the other families
    shape = f"{m['layers']} layers"
    crossed = "."
    if kinds:
        shape += f" ({', '.join(kinds[:6])}{', ...' if len(kinds) > 6 else ''}), local window {m['window_size']}"
        crossed = (
            ": every sequence crosses the local window."
            if m["local_window_crossed"]
            else ": the sequences stay inside the local window."
        )
    table = "no position table" if m["max_position_embeddings"] is None else f"{m['max_position_embeddings']} positions"
    return [
        "",
        f"Self-check on the {m['source']}:",
        f"  {shape}, vocab {m['vocab_size']}, {table}, {m['dtype']}",
        f"  prompts of {', '.join(str(n) for n in m['prompt_lengths'])} tokens left-padded, "
        f"{m['new_tokens']} new tokens{crossed}",
        f"  Each scenario runs on vanilla transformers (neofix.unpatch()), then with neofix in {report.mode} mode;",
        "  both are compared token for token with a full recompute (no cache, positions from the mask).",
        "",
    ]


def _others_lines(report: Any) -> list[str]:
    if not report.others:
        return []
    lines = ["", "Other families (quick self-check on each one's tiny random model; --family NAME for the table):"]
    title_width = max(len(title) for title, _ in report.others)
    for title, rows in report.others:
        if isinstance(rows, str):
            lines.append(f"  {title:<{title_width}}  skipped: {rows}")
            continue
        right = sum(row.right for row in rows)
        wrong = [row.title for row in rows if not row.right]
        verdict = "ok" if not wrong else "WRONG: " + "; ".join(wrong)
        lines.append(
            f"  {title:<{title_width}}  {right} of {len(rows)} neofix verdicts right; vanilla wrong or a raw "
            f"error in {_vanilla_wrong(rows)}  {verdict}"
        )
    return lines


def _summary_lines(report: Any) -> list[str]:
    rows = list(report.rows) + [row for _, other in report.others if not isinstance(other, str) for row in other]
    right = sum(row.right for row in rows)
    if report.all_right:
        lines = [f"All {right} neofix verdicts are right ({report.seconds:.1f} s)."]
    else:
        lines = [
            f"{len(rows) - right} of {len(rows)} neofix verdicts are WRONG ({report.seconds:.1f} s). "
            f"Please report this with the output of 'neofix doctor --json'."
        ]
    if report.mode == "strict":
        lines.append(
            "Strict mode: steps neofix would repair (a stale mask, stale position_ids) must raise a clear error;\n"
            "steps that need no repair (missing position_ids are derived from the mask) must give the reference."
        )
    return lines
