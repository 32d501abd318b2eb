"""Every trainer, sbatch and tools.size command line in the docs passes the config validator, composed with the
world size its launcher gives (nothing built); lines with placeholders (``...``, ``<dir>``, ``$VAR``, ``N``) are
left out."""
from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from configs.schema import compose, validate

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools/slurm/README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")


@dataclass
class Command:
    where: str                     # file:line
    kind: str                      # trainer | sbatch | size
    args: list[str]                # what follows the module or the script
    env: dict[str, str] = field(default_factory=dict)
    world: int = 1                 # torchrun: nnodes x nproc_per_node
    sbatch: dict[str, str] = field(default_factory=dict)   # sbatch's options

    def template(self) -> bool:
        words = [*self.args, *self.env.values(), *self.sbatch.values()]
        return any("..." in w or "$" in w or re.search(r"<[^>]*>", w) or w == "N" for w in words)


def _options(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``--key=value`` / ``--key value`` options (value-less ones map to ''); the rest."""
    opts, i = {}, 0
    while i < len(words) and words[i].startswith("-") and words[i] != "-m":
        key, eq, value = words[i].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-") and key.startswith("--") \
                and key not in ("--standalone",):
            value, i = words[i + 1], i + 1
        opts[key.lstrip("-").replace("-", "_")] = value
        i += 1
    return opts, words[i:]


def _segment(words: list[str], where: str) -> Command | None:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    if not words:
        return None
    head = words[0]
    if head in ("python", "python3") and words[1:2] == ["-m"] and len(words) > 2:
        if words[2] == "trainer":
            return Command(where, "trainer", words[3:], env)
        if words[2] == "tools.size":
            return Command(where, "size", words[3:], env)
        if words[2] == "torch.distributed.run":
            head, words = "torchrun", ["torchrun", *words[3:]]
    if head == "torchrun":
        opts, rest = _options(words[1:])
        if rest[:2] == ["-m", "trainer"]:
            world = int(opts.get("nnodes", "1")) * int(opts.get("nproc_per_node", "1"))
            return Command(where, "trainer", rest[2:], env, world=world)
    if head == "sbatch":
        opts, rest = _options(words[1:])
        if rest and rest[0].endswith("train.sbatch"):
            return Command(where, "sbatch", rest[1:], env, sbatch=opts)
    return None


def _commands(text: str, where) -> list[Command]:
    """The commands of one shell text (continuations joined, comments dropped, split at ``&&``, ``||``, ``|``)."""
    try:
        words = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError:
        return []
    out, seg = [], []
    for w in [*words, "&&"]:
        if w in ("&&", "||", "|"):
            if seg and (c := _segment(seg, where)) is not None:
                out.append(c)
            seg = []
        else:
            seg.append(w)
    return out


def documented_commands() -> list[Command]:
    out = []
    for path in DOCS:
        text = path.read_text()
        rel = path.relative_to(ROOT)
        for m in FENCE.finditer(text):   # shell blocks: a command per (continued) line
            if m.group(1) not in SHELL:
                continue
            start = text.count("\n", 0, m.start(2)) + 1
            for offset, line in _logical_lines(m.group(2)):
                out += _commands(line, f"{rel}:{start + offset}")
        prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)   # keep line numbers
        for m in re.finditer(r"`([^`]+)`", prose):   # inline spans, which may wrap lines
            if "\n\n" not in m.group(1):
                out += _commands(m.group(1).replace("\n", " "), f"{rel}:{prose.count(chr(10), 0, m.start()) + 1}")
    return out


def _logical_lines(block: str):
    """(line offset, text) of each line, backslash continuations joined."""
    lines, buf, first = [], "", 0
    for i, line in enumerate(block.splitlines()):
        if not buf:
            first = i
        buf += line + "\n"
        if not line.endswith("\\"):
            lines.append((first, buf))
            buf = ""
    if buf:
        lines.append((first, buf))
    return lines


# ---- the validator, as each entry point runs it ------------------------------------------------------
def _sweeps(overrides: list[str], multirun: bool) -> list[list[str]]:
    """A multirun's sweep ``key=a,b`` -> one override list per point; else the list itself."""
    if not multirun:
        return [overrides]
    choices = []
    for o in overrides:
        key, eq, value = o.partition("=")
        plain = eq and not any(c in value for c in "[{'\"")
        choices.append([f"{key}={v}" for v in value.split(",")] if plain and "," in value else [o])
    return [list(p) for p in itertools.product(*choices)]


def validate_command(c: Command, monkeypatch) -> None:
    for k, v in c.env.items():
        monkeypatch.setenv(k, v)
    if c.kind == "size":
        from tools.size import parse_args
        from trainer.memory_plan import check_layout
        args, overrides = parse_args([a.strip("[]") for a in c.args])
        assert not [o for o in overrides if o.startswith("--")], overrides
        cfg = compose(overrides)
        check_layout(cfg, args.world_size or cfg.parallel.pp * cfg.parallel.ep)
        return
    args, world = list(c.args), c.world
    if c.kind == "sbatch":   # as tools/slurm/train.sbatch derives the layout, and the overrides it puts first
        o = c.sbatch
        nodes = int(o.get("nodes", "1"))
        if c.env.get("LAUNCHER", "srun") == "torchrun":
            per_node = int(c.env.get("NPROC_PER_NODE", o.get("gpus_per_node", "1")))
        else:
            per_node = int(o.get("ntasks", nodes * int(o.get("ntasks_per_node", "1")))) // nodes
        world = nodes * per_node
        args = ["checkpoint.resume=auto", f"parallel.ranks_per_node={per_node}", *args]
    multirun = any(a in ("-m", "--multirun") for a in args)
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    if multirun:   # Hydra's launcher: nodes x tasks per node ranks; its own keys are not the trainer's
        launcher = dict(a.partition("=")[::2] for a in overrides if a.startswith("hydra.launcher."))
        world = int(launcher.get("hydra.launcher.nodes", "1")) * int(launcher.get("hydra.launcher.tasks_per_node", "1"))
    overrides = [a for a in overrides if not a.startswith(("hydra.", "hydra/"))]
    for point in _sweeps(overrides, multirun):
        validate(compose(point), world)


COMMANDS = documented_commands()
CHECKED = [c for c in COMMANDS if not c.template()]


def test_the_docs_show_commands_of_every_kind():
    """The extraction finds them (a change of doc format must not leave this test checking nothing)."""
    kinds = {k: sum(c.kind == k for c in CHECKED) for k in ("trainer", "sbatch", "size")}
    assert kinds["trainer"] >= 15 and kinds["sbatch"] >= 3 and kinds["size"] >= 3, kinds
    assert any(c.world == 4 for c in CHECKED) and any(c.args[:1] == ["-m"] for c in CHECKED)


@pytest.mark.parametrize("command", CHECKED, ids=[f"{c.where} {c.kind}" for c in CHECKED])
def test_documented_command_passes_the_config_validator(command, monkeypatch):
    validate_command(command, monkeypatch)


def test_multi_node_sbatch_example_passes_the_validator(monkeypatch):
    """v3_small (8 routing groups) with EP=8 on 4 nodes of 8 ranks: the EP group is one node."""
    line = "sbatch --nodes=4 --ntasks-per-node=8 tools/slurm/train.sbatch +exp=v3_small parallel.ep=8"
    (c,) = _commands(line, "test")
    validate_command(c, monkeypatch)
    c.args.append("parallel.ep=16")   # 2 nodes of 4 groups each
    validate_command(c, monkeypatch)
    c.args.append("parallel.ep=32")   # 4 nodes of 2 groups each
    validate_command(c, monkeypatch)
    c.args += ["model.n_routed_experts=96", "model.n_expert_groups=6"]   # 6 groups on 4 nodes: refused
    from errors import ConfigError
    with pytest.raises(ConfigError, match=r"model\.n_expert_groups \(6\) and the EP group's nodes \(4 = "):
        validate_command(c, monkeypatch)


def test_extraction():
    """What the parser takes from a line: launcher sizes, env, sbatch options, continuations, templates."""
    (t,) = _commands("OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 -m trainer +exp=tiny \\\n"
                     "    parallel.ep=2   # comment", "x")
    assert (t.kind, t.world, t.env, t.args) == ("trainer", 4, {"OMP_NUM_THREADS": "1"}, ["+exp=tiny", "parallel.ep=2"])
    (s,) = _commands("LAUNCHER=torchrun sbatch --nodes=2 --gpus-per-node 8 tools/slurm/train.sbatch +exp=tiny", "x")
    assert (s.kind, s.sbatch, s.args) == ("sbatch", {"nodes": "2", "gpus_per_node": "8"}, ["+exp=tiny"])
    a, b = _commands("pip install -e . && python -m trainer +exp=tiny && python -m tools.size +exp=...", "x")
    assert (a.kind, a.template(), b.kind, b.template()) == ("trainer", False, "size", True)
    assert _sweeps(["a=0,1", "b=x", "'c=[1,2]'"], True) == [["a=0", "b=x", "'c=[1,2]'"], ["a=1", "b=x", "'c=[1,2]'"]]
