# Sourced by the one-call GPU scripts: what a device call writes under benchmarks/results/ goes back through
# the lent-GPU tool's $OUT folder. Only the files written after `out_mark` are copied (the tree carries the
# earlier results, which would crowd the new ones out of what comes back), plus any extra paths given.
#   out_mark                 at the start of the call
#   out_save [PATH ...]      after every part (a call cut short still returns what ran)
out_mark() { _out_mark=$(mktemp); }
out_save() {
  if [ -n "${OUT:-}" ]; then
    find benchmarks/results -maxdepth 1 -type f -newer "$_out_mark" -exec cp {} "$OUT"/ \;
    [ $# -gt 0 ] && cp "$@" "$OUT"/ 2>/dev/null
  fi
  return 0
}
