"""Makes rollout-schema.yaml and analysis-template-schema.yaml here from Argo Rollouts' published
CRDs: the openAPIV3Schema of their one version (v1alpha1), without descriptions, and with the two
subtrees our examples do not use, which are most of the bytes, cut to an empty schema (any value
passes there) while their field names stay, so a misspelt field beside them is still refused:

  Rollout          spec.template.spec.*  every PodSpec field but `containers` (kept whole)
                   status                written by the controller, never by a manifest
  AnalysisTemplate spec.metrics[].provider.job  a whole batch/v1 JobSpec

Run from the checkout, given a clone of github.com/argoproj/argo-rollouts:

    .venv/bin/python tests/data/argo/trim_crds.py /path/to/argo-rollouts [COMMIT]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CRDS = {"rollout-crd.yaml": "rollout-schema.yaml", "analysis-template-crd.yaml": "analysis-template-schema.yaml"}
CUT = "trimmed: any value passes here (tests/data/argo/trim_crds.py)"


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def _cut(props: dict[str, Any], keep: set[str]) -> None:
    for name in props:
        if name not in keep:
            props[name] = {"x-trimmed": CUT}


def trim(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    schema = _without_descriptions(version["schema"]["openAPIV3Schema"])
    spec = schema["properties"]["spec"]["properties"]
    if crd["spec"]["names"]["kind"] == "Rollout":
        _cut(spec["template"]["properties"]["spec"]["properties"], {"containers"})
        schema["properties"]["status"] = {"x-trimmed": CUT}
    else:
        _cut(spec["metrics"]["items"]["properties"]["provider"]["properties"], set(spec["metrics"]["items"]
             ["properties"]["provider"]["properties"]) - {"job"})
    return {"group": crd["spec"]["group"], "version": version["name"], "kind": crd["spec"]["names"]["kind"],
            "openAPIV3Schema": schema}


def main(repo: str, commit: str = "HEAD") -> None:
    sha = subprocess.run(["git", "-C", repo, "rev-parse", commit], capture_output=True, text=True,
                         check=True).stdout.strip()
    described = subprocess.run(["git", "-C", repo, "describe", "--tags", sha], capture_output=True,
                               text=True).stdout.strip() or "no tag"
    for src, dst in CRDS.items():
        text = subprocess.run(["git", "-C", repo, "show", f"{sha}:manifests/crds/{src}"], capture_output=True,
                              text=True, check=True).stdout
        doc = trim(yaml.safe_load(text))
        header = (f"# Argo Rollouts' {doc['kind']} CRD schema: github.com/argoproj/argo-rollouts commit\n"
                  f"# {sha} ({described}), manifests/crds/{src}.\n"
                  f"# Kept: the openAPIV3Schema of version {doc['version']}, without descriptions; the subtrees\n"
                  f"# marked x-trimmed were cut to an empty schema (see trim_crds.py, which wrote this file).\n")
        (HERE / dst).write_text(header + yaml.safe_dump(doc, sort_keys=True, width=120))


if __name__ == "__main__":
    main(*sys.argv[1:])
