"""``bench.ab_step`` without a GPU: its schedule, and the runs and summary over two stand-in source trees."""
import json
import textwrap

import pytest

from bench import ab_step

FAKE = textwrap.dedent('''
    import argparse, json, os
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers"); ap.add_argument("--variants"); ap.add_argument("--json")
    a = ap.parse_args()
    step = float(open(os.path.join(os.path.dirname(__file__), "step.txt")).read())
    if step < 0:
        raise SystemExit("no CUDA here")
    json.dump({a.variants: {"step_s": step / 1e3, "host_s": 0.02, "tokens_per_s": 8192e3 / step, "mfu": 0.3,
                            "peak_gb": 40.0, "loss": 7.8, "profile": {"busy_ms": step - 3, "launches": 2676}}},
              open(a.json, "w"))
''')


def _tree(root, name, step):
    (root / name / "bench").mkdir(parents=True)
    (root / name / "bench" / "__init__.py").write_text("")
    (root / name / "bench" / "step_variants.py").write_text(FAKE)
    (root / name / "bench" / "step.txt").write_text(str(step))
    return root / name


def test_trees_and_schedule():
    assert list(ab_step.parse_trees("main=.,exp=trees/exp")) == ["main", "exp"]
    for bad in ("main", "main=.,main=x", "=x"):
        with pytest.raises(ValueError):
            ab_step.parse_trees(bad)
    assert ab_step.schedule(["a", "b"], 2, True) == [("a", False), ("b", False), ("a", True), ("b", True),
                                                    ("a", True), ("b", True)]
    assert ab_step.schedule(["a", "b"], 1, False) == [("a", True), ("b", True)]


def test_alternating_runs_in_each_tree_and_a_failed_one_is_a_row(tmp_path, capsys):
    a, b, c = _tree(tmp_path, "a", 104.2), _tree(tmp_path, "b", 111.4), _tree(tmp_path, "c", -1)
    out = tmp_path / "ab.json"
    assert ab_step.main(["--trees", f"new={a},old={b},broken={c}", "--rounds", "2", "--warmup", "--json",
                         str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["tree"], r["timed"]) for r in rows] == [("new", False), ("old", False), ("broken", False)] + \
        [("new", True), ("old", True), ("broken", True)] * 2
    assert all(r["step_ms"] == pytest.approx(104.2) for r in rows if r["tree"] == "new")
    assert all("no CUDA here" in r["error"] for r in rows if r["tree"] == "broken")
    text = capsys.readouterr().out
    assert "new: step 104.2 ms (runs 104.2, 104.2), GPU busy 101.2 ms, launches 2676" in text
    assert "old: step 111.4 ms" in text and "broken: no timed run finished" in text


def test_refuses_a_folder_that_is_not_a_tree(tmp_path, capsys):
    assert ab_step.main(["--trees", f"x={tmp_path}"]) == 2
    assert "not a source tree" in capsys.readouterr().err
