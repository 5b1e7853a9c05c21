"""The README and docs/ as users read them: every `shardlm` command they show parses and names real options and
config keys, every link resolves, the "Sharding your own model" example runs as written and its plan file applies,
and the README stays the front door (its two commands, .ci/run's test command, its length); the accelerator
extras it names pin the JAX the tests compile with."""

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardlm.cli import parse_args
from shardlm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODEL_COMMANDS = ("train", "explain", "plan", "bench", "profile")  # commands whose overrides are a whole config


def code_blocks(text: str):
    """(language, body) of every fenced block, indented ones (in lists) included."""
    for m in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.S | re.M):
        yield m.group(2), textwrap.dedent(m.group(3))


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every `shardlm ...` line of a bash block, and every `$ shardlm ...` line of an untagged one (a command shown
    with its output), continuation lines joined, as (page, argv). Blocks tagged `text` are synopses (`INPUT...`,
    `[--force]`) and are skipped."""
    out = []
    for page in PAGES:
        for lang, body in code_blocks(page.read_text()):
            if lang not in ("bash", ""):
                continue
            for line in re.sub(r"\\\n\s*", " ", body).splitlines():
                line = line.strip()
                if lang == "" and not line.startswith("$ "):
                    continue  # output, not a command
                line = line.removeprefix("$ ")
                if line.startswith("shardlm "):
                    out.append((page.name, shlex.split(line, comments=True)[1:]))
    return out


def check_command(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.command == "launch":
        return check_command(args.launched)
    overrides = getattr(args, "overrides", [])
    # An hf:DIR names a directory the reader downloads first; its keys are checked, not its (absent) files.
    overrides = [o for o in overrides if not o.split("=", 1)[1].startswith("hf:")]
    if args.command in MODEL_COMMANDS:
        load_config(args.config and str(ROOT / args.config), overrides)  # every key exists, every value checks
    elif args.command in ("generate",):
        load_config(None, overrides)  # mesh.* keys


def test_every_documented_command_parses_with_real_options_and_keys(monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands run from the repository, as the pages say (model=py:examples/...)
    commands = documented_commands()
    assert len(commands) >= 40, len(commands)  # the quickstart (20) and every page's examples
    assert {argv[0] for _, argv in commands} >= {"train", "generate", "explain", "plan", "bench", "profile", "data",
                                                 "export", "launch"}
    for page, argv in commands:
        try:
            check_command(argv)
        except (Exception, SystemExit) as e:  # argparse exits on an unknown option
            pytest.fail(f"{page}: shardlm {shlex.join(argv)}: {type(e).__name__}: {e}")


def test_a_documented_command_with_a_renamed_option_or_key_fails_the_check():
    for bad in (["train", "--runs-dir", "x"], ["train", "mesh.fsdpp=2"], ["plan", "--devices", "8", "model=gpt3"]):
        with pytest.raises((Exception, SystemExit)):
            check_command(bad)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^( *)```.*?^\1```", "", page.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_every_link_between_pages_resolves():
    checked = 0
    for page in PAGES:
        text = re.sub(r"^( *)```.*?^\1```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"https?://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: link to {target}: no such file"
            if anchor:
                assert anchor in anchors(file), f"{page.name}: link to {target}: no such heading"
            checked += 1
    assert checked >= 20, checked


def test_the_readme_is_the_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 350
    first = text.split("\n## ")[1]
    assert first.startswith("Set up and run\n")
    setup, tests = [body.strip() for lang, body in code_blocks(first) if lang == "bash"]
    assert setup.endswith("&& .venv/bin/shardlm train") and tests.endswith("&& .venv/bin/python -m pytest")
    assert (ROOT / ".ci" / "run").read_text().strip().endswith(tests)  # CI runs exactly the README's test command
    for page in sorted((ROOT / "docs").glob("*.md")):  # every page is reachable from the front door
        assert f"(docs/{page.name})" in text, page.name


def test_the_accelerator_extras_pin_the_jax_the_targets_compile_with():
    """`.[gpu]` and `.[tpu]` (docs/accelerators.md) install the JAX whose XLA:GPU plugin and libtpu the `targets`
    extra compiles with, and the one these tests run: what was compiled for is what runs."""
    import tomllib

    import jax

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (version,) = [pin.split("==")[1] for pin in extras["targets"] if pin.startswith("jaxlib==")]
    assert extras["gpu"] == [f"jax[cuda12]=={version}"] and extras["tpu"] == [f"jax[tpu]=={version}"]
    assert f"jax[tpu]=={version}" in extras["targets"] and jax.__version__ == version


def test_shard_your_own_model_example_runs_and_its_plan_file_applies(tmp_path):
    text = (ROOT / "docs" / "your-own-model.md").read_text()
    example = re.search(r"```python\n(.*?)```", text.split("## From Python")[1], re.S).group(1)
    plan_yaml = re.search(r"```yaml\n(.*?)```", text.split("**Plan files.**")[1], re.S).group(1)
    (tmp_path / "plan.yaml").write_text(plan_yaml)
    check = textwrap.dedent(f"""
        from jax.sharding import PartitionSpec as P
        file_plan = shardlm.shard(lambda: TinyLM(rngs=nnx.Rngs(0)), {str(tmp_path / "plan.yaml")!r})
        s = file_plan.specs
        assert s["head/kernel"] == P("fsdp", "tensor"), s["head/kernel"]
        assert s["blocks/0/fc1/bias"] == P(("tensor", "fsdp")), s["blocks/0/fc1/bias"]
        assert s["blocks/0/norm1/scale"] == P()
        assert s["blocks/0/norm1/bias"] == P("fsdp")
        assert s["blocks/0/attn/query/kernel"] == P("fsdp", "tensor")
        assert s["blocks/0/fc2/kernel"] == P("tensor", "fsdp")  # the preset, after the plan's own rules
        assert s["blocks/0/attn/out/kernel"] == P("tensor", None, "fsdp")
        assert file_plan.layout.input_spec == P(("data", "fsdp")), file_plan.layout.input_spec
        print("plan file ok")
    """)
    script = tmp_path / "example.py"
    script.write_text(example + check)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # as a user's shell
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh stage=1 x data=2 x fsdp=2 x expert=1 x context=1 x tensor=2: 35 parameters" in out
    assert "head/kernel" in out and "P('fsdp', 'tensor')" in out
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "compiles: 1" in out and "plan file ok" in out


def test_the_configuration_page_lists_every_key_with_its_default_and_meaning_and_every_preset():
    """docs/configuration.md against the config's dataclasses: each field as `section.key` (or a top-level key) in
    its YAML block, with the dataclass's default and a comment saying what it means; every family in the family
    key's comment; every preset in the presets' table. A key the code adds and the page lacks fails here."""
    import dataclasses

    import yaml

    from shardlm.config import FIELD_KEYS, Config
    from shardlm.families import FAMILIES, preset_names

    page = (ROOT / "docs" / "configuration.md").read_text()
    (block,) = [body for lang, body in code_blocks(page) if lang == "yaml"]
    listed, lines, section = yaml.safe_load(block), {}, None
    for line in block.splitlines():
        m = re.match(r"( *)(\w+):", line)
        if m:
            section = m.group(2) if not m.group(1) else section
            lines[f"{section}.{m.group(2)}" if m.group(1) else m.group(2)] = line
    want = {}
    for f in dataclasses.fields(Config):
        if not dataclasses.is_dataclass(f.type):
            want[f.name] = f.default
            continue
        for g in dataclasses.fields(f.type):
            want[f"{f.name}.{FIELD_KEYS.get(g.name, g.name)}"] = (
                g.default if g.default is not dataclasses.MISSING else g.default_factory())

    def documented(key):
        tree = listed
        for part in key.split("."):
            if not isinstance(tree, dict) or part not in tree:
                return "missing"
            tree = tree[part]
        return tree

    assert len(want) > 100
    assert [k for k in want if documented(k) == "missing"] == []
    assert {k: (documented(k), v) for k, v in want.items() if documented(k) != v} == {}  # the defaults
    assert [k for k in want if "#" not in lines[k]] == []  # each with its meaning
    assert [f for f in FAMILIES if not re.search(rf"\b{re.escape(f)}\b", lines["model.family"].split("#", 1)[1])] == []
    assert [p for p in preset_names() if f"| `{p}` |" not in page] == []
