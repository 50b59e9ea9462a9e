#!/usr/bin/env bash
# The milestones of a job's log (memory, data, taps, validation, saved, tau, card, JOB lines),
# one per line: progress bars write carriage returns, not newlines, so a line printed during a
# bar sits inside one huge line of the log; this splits at the carriage returns first.
#
#   bash bench/h200/progress.sh /root/res/NAME.log
tr '\r' '\n' < "${1:?usage: progress.sh LOG}" \
  | grep -a -o "\(memory: \|data: \|taps: \|val: \|init: \|resume: \|saved: \|tau (\|card: \|JOB \|Traceback\|Error\|exited\).*" \
  | grep -av "%|"
