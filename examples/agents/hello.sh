#!/bin/sh
# A well-behaved agent: says hello, works a little, exits 0.
echo "hello from $RING_AGENT (run $RING_RUN_ID, budget ${RING_RUN_BUDGET}s)"
sleep 2
echo "done"
