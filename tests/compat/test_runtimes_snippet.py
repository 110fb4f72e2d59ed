"""The GitHub Actions snippet of docs/how-to/deployment-parity.md runs as written in a repository that is not
this one: its steps run in a fresh folder holding only a model (the install lines are checked instead of run:
they must name no file of this checkout, such as constraints.txt), twice over the same workspace (a rerun),
and the report is uploaded whether the check passes or fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

PAGE = ROOT / "docs" / "how-to" / "deployment-parity.md"


def snippet_steps() -> list[dict]:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("<!-- ci-snippet -->")
    block = text[start:].split("```yaml\n", 1)[1].split("\n```", 1)[0]
    return yaml.safe_load(block)["jobs"]["parity"]["steps"]


def run_steps(steps, workspace: Path, env: dict) -> list[subprocess.CompletedProcess]:
    done = []
    for step in steps:
        command = step.get("run")
        if command is None or command.startswith("pip install"):
            continue
        done.append(subprocess.run(["bash", "-ec", command], cwd=workspace, env=env, capture_output=True, text=True,
                                   timeout=300))
    return done


def test_the_ci_snippet_runs_in_another_repository(tmp_path, tiny_encoder_dir):
    steps = snippet_steps()
    installs = [s["run"] for s in steps if str(s.get("run", "")).startswith("pip install")]
    assert installs and all("constraints.txt" not in line and " -e " not in line and " -c " not in line
                            and " -r " not in line for line in installs), installs
    assert any("minibert" in line for line in installs)
    assert any("cpu" in line and "torch" in line for line in installs)  # not a multi-GB CUDA build
    upload = [s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert upload and upload[0].get("if") == "always()"  # the report is uploaded on a FAIL, when it is needed

    workspace = tmp_path / "their-repo"  # not this checkout: no constraints.txt, no weights/, no minibert/
    shutil.copytree(tiny_encoder_dir, workspace / "checkpoints" / "model")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for attempt in ("first run", "rerun in the same workspace"):
        done = run_steps(steps, workspace, env)
        assert done and all(d.returncode == 0 for d in done), (attempt, [d.stderr[-800:] for d in done])
        report = json.loads((workspace / "parity.json").read_text())
        assert report["ok"] and report["longest"] == 512

    # the model changes, the deployed graph does not: the parity step fails the job, and its report is there
    from safetensors.torch import load_file, save_file

    weights = workspace / "checkpoints" / "model" / "model.safetensors"
    state = load_file(str(weights))
    key = next(k for k in state if k.endswith("layer.0.output.dense.bias"))
    state[key][0] += 0.05  # one entry: a shift of every entry would be undone by the LayerNorm after it
    save_file(state, str(weights), metadata={"format": "pt"})
    parity = next(s["run"] for s in steps if str(s.get("run", "")).startswith("minibert parity"))
    failed = subprocess.run(["bash", "-ec", parity], cwd=workspace, env=env, capture_output=True, text=True,
                            timeout=300)
    report = json.loads((workspace / "parity.json").read_text())
    assert failed.returncode == 1 and not report["ok"] and report["reasons"], failed.stdout[-800:]
