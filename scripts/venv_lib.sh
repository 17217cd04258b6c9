# Shared by peer_vllm.sh and vllm_full.sh (sourced): starting a venv build from scratch.

# fresh_venv_dir DIR WHAT: make way for a new venv at DIR.  A virtualenv (or an empty
# directory) there is removed; anything else is refused (status 1, reason on stderr), as is a
# python3 other than 3.11 (the local torch 2.13.0 CPU wheel is cp311).
fresh_venv_dir() {
    local venv=$1 what=$2
    if [ -e "$venv" ]; then
        if [ -f "$venv/pyvenv.cfg" ] || [ -z "$(ls -A "$venv")" ]; then
            echo "rebuilding the $what venv at $venv"
            rm -rf "$venv"
        else
            echo "$venv exists and is not a virtualenv; refusing to replace it" >&2
            return 1
        fi
    fi
    if ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        echo "python3 must be Python 3.11 (the local torch 2.13.0 CPU wheel is cp311)" >&2
        return 1
    fi
}
