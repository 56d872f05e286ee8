#!/usr/bin/env bash
# What `make test` needs to check deploy/ offline: kubectl (its built-in kustomize renders the
# manifests) and, in their own virtualenv .venv-deploy, kubernetes-validate (Kubernetes schemas),
# checkov (policy lint) and grafana-foundation-sdk (builds the dashboard).
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${VENV_DEPLOY:-.venv-deploy}"
cd "$(dirname "$0")/.."

if ! command -v kubectl >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # Debian's own kubernetes-client (1.20) predates kustomize components; the kubectl package comes
  # from the Kubernetes or Google Cloud apt repository.
  $SUDO apt-get install -y -qq kubectl >/dev/null || {
    echo "install-deploy-tools: kubectl >= 1.27 is needed (apt repository of Kubernetes or Google Cloud)" >&2
    exit 1
  }
fi
kubectl kustomize --help >/dev/null

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -r deploy/tools-requirements.txt
"$VENV/bin/python" -c "import checkov, kubernetes_validate, grafana_foundation_sdk"
