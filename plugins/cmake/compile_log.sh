#!/bin/sh
# Compiler launcher (RULE_LAUNCH_COMPILE): runs the compile command unchanged, shows its
# stderr as usual and keeps a copy in LOGDIR/<object name>.log, so the ptxas resource usage
# (-Xptxas=-v: registers, spills, stack frame per kernel and architecture) stays readable
# after the build. Usage: compile_log.sh LOGDIR compiler args...
logdir=$1
shift
out=unknown
prev=
for arg in "$@"; do
    if [ "$prev" = "-o" ]; then out=$arg; fi
    prev=$arg
done
mkdir -p "$logdir"
log="$logdir/$(basename "$out").log"
"$@" 2>"$log.tmp"
rc=$?
cat "$log.tmp" >&2
mv "$log.tmp" "$log"
exit $rc
