# Shared by the scripts/require-* commands: make sure a system package the
# tests (or `shepherd dev`) need is installed. On Debian as root it installs
# the package; otherwise it prints the exact command and fails.
#
# Usage: require NAME CHECK PACKAGE...
#   NAME     what is missing, for messages ("PostgreSQL's server")
#   CHECK    a shell function that succeeds when the software is present
#   PACKAGE  the Debian packages that provide it
require() {
  local name=$1 check=$2 script
  shift 2
  script=$(basename "$0")
  if "$check"; then
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "$script: installing $name (apt-get install $*)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    "$check" && return 0
    echo "$script: apt-get installed $*, but $name is still missing" >&2
    exit 1
  fi
  echo "$script: $name is not installed. Install it with:" >&2
  if command -v apt-get >/dev/null 2>&1; then
    echo "  sudo apt-get install -y $*" >&2
  else
    echo "  your distribution's package(s) for: $*" >&2
  fi
  exit 1
}
