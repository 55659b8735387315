#!/usr/bin/env bash
# Run the two MNIST scripts on this machine, or their tests, in a virtual environment of their own.
#
#   ./run_local.sh [SCRIPT FLAGS]      train with mnist_train.py, then a torchrun job of
#                                      mnist_train_distributed.py (2 CPU processes, or one per GPU);
#                                      defaults: --epochs 3 --data-dir ./data, outputs in ./output;
#                                      --backend, --join-timeout and --collective-timeout go to the
#                                      distributed one only;
#                                      --output-dir DIR: DIR/single and DIR/distributed
#   ./run_local.sh test [PYTEST ARGS]  the test suite, newest torch (.venv)
#   ./run_local.sh test-pai [...]      the test suite on the PAI image's torch 2.3.1 (.venv-pai)
#   ./run_local.sh bench [FLAGS]       document pipeline vs ours (tests/benchmark.py --help)
#   ./run_local.sh gpu-check [--pai] [FLAGS]
#                                      the GPU acceptance: every CUDA path checked, with figures
#                                      (tests/gpu_check.py --help; --pai: torch 2.3.1 in .venv-pai)
#   ./run_local.sh serve [FLAGS]       serve.py with ./output/single/best_model.pth on port 8000
#   ./run_local.sh bench-serve [FLAGS] serve.py's latency, requests/s, memory and slow pictures, beside
#                                      the single-process serve.py it replaced (tests/bench_serve.py --help)
#   ./run_local.sh bench-digits FLAGS  serve.py's accuracy on real MNIST digits drawn and photographed
#                                      (tests/bench_digits.py --help; needs --model and --data-dir)
#   ./run_local.sh mutants             mutation testing of common.py with its unit tests (mutmut)
#   ./run_local.sh -h | --help         this text
#
# Examples: ./run_local.sh --epochs 1 --data-dir /path/to/mnist   (the files in /path/to/mnist/MNIST/raw)
#           ./run_local.sh bench --data-dir /path/to/mnist
# PYTHON picks the interpreter that makes the environments (default: python3); VENV, the environment
# of the newest torch (default: .venv); VENV_PAI, that of torch 2.3.1 (default: .venv-pai).
set -euo pipefail
cd "$(dirname "$0")"

# venv FOLDER PIP-ARGS...: create FOLDER if needed and install the requirements PIP-ARGS name into it, once
# for each set: a stamp named after the set and its files' contents, so a command whose set was never installed
# there (serve after a first training run, say) installs it, whatever ran before.
venv() {
    local folder=$1; shift
    case "$(uname -s)" in
    MINGW* | MSYS* | CYGWIN*)  # Git Bash and the like: Windows' Python makes Scripts\python.exe, not bin/python
        echo "run_local.sh: it runs on Linux and macOS, and on Windows under WSL; elsewhere on Windows, run the" \
            "scripts by hand as README.md's \"On Windows\" shows." >&2
        exit 2 ;;
    esac
    if [ ! -x "$folder/bin/python" ] && [ -f "$folder/pyvenv.cfg" ] &&
        compgen -G "$folder/.installed-*" > /dev/null; then
        # An environment this script installed into whose Python is gone (upgraded or removed: Homebrew, pyenv),
        # and with it everything installed for it. Any other folder is left as it is.
        local gone
        gone=$(sed -n 's/^home = //p' "$folder/pyvenv.cfg")  # the folder it ran from
        echo "run_local.sh: $folder cannot run: its Python${gone:+ (from $gone)} is gone (upgraded or removed?);" \
            "making $folder anew" >&2
        "${PYTHON:-python3}" -m venv --clear "$folder"
    fi
    local stamp
    stamp="$folder/.installed-$({ echo "$*"; cat requirements*.txt constraints-pai.txt; } | cksum | cut -d' ' -f1)"
    if [ ! -f "$stamp" ]; then
        local python=${PYTHON:-python3}
        [ -x "$folder/bin/python" ] && python=$folder/bin/python
        # Python 3.10 or newer (3.9, past its end of life, would get torch 2.8 from pip and is not tested here);
        # PAI's torch 2.3.1: 3.10 or 3.11 (PAI's image has 3.11). Said here, not by pip's ResolutionImpossible or
        # a crash later.
        local number problem='' pai='' takes='3.10 to 3.13'
        number=$("$python" -c 'import sys; v = sys.version_info; print(v[0] * 100 + v[1])')
        local version="$((number / 100)).$((number % 100))"
        [[ " $* " == *" constraints-pai.txt "* ]] && pai=1 takes='3.10 or 3.11'
        if ((number < 310)); then
            problem="these scripts need Python 3.10 or newer, not $version ($python)"
        elif ((number >= 312)) && [ -n "$pai" ]; then
            problem="PAI's torch 2.3.1 needs Python 3.10 or 3.11, not $version ($python): it has no wheels for 3.13"
            problem+=" or newer, and on 3.12 its torchrun crashes (exit -11, pytorch/pytorch#125990)"
        fi
        if [ -n "$problem" ]; then
            local remove=''
            [ -e "$folder" ] && remove="rm -rf $folder, then "
            echo "run_local.sh: $problem: ${remove}run again with PYTHON naming a Python $takes" \
                "(PYTHON=python3.11 ./run_local.sh ...)." >&2
            exit 2
        fi
        [ -x "$folder/bin/python" ] || "$python" -m venv "$folder"
        "$folder/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
        touch "$stamp"
    fi
    PY="$folder/bin/python"
}

