# help.sh: sourced first by every script in scripts/, before it starts
# anything: with -h or --help among its arguments (before a "--"), the script
# prints its header comment (the usage line, then what it does, its settings
# and examples) and exits 0.
#
#   source "$(dirname "$0")/lib/help.sh"
for arg in "$@"; do
  case $arg in
  --) break ;;
  -h | --help)
    # The comment lines after the shebang, up to the first line of code.
    sed -n '2,/^[^#]/{/^#/!d;s/^# \{0,1\}//;p;}' "$0"
    exit 0
    ;;
  esac
done
unset arg
