"""The README's "Shard your own model" example runs as written, and its plan-file example is a valid plan."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.index("\n## ", start + 1)
    return README[start:end]


def test_shard_your_own_model_example_runs_and_its_plan_file_applies(tmp_path):
    text = section("Shard your own model")
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    plan_yaml = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
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
    assert "mesh data=2 x fsdp=2 x context=1 x tensor=2: 35 parameters" in out
    assert "head/kernel" in out and "P('fsdp', 'tensor')" in out
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "compiles: 1" in out and "plan file ok" in out
