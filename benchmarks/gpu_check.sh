#!/usr/bin/env bash
# GPU check, run unchanged from the repo root on a machine with JAX (and no TensorFlow):
#
#   bash benchmarks/gpu_check.sh                      # base preset, bf16 + XLA, 500 steps
#   bash benchmarks/gpu_check.sh --steps 1000         # any benchmarks/pretrain.py flag overrides
#   bash benchmarks/gpu_check.sh --sizes tiny --steps 3 --peak-tflops 0.33   # a CPU smoke test
#   bash benchmarks/gpu_check.sh --fetch-wheels       # on a networked machine: fill .whl/
#
# Prints positions/s and real tokens/s, MFU against --peak-tflops (default 989: H200 bf16 dense)
# and the validation MLM loss after the run's steps on held-out synthetic windows (a Markov
# chain a model can learn, beside its unigram baseline ~ln V). Every import of tensorflow is
# made to fail (--block-tensorflow), so the run proves the JAX path never needs it.
#
# Needs: a python with jax (PYTHON, default python3), plus keras, pydantic and pyyaml. Missing
# ones are installed into a private folder (never the project itself: `pip install -e .` would
# pull tensorflow-cpu, prefect and mlflow): from carried wheels in .whl/ if present, else from
# the package index; with neither, the script says what to carry and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/selfsup_gpu_check_site}
NEEDED=(keras pydantic yaml)
# Wheels the JAX GPU image lacked when it was last listed (keras' and pydantic's own needs).
WHEELS=("keras>=3.10,<4" namex optree "pydantic>=2.7,<3" pydantic-core annotated-types
        typing-inspection)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    exit 0
fi

missing() {
    "$PY" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

if [[ -n "$(missing jax)" ]]; then
    echo "gpu_check: $PY has no jax; install the jax extra (pip install 'jax[cuda12]' or" \
         "the machine's build) or set PYTHON" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d "$SITE" ]]; then export PYTHONPATH="$SITE:$PYTHONPATH"; fi
todo=$(missing "${NEEDED[@]}")
if [[ -n "$todo" ]]; then
    echo "gpu_check: installing what $PY lacks ($todo) into $SITE" >&2
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
    elif ! "$PY" -m pip install -q --no-compile --target "$SITE" "${WHEELS[@]}" pyyaml \
            numpy 2>&1 | tail -3; then
        echo "gpu_check: no package index here; on a networked machine run" \
             "'bash benchmarks/gpu_check.sh --fetch-wheels' and carry .whl/" >&2
        exit 2
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
    todo=$(missing "${NEEDED[@]}")
    if [[ -n "$todo" ]]; then echo "gpu_check: still missing: $todo" >&2; exit 2; fi
fi

export KERAS_BACKEND=jax TF_CPP_MIN_LOG_LEVEL=3
"$PY" - <<'EOF'
import jax, keras
print(f"# jax {jax.__version__} on {jax.devices()}, keras {keras.__version__} "
      f"({keras.backend.backend()})", flush=True)
EOF
exec "$PY" benchmarks/pretrain.py --sizes base --precision bf16 --jit on --warmup 5 \
    --steps 500 --val-loss --peak-tflops 989 --block-tensorflow "$@"
