"""The Kubernetes Indexed Job manifest: valid against Kubernetes' own schemas (bundled in
kubernetes-validate, strict: an unknown field fails), an Indexed Job whose pods run
`mstar-chunking sweep-cell /jobs` on a shared volume; and its container's command, run for
every completion index with JOB_COMPLETION_INDEX set as the Job sets it, merges into the local
sweep's sweep.csv.

Run by `make test-ray` (MSTAR_CHUNKING_BIN: the binary). Every command has a timeout.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import BIN, PLAIN_GRID, TIMEOUT, assert_merge_is_local

MANIFEST = Path(__file__).resolve().parent / "sweep-job.yaml"
# The sweep the manifest's completions are written for: 4 cells, no objective (one wave).
GRID = PLAIN_GRID


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]


def job() -> dict[str, Any]:
    (j,) = [d for d in documents() if d["kind"] == "Job"]
    return j


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_every_document_is_valid_kubernetes() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} == {"Job", "PersistentVolumeClaim"}
    for d in docs:
        validate(d)


@pytest.mark.parametrize(
    "edit",
    [
        lambda j: j["spec"].__setitem__("completionsMode", "Indexed"),  # a misspelt field
        lambda j: j["spec"].__setitem__("completions", "four"),  # a wrong type
        lambda j: j["spec"]["template"]["spec"]["containers"][0].pop("name"),  # required
    ],
)
def test_a_broken_job_is_refused(edit: Any) -> None:
    j = copy.deepcopy(job())
    edit(j)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(j)


def test_it_is_an_indexed_job_of_sweep_cells_on_a_shared_volume() -> None:
    job_spec = job()["spec"]
    assert job_spec["completionMode"] == "Indexed"
    assert 1 <= job_spec["parallelism"] <= job_spec["completions"]
    pod = job_spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["command"] == ["mstar-chunking", "sweep-cell", "/jobs"]
    assert c["resources"]["requests"]["cpu"] == "1"
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == "/jobs"
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    # One volume every pod shares, not a pod's own emptyDir.
    pvc_name = vol["persistentVolumeClaim"]["claimName"]
    (pvc,) = [d for d in documents() if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == pvc_name
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def run(args: list[str], env: dict[str, str] | None = None) -> None:
    r = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, check=False,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"


def test_its_pods_commands_merge_into_the_local_sweep(tmp_path: Path) -> None:
    jobs, merged, local = tmp_path / "jobs", tmp_path / "merged", tmp_path / "local"
    run([BIN, "sweep", "--emit-jobs", str(jobs), *GRID])
    job_spec = job()["spec"]
    (c,) = job_spec["template"]["spec"]["containers"]
    mount = c["volumeMounts"][0]["mountPath"]
    command = [BIN if a == "mstar-chunking" else str(jobs) if a == mount else a
               for a in c["command"]]
    for i in range(job_spec["completions"]):
        run(command, {"JOB_COMPLETION_INDEX": str(i)})
    run([BIN, "sweep", "--merge", str(jobs), "--out", str(merged)])
    assert_merge_is_local(merged, local, GRID)