gpu_count() { "$PY" -c 'import torch; print(torch.cuda.device_count())'; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

case "${1:-run}" in
test)
    shift
    venv "${VENV:-.venv}" -r requirements-test.txt
    exec "$PY" -m pytest -q -n auto --dist loadgroup tests "$@"
    ;;
test-pai)
    shift
    venv "${VENV_PAI:-.venv-pai}" -r requirements-test.txt -c constraints-pai.txt
    exec "$PY" -m pytest -q -n auto --dist loadgroup tests "$@"
    ;;
bench)
    shift
    venv "${VENV:-.venv}" -r requirements.txt
    exec "$PY" tests/benchmark.py "$@"
    ;;
serve)
    shift
    venv "${VENV:-.venv}" -r requirements.txt -r requirements-serve.txt
    # macOS: Objective-C's fork check may crash Gunicorn's workers (forked, never exec'd): docs/troubleshooting.md
    if [ "$(uname -s)" = Darwin ]; then export OBJC_DISABLE_INITIALIZE_FORK_SAFETY=YES; fi
    exec "$PY" serve.py --model ./output/single/best_model.pth "$@"
    ;;
mutants)
    shift
    # Mutation testing of common.py against its unit tests, in a scratch copy (mutmut writes mutants/
    # beside the code it mutates); prints the mutants that no test kills.
    venv "${VENV:-.venv}" -r requirements-test.txt
    "$PY" -m pip install --quiet --disable-pip-version-check 'mutmut>=3.8.1,<4'
    work=$(mktemp -d)
    mkdir "$work/tests"
    cp common.py "$work/" && cp tests/conftest.py tests/test_common.py tests/test_common_setup.py "$work/tests/"
    # forkserver: torch is not fork-safe (forked from a process that ran it, tests hang and read as timeouts)
    printf '[mutmut]\nsource_paths = common.py\nprocess_isolation = forkserver\n' > "$work/setup.cfg"
    printf 'pytest_add_cli_args_test_selection =\n' >> "$work/setup.cfg"
    printf '    %s\n' tests/test_common.py tests/test_common_setup.py >> "$work/setup.cfg"
    PY="$(pwd)/$PY"  # absolute, not resolved: the environment's own python
    cd "$work"
    "$PY" -m mutmut run "$@" || true
    "$PY" -m mutmut results
    echo "mutants and their diffs: cd $work && $PY -m mutmut show NAME"
    ;;
bench-digits)
    shift
    venv "${VENV:-.venv}" -r requirements.txt -r requirements-serve.txt httptools  # as bench-serve: --baseline 390c706
    exec "$PY" tests/bench_digits.py "$@"
    ;;
bench-serve)
    shift
    # Side by side with the serve.py before framing.py and its worker processes, where git has it: it parses HTTP
    # with httptools, no longer among serve.py's packages.
    venv "${VENV:-.venv}" -r requirements.txt -r requirements-serve.txt httptools
    baseline=()
    if git rev-parse --quiet --verify 390c706^{commit} > /dev/null 2>&1; then baseline=(--baseline 390c706); fi
    exec "$PY" tests/bench_serve.py ${baseline[@]+"${baseline[@]}"} "$@"
    ;;
gpu-check)
    shift
    # The GPU acceptance (tests/gpu_check.py --help): every CUDA path, with its figures and a verdict.
    folder=${VENV:-.venv} constraints=()
    if [ "${1:-}" = --pai ]; then
        shift
        folder=${VENV_PAI:-.venv-pai} constraints=(-c constraints-pai.txt)
    fi
    venv "$folder" -r requirements-serve.txt ${constraints[@]+"${constraints[@]}"}
    exec "$PY" tests/gpu_check.py "$@"
    ;;
-h | --help)
    usage
    ;;
run | -*)
    [ "${1:-}" = run ] && shift
    # Flags that only the distributed script takes go to it alone, the others to both; each script
    # writes to a folder of its own under --output-dir.
    shared=() distributed_only=() out=./output
    while [ $# -gt 0 ]; do
        case "$1" in
        --backend=* | --join-timeout=* | --collective-timeout=*) distributed_only+=("$1") ;;
        --backend | --join-timeout | --collective-timeout) distributed_only+=("$1" "${2:-}"); shift ;;
        --output-dir=*) out=${1#--output-dir=} ;;
        --output-dir) out=${2:-}; shift ;;
        *) shared+=("$1") ;;
        esac
        shift
    done
    venv "${VENV:-.venv}" -r requirements.txt
    gpus=$(gpu_count)
    nproc=$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)
    defaults=(--epochs 3 --data-dir ./data)
    echo "== mnist_train.py"
    "$PY" mnist_train.py "${defaults[@]}" --output-dir "$out/single" ${shared[@]+"${shared[@]}"}
    echo "== torchrun --nproc_per_node=$nproc mnist_train_distributed.py"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" mnist_train_distributed.py \
        "${defaults[@]}" --output-dir "$out/distributed" ${shared[@]+"${shared[@]}"} \
        ${distributed_only[@]+"${distributed_only[@]}"}
    echo
    echo "Models:      $out/single/best_model.pth, $out/distributed/best_model.pth"
    echo "TensorBoard: $(dirname "$PY")/tensorboard --logdir $out   (then open http://localhost:6006)"
    ;;
*)
    echo "run_local.sh: no command '$1': test, test-pai, bench, gpu-check, serve, bench-serve, bench-digits," \
        "mutants, or none (train) with the scripts' flags; ./run_local.sh --help says more." >&2
    exit 2
    ;;
esac
