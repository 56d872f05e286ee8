"""Render every overlay and validate each object against the Kubernetes schemas, offline.

    .venv-deploy/bin/python deploy/check_manifests.py [--json report.json]

Renders ``deploy/kustomize/overlays/*`` (or reads ``--file`` YAML) with ``kubectl kustomize``; validates every core object with
kubernetes-validate (strict: unknown fields are errors) for each Kubernetes version in VERSIONS,
and Prometheus Operator objects against deploy/schemas/monitoring.coreos.com_v1.json. Prints one
line per overlay and exits 1 on any failure. Runs in .venv-deploy (``make deploy-tools``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

DEPLOY = Path(__file__).resolve().parent
OVERLAYS = DEPLOY / "kustomize" / "overlays"
MONITORING_SCHEMA = DEPLOY / "schemas" / "monitoring.coreos.com_v1.json"
VERSIONS = ("1.29.0", "1.33.0")
"""The oldest Kubernetes release still patched upstream when this was written, and a recent one."""


def render(overlay: Path) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _monitoring_validators() -> dict[str, jsonschema.Draft7Validator]:
    root = json.loads(MONITORING_SCHEMA.read_text())
    return {
        kind: jsonschema.Draft7Validator({**schema, "definitions": root["definitions"]})
        for kind, schema in root["kinds"].items()
    }


def check(doc: dict[str, Any], monitoring: dict[str, jsonschema.Draft7Validator]) -> list[str]:
    """Errors of one object (empty when valid)."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if str(doc.get("apiVersion", "")).startswith("monitoring.coreos.com/"):
        validator = monitoring.get(str(doc.get("kind")))
        if validator is None:
            return [f"{name}: no schema for this Prometheus Operator kind"]
        return [f"{name}: {e.message} at {'/'.join(map(str, e.path))}" for e in validator.iter_errors(doc)]
    errors = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name} (Kubernetes {version}): {exc.message} at {'/'.join(map(str, exc.path))}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{name}: Kubernetes {version} has no such kind")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write {overlay: {objects, kinds, errors}} here")
    ap.add_argument("--file", type=Path, action="append", help="validate these YAML files instead")
    args = ap.parse_args()
    monitoring = _monitoring_validators()
    report: dict[str, dict[str, Any]] = {}
    failed = False
    sources: list[tuple[str, list[dict[str, Any]]]]
    if args.file:
        sources = [(str(f), [d for d in yaml.safe_load_all(f.read_text()) if d]) for f in args.file]
    else:
        sources = [(o.name, render(o)) for o in sorted(p for p in OVERLAYS.iterdir() if p.is_dir())]
    for name, docs in sources:
        errors = [e for doc in docs for e in check(doc, monitoring)]
        kinds = sorted({str(d["kind"]) for d in docs})
        report[name] = {"objects": len(docs), "kinds": kinds, "errors": errors}
        failed = failed or bool(errors) or not docs
        print(f"{name}: {len(docs)} objects, {len(errors)} errors")
        for e in errors:
            print(f"  {e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
