#!/usr/bin/env bash
# Fetch the pure-Python wheels the GPU machine lacks for the trainer (hydra-core, omegaconf and their
# antlr4 runtime) into .whl/ at the repository root, at the versions of the environment this runs in
# (the project's venv), for the GPU machine's Python 3.12. Run here (PyPI reachable), once per session:
#
#     bash bench/gpu_wheels.sh            # then name ".whl" in the device run's carry list
#
# .whl/ ignores itself (a .gitignore holding "*"), so it never reaches a commit and travels only when
# carried. bench.gpu_suite installs these wheels into a temp dir when `import hydra` fails there
# (or by hand: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site).
# Not carried on purpose: datasets and wandb (the trainer runs without them: default corpus, W&B disabled).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
HYDRA=$(version hydra-core)
OMEGACONF=$(version omegaconf)
ANTLR=$(version antlr4-python3-runtime)

rm -rf .whl
mkdir -p .whl
printf '*\n' > .whl/.gitignore
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in "hydra-core==$HYDRA" "omegaconf==$OMEGACONF"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl "$spec"
done
# antlr4-python3-runtime 4.9.x (what hydra 1.3 / omegaconf 2.3 pin) is published as a source archive only:
# build its pure-Python wheel (py3-none-any) here.
if ! "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl "antlr4-python3-runtime==$ANTLR" 2>/dev/null; then
    "$PY" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$ANTLR"
fi
# Exactly one wheel per package, all pure Python.
for name in hydra_core omegaconf antlr4_python3_runtime; do
    n=$(ls .whl/${name}-*.whl | wc -l)
    [ "$n" -eq 1 ] || { echo "gpu_wheels: expected one ${name} wheel in .whl, found $n" >&2; exit 1; }
done
ls .whl/*.whl | grep -v -- '-none-any.whl$' && { echo "gpu_wheels: a wheel above is not pure Python" >&2; exit 1; }
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $(du -ch .whl/*.whl | tail -1 | cut -f1) in .whl/:"
ls -1 .whl/*.whl
