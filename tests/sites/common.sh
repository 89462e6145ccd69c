# shellcheck shell=bash
# Stand-ins for the `module` and `conda` commands of a cluster, shared
# by the site profiles. A profile.sh sources this file; Bash reads the
# profile through BASH_ENV at the start of every non-interactive shell,
# so the batch script and `srun bash -c ...` steps have both commands.

# Lmod's `module`, reduced to what job scripts use. Loading a module this site does not
# have fails as Lmod does, so a script that names a wrong module fails here too.
module() {
    while [[ ${1:-} == -* ]]; do shift; done  # --quiet and the like
    case "${1:-}" in
        purge)
            export LOADEDMODULES=""
            ;;
        load)
            shift
            local name
            for name in "$@"; do
                if [[ " $LAB_MODULES " != *" $name "* ]]; then
                    echo "Lmod has detected the following error:" \
                        "unknown module \"$name\"" >&2
                    return 1
                fi
                LOADEDMODULES="${LOADEDMODULES:+$LOADEDMODULES:}$name"
            done
            export LOADEDMODULES
            ;;
        list)
            echo "Currently loaded modules: ${LOADEDMODULES:-none}"
            ;;
        *)
            echo "module stand-in: \`module ${1:-}\` is not provided" >&2
            return 1
            ;;
    esac
}

# `conda activate ENV` (a profile wraps it as `conda`): puts the test
# suite's Python, which has the examples' dependencies, first on
# PATH, as activating a real environment with those packages would.
lab_conda() {
    if [[ ${1:-} != activate || -z ${2:-} ]]; then
        echo "conda stand-in: only \`conda activate ENV\` is provided" >&2
        return 1
    fi
    if [[ " $LAB_CONDA_ENVS " != *" $2 "* ]]; then
        echo "EnvironmentNameNotFound: Could not find conda environment: $2" >&2
        return 1
    fi
    export PATH="$LAB_PYTHON_BIN:$PATH" CONDA_DEFAULT_ENV="$2"
}

# The nodes' GPUs are stand-ins that CUDA cannot use, and a job given
# GPUs that CUDA cannot use stops at once: ask for CPU training on
# purpose, as a user without GPUs would. A test that checks the stop
# sets TRAIN_ON_CPU to an empty value when it submits.
export TRAIN_ON_CPU=${TRAIN_ON_CPU-1}
