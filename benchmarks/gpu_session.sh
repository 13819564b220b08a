#!/usr/bin/env bash
# The accelerator measurements of BENCHMARKS.md ("Accelerators"), in parts that each fit one
# 10-minute call of a lent GPU machine (Python 3.12 and jax with CUDA there, no Keras).
#
# Here, once (it needs PyPI), from the repository root:
#     bash benchmarks/gpu_session.sh wheels        # keras, namex, optree wheels into .whl/
# There, one part per call, carrying .whl (logs and JSON results land in $OUT):
#     bash benchmarks/gpu_session.sh acceptance    # the open GPU figures, ~8 minutes:
#                                                  # the one call a 15-minute lease allows
#                                                  # (after profile_fit_setup.py, 20 s)
#     bash benchmarks/gpu_session.sh throughput    # single IPU vs limit, GA 8, resident cut
#     bash benchmarks/gpu_session.sh ga            # where GA 8's time goes, ~3 minutes: its
#                                                  # fit by phase, its program alone, the HLO
#     bash benchmarks/gpu_session.sh table         # plain Keras vs keras_ipu, 4 models
#     bash benchmarks/gpu_session.sh first-fit     # the executable cache, fresh processes
#     bash benchmarks/gpu_session.sh zoo           # the single-IPU zoo
#     bash benchmarks/gpu_session.sh shared        # a 4-stage pipeline whose IPUs share the GPU
set -euo pipefail

part=${1:?"a part: wheels, acceptance, throughput, ga, table, first-fit, zoo or shared"}
wheels=.whl
case "$part" in
    wheels | acceptance | throughput | ga | table | first-fit | zoo | shared) ;;
    *) echo "unknown part $part: wheels, acceptance, throughput, ga, table, first-fit, zoo" \
            "or shared" >&2
       exit 2 ;;
esac

if [[ $part == wheels ]]; then
    keras_version=$(python3 -c "import importlib.metadata as m; print(m.version('keras'))")
    for package in "keras==$keras_version" namex optree; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d "$wheels" "$package"
    done
    ls "$wheels"
    exit 0
fi

out=${OUT:?"run on the device machine: \$OUT is where results go"}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KERAS_BACKEND=jax
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || echo "no GPU") | tee "$out/device.txt"
python3 -c "import jax, keras; print('jax', jax.__version__, 'keras', keras.__version__, \
jax.devices())" | tee -a "$out/device.txt"

case "$part" in
    acceptance)
        # A warm fit's host setup by part first (20 s): what GA 8's short fits pay.
        timeout 60 python3 benchmarks/profile_fit_setup.py 2>&1 | tee "$out/fit_setup.log" || true
        python3 benchmarks/gpu_acceptance.py --out "$out" --budget 520
        # At most 8 files come back from a call: one archive, and the verdicts beside it.
        (cd "$out" && tar czf results.tgz -- *.json *.log device.txt \
            && find . -maxdepth 1 -type f ! -name results.tgz ! -name acceptance.json -delete)
        ;;
    throughput)
        python3 benchmarks/bench_single_ipu.py --repeats 3 --skip compile \
            --output "$out/bench_single_ipu.json" 2>&1 | tee "$out/single_ipu.log"
        python3 benchmarks/bench_ga_replication.py --repeats 3 \
            --output "$out/bench_ga_replication.json" 2>&1 | tee "$out/ga.log"
        python3 benchmarks/bench_resident_cut.py --output "$out/bench_resident_cut.json" \
            2>&1 | tee "$out/resident_cut.log"
        ;;
    ga)
        for executions in 16 64; do
            python3 benchmarks/bench_ga_replication.py --repeats 3 --timeline \
                --executions "$executions" --output "$out/ga_$executions.json" 2>&1 \
                | tee "$out/ga_$executions.log"
        done
        # The optimized HLO of each program (a short run: only the compilations matter).
        XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \
            python3 benchmarks/bench_ga_replication.py --quick --output /tmp/hlo.json \
            > /dev/null 2>&1 || true
        (cd /tmp/hlo && tar czf "$out/hlo.tgz" -- *after_optimizations.txt) || true
        ;;
    table)
        python3 benchmarks/bench_accelerator.py --rounds 3 --first-rounds 2 2>&1 \
            | tee "$out/accelerator.log"
        ;;
    first-fit)
        python3 benchmarks/bench_executable_cache.py --rounds 2 2>&1 | tee "$out/cache.log"
        ;;
    zoo)
        python3 benchmarks/bench_zoo.py --no-pipeline --rounds 3 --first-rounds 2 2>&1 \
            | tee "$out/zoo.log"
        ;;
    shared)
        # The 4 IPUs on the one GPU, then on 4 and 1 of its CPU devices.
        python3 benchmarks/bench_shared_pipeline.py --platform default --devices 1 2>&1 \
            | tee "$out/shared_gpu.log"
        python3 benchmarks/bench_shared_pipeline.py --devices 4,1 2>&1 | tee "$out/shared_cpu.log"
        ;;
esac
