#!/usr/bin/env bash
# A wait call's body on the GPU machine: sleeps until FILE contains PATTERN (grep -a) or SECONDS
# pass, then prints the job log's milestones (progress.sh) and the GPU's memory. One long wait
# call leaves fewer gaps between calls than several short ones (a gap over 30 s gives the machine
# back, and with it the job: session 8), and ending early wastes no device time. Exit status 0
# when PATTERN (a grep basic regex) was found, 1 when the time ran out, 2 on bad arguments, so
# `wait.sh ... && collect.sh` collects only what is there. A wait on the job's own log (FILE is
# LOG) also stops, with status 1, when the job ended first (`JOB DONE` in it, or no job_train.sh
# runs): session 15's OOM left such a wait sleeping 540 s on a dead job. (The benchmark runs after
# the job's end, so a wait on its table does not stop for that.)
#
#   bash bench/h200/wait.sh SECONDS PATTERN FILE [LOG]
#   e.g. bash bench/h200/wait.sh 540 "bench end" /root/res/bench/dflash_q15.txt
set -u
usage() { echo "usage: wait.sh SECONDS PATTERN FILE [LOG] (SECONDS a whole number)" >&2; exit 2; }
[ $# -ge 3 ] || usage
secs=$1; pat=$2; file=$3
[[ "$secs" =~ ^[0-9]+$ ]] || usage
log=${4:-/root/res/Qwen2.5-Coder-1.5B-Instruct.log}
end=$((SECONDS + secs))
job_ended() {  # the job's last line is in the log, or its driver is gone (killed, machine lost)
  grep -aq "JOB DONE\|JOB FAILED" "$log" 2>/dev/null || ! pgrep -f "[j]ob_train.sh" >/dev/null
}
ended=0
until grep -aq -- "$pat" "$file" 2>/dev/null || [ "$SECONDS" -ge "$end" ]; do
  # Checked before the sleep's re-grep, so a pattern written just before the job's end still counts.
  if [ "$file" = "$log" ] && job_ended; then grep -aq -- "$pat" "$file" 2>/dev/null || ended=1; break; fi
  sleep 2
done
found=1
if grep -aq -- "$pat" "$file" 2>/dev/null; then echo "wait: '$pat' in $file after ${SECONDS} s"; found=0
elif [ "$ended" = 1 ]; then
  echo "wait: the job ended after ${SECONDS} s without '$pat' in $file:"
  grep -a "JOB DONE\|JOB FAILED\|Error\|error:" "$log" 2>/dev/null | tail -5 | cut -c1-300
else echo "wait: no '$pat' in $file after ${secs} s"; fi
[ -f "$log" ] && bash "$(dirname "$0")/progress.sh" "$log" | cut -c1-300
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv 2>/dev/null
exit $found
