# Sourced by the launchers: helpers shared by launch/local.sh and launch/tpu_pod.sh.

# The value of --workdir=DIR / --workdir DIR among the arguments ('' if absent).
workdir_flag() {
  local args=("$@") i
  for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
      --workdir=*) echo "${args[i]#--workdir=}"; return ;;
      --workdir) if ((i + 1 < ${#args[@]})); then echo "${args[i + 1]}"; fi; return ;;
    esac
  done
}
