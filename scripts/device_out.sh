# Sourced by the GPU check scripts: when OUT_DIR is set, the result files a run writes under
# benchmarks/results/ are also copied into that folder. Only the files written after `out_mark` are copied
# (the tree holds earlier results, which would crowd the new ones out), plus any extra paths given.
#   out_mark                 at the start of the run
#   out_save [PATH ...]      after every part (a run cut short still leaves what ran in OUT_DIR)
out_mark() { _out_mark=$(mktemp); }
out_save() {
  if [ -n "${OUT_DIR:-}" ]; then
    mkdir -p "$OUT_DIR"
    find benchmarks/results -maxdepth 1 -type f -newer "$_out_mark" -exec cp {} "$OUT_DIR"/ \;
    [ $# -gt 0 ] && cp "$@" "$OUT_DIR"/ 2>/dev/null
  fi
  return 0
}
