#!/bin/sh
# An agent that sometimes fails and sometimes is rate-limited (exit 75 = deferred).
n=$(( $(date +%s) % 3 ))
sleep 1   # a call upstream takes a moment
case $n in
  0) echo "all good"; exit 0 ;;
  1) echo "upstream said 500" >&2; exit 1 ;;
  2) echo "rate limited, try later" >&2; exit 75 ;;
esac
