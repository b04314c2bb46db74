#!/usr/bin/env bash
# The MLflow client and server the MLflow tests run (tests/integration/test_mlflow_api.py, test_mlflow_report.py),
# in a venv of their own: mlflow 3.x pins starlette, protobuf, packaging and opentelemetry versions that conflict with
# constraints.txt, so it cannot live in the service's venv. Idempotent; `.ci/run` runs it before `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMJOBS_MLFLOW_VENV:-var/mlflow-venv}  # .ci/run keeps it outside the clone (the tests then read LLMJOBS_MLFLOW_PYTHON)
VERSION=3.17.2  # 3.18's full package needs mlflow-tracing 3.18, absent from the package index here
if [ -x "$VENV/bin/mlflow" ] && "$VENV/bin/python" -c "import mlflow, sys; sys.exit(mlflow.__version__ != '$VERSION')"; then
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
scripts/pip-install.sh "$VENV/bin/python" -q "mlflow==$VERSION"
"$VENV/bin/mlflow" --version
