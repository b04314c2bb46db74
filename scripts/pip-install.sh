#!/usr/bin/env bash
# `scripts/pip-install.sh VENV_PYTHON PIP_INSTALL_ARGS...`: `pip install PIP_INSTALL_ARGS` into that venv, through uv
# when it can be had (the same versions, resolved from the same indexes, in a fraction of pip's time: a fresh `make
# setup` took 42 s with uv's cache cold against pip's minutes), else through pip. Used by `make setup` and
# scripts/mlflow-setup.sh. LLMJOBS_NO_UV=1 forces pip.
#
# uv does not read pip's configuration, so the indexes, find-links and constraints pip is configured with here
# (pip.conf, PIP_* variables: `pip config list`) are handed to it; `unsafe-best-match` is pip's rule (the best
# version across every index), which uv's default (the first index that has the name) is not.
set -euo pipefail
py=$1
shift
UV_VERSION=0.13.10
uv=$(dirname "$py")/uv
if [[ ${LLMJOBS_NO_UV:-} != 1 && ! -x $uv ]]; then
  "$py" -m pip install -q "uv==$UV_VERSION" >/dev/null 2>&1 || echo "pip-install: uv $UV_VERSION not installable, pip installs" >&2
fi
if [[ ${LLMJOBS_NO_UV:-} == 1 || ! -x $uv ]]; then
  exec "$py" -m pip install "$@"
fi

config=$("$py" -m pip config list 2>/dev/null || true)
setting() {  # the value of pip setting $1 (the environment's wins over the files'), quotes removed
  sed -n "s/^\(:env:\|global\|install\)\.$1='\(.*\)'$/\2/p" <<<"$config" | tail -n 1
}
args=()
index=$(setting index-url)
[[ -n $index ]] && args+=(--index-url "$index")
for url in $(setting extra-index-url); do args+=(--extra-index-url "$url"); done
for dir in $(setting find-links); do args+=(--find-links "$dir"); done
for file in $(setting constraint); do args+=(--constraint "$file"); done
# --compile-bytecode: pip writes every module's .pyc at install; uv does not by default, and where
# PYTHONDONTWRITEBYTECODE is set (it is on these machines) nothing ever writes them, so every process compiled torch,
# transformers and the rest from source again: `import torch, transformers, fastapi` took 6.0 s of CPU against 2.7
# with the .pyc files, and CI (thousands of processes) went from 2,379 s to 5,393 s when setup moved to uv.
exec "$uv" pip install --python "$py" --compile-bytecode --index-strategy unsafe-best-match "${args[@]}" "$@"
