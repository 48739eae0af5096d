# Source me (bash/zsh): `source scripts/env.sh`. Points Spark and Python at the repo's .venv.
_twophase_root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export PATH="$_twophase_root/.venv/bin:$PATH"
export PYSPARK_PYTHON="$_twophase_root/.venv/bin/python"
export PYSPARK_DRIVER_PYTHON="$PYSPARK_PYTHON"
export SPARK_LOCAL_IP=127.0.0.1
export PYTHONPATH="$_twophase_root${PYTHONPATH:+:$PYTHONPATH}"
unset _twophase_root
