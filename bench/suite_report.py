"""Results and the markdown report of ``bench.gpu_suite`` (no torch, no GPU: tested on CPU).

A run is a list of ``Part`` results (status ``ok`` / ``failed`` / ``skipped`` / ``not run``), each with
tables, notes, an output excerpt and ``Mark``s: *checks* (correctness; a failed check fails its part) and
*targets* (the issue's performance goals; reported met / NOT met, they fail nothing unless the suite is
run with ``--strict-targets``). ``write`` renders the markdown and a JSON sidecar (``<out>.json``, what
``--append`` reads back) atomically, so a run killed between parts leaves every finished part on disk.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("ok", "failed", "skipped", "not run", "running")   # running: started, not finished (yet)


@dataclass
class Mark:
    name: str
    want: str                 # e.g. ">= 1.40x torch BF16"
    got: str = "not run"      # measured value as text
    met: bool | None = None   # None: not measured
    kind: str = "target"      # "target" (performance goal) | "check" (correctness)

    @property
    def verdict(self) -> str:
        if self.met is None:
            return "not run"
        if self.kind == "check":
            return "pass" if self.met else "**FAIL**"
        return "met" if self.met else "**NOT met**"


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    title: str = ""


@dataclass
class Part:
    key: str
    title: str
    status: str = "not run"
    seconds: float | None = None
    headline: str = ""
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    error: str = ""
    log: str = ""

    def finish(self) -> "Part":
        """Set ``status`` from the error and the checks (unless skipped): any failed check fails the part."""
        if self.status == "skipped":
            return self
        failed = bool(self.error) or any(m.kind == "check" and m.met is False for m in self.marks)
        self.status = "failed" if failed else "ok"
        return self


def min_mark(name: str, want: str, threshold: float, values: list[tuple[str, float | None]],
             unit: str = "x", kind: str = "target") -> Mark:
    """A mark met when the smallest of ``values`` (``(label, value)``; None = not measured) is ``>= threshold``."""
    got = [(label, v) for label, v in values if v is not None]
    if not got:
        return Mark(name, want, "not measured", None, kind)
    label, worst = min(got, key=lambda lv: lv[1])
    vals = sorted(v for _, v in got)
    median = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
    text = f"{worst:.2f}{unit} (min of {len(got)}, at {label}; median {median:.2f}{unit})" if len(got) > 1 \
        else f"{worst:.2f}{unit} ({label})"
    return Mark(name, want, text, worst >= threshold, kind)


# ------------------------------------------------------------------------------------------ rendering
def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _seconds(s: float | None) -> str:
    return "" if s is None else f"{s:.0f} s"


def overall(parts: list[Part]) -> dict:
    """Counts for the verdict line: failed / skipped / not run parts, targets met / measured / declared."""
    targets = [m for p in parts for m in p.marks if m.kind == "target"]
    return {"failed": [p.key for p in parts if p.status == "failed"],
            "skipped": [p.key for p in parts if p.status == "skipped"],
            "not_run": [p.key for p in parts if p.status in ("not run", "running")],
            "targets_met": sum(m.met is True for m in targets),
            "targets_measured": sum(m.met is not None for m in targets), "targets": len(targets)}


def verdict_line(parts: list[Part]) -> str:
    o = overall(parts)
    bits = [f"{len(o['failed'])} failed part(s)" + (f" ({', '.join(o['failed'])})" if o["failed"] else "")]
    if o["skipped"]:
        bits.append(f"skipped: {', '.join(o['skipped'])}")
    if o["not_run"]:
        bits.append(f"not run: {', '.join(o['not_run'])}")
    bits.append(f"targets met: {o['targets_met']} of {o['targets_measured']} measured ({o['targets']} declared)")
    return "; ".join(bits)


def render(meta: dict, parts: list[Part]) -> str:
    out = ["# GPU acceptance suite report", ""]
    if meta.get("smoke"):
        out += ["> **CPU smoke run** (`--smoke-cpu`): code paths only, Triton interpreter and tiny shapes. "
                "None of the figures below is a measurement of anything.", ""]
    rows = [["date", meta.get("date", "?")],
            ["device", meta.get("device_line", "?")],
            ["driver / CUDA", f"{meta.get('driver', '?')} / CUDA {meta.get('cuda', '?')} (torch build)"],
            ["torch / triton / python", f"{meta.get('torch', '?')} / {meta.get('triton', '?')} / {meta.get('python', '?')}"],
            ["commit / source fingerprint", f"{meta.get('commit', '?')} / {meta.get('fingerprint', '?')}"],
            ["command(s)", "<br>".join(f"`{c}`" for c in meta.get("commands", [])) or "?"],
            ["mode", meta.get("mode", "?")]]
    out += [md_table(["", ""], rows), "", f"**Result:** {verdict_line(parts)}", ""]
    marks = [(p, m) for p in parts for m in p.marks]
    targets = [(p, m) for p, m in marks if m.kind == "target"]
    checks = [(p, m) for p, m in marks if m.kind == "check"]
    if targets:
        out += ["## Targets (H100, baselines measured in the same run)", "",
                md_table(["part", "target", "want", "measured", "verdict"],
                         [[p.key, m.name, m.want, m.got, m.verdict] for p, m in targets]), ""]
    if checks:
        out += ["## Correctness checks", "",
                md_table(["part", "check", "want", "got", "verdict"],
                         [[p.key, m.name, m.want, m.got, m.verdict] for p, m in checks]), ""]
    out += ["## Summary", "", md_table(["part", "status", "time", "headline"],
                                       [[p.key, p.status, _seconds(p.seconds), p.headline] for p in parts]), ""]
    for p in parts:
        out += [f"## {p.title} (`{p.key}`)", "", f"Status: **{p.status}**" +
                (f" in {p.seconds:.0f} s" if p.seconds is not None else ""), ""]
        if p.error:
            out += ["Error:", "", "```", p.error.strip(), "```", ""]
        for n in p.notes:
            out += [f"- {n}"]
        if p.notes:
            out += [""]
        for t in p.tables:
            if t.title:
                out += [f"**{t.title}**", ""]
            out += [md_table(t.headers, t.rows), ""]
        if p.log.strip():
            out += ["<details><summary>output (last lines)</summary>", "", "```", p.log.strip(), "```", "",
                    "</details>", ""]
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------ files
def sidecar(path: str | Path) -> Path:
    return Path(str(path) + ".json") if not str(path).endswith(".md") else Path(str(path)[:-3] + ".json")


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write(path: str | Path, meta: dict, parts: list[Part]) -> None:
    """Write the markdown report at ``path`` and the JSON sidecar (atomically, both)."""
    path = Path(path)
    _atomic_write(sidecar(path), json.dumps({"meta": meta, "parts": [dataclasses.asdict(p) for p in parts]},
                                            indent=1, default=str))
    _atomic_write(path, render(meta, parts))


def part_from_dict(d: dict) -> Part:
    d = dict(d)
    d["tables"] = [Table(**t) for t in d.get("tables", [])]
    d["marks"] = [Mark(**m) for m in d.get("marks", [])]
    return Part(**d)


def load(path: str | Path) -> tuple[dict, list[Part]]:
    """``(meta, parts)`` from the JSON sidecar of the report at ``path``."""
    data = json.loads(sidecar(path).read_text())
    return data["meta"], [part_from_dict(p) for p in data["parts"]]


def summary_lines(parts: list[Part]) -> list[str]:
    """The closing console table: part, status, time, headline."""
    rows = [[p.key, p.status, _seconds(p.seconds), p.headline] for p in parts]
    widths = [max(len(str(r[i])) for r in [["part", "status", "time", "headline"], *rows]) for i in range(4)]
    fmt_row = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()   # noqa: E731
    return [fmt_row(["part", "status", "time", "headline"]), fmt_row(["-" * w for w in widths]),
            *(fmt_row(r) for r in rows)]
