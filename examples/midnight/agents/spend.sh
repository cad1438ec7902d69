#!/bin/sh
# An agent on a shared quota: it sizes its work to what the ring says it may
# spend (RING_QUOTA_LEFT), works, and reports what it spent over the ring's
# notify socket. Its one argument is what a full piece of work costs.
cost=${1:-30}
left=${RING_QUOTA_LEFT:-0}
spend=$(( cost < left ? cost : left ))
echo "$RING_AGENT: pool $RING_QUOTA has $left left for me; spending $spend of $cost"
sleep 0.3
ringd notify --used "$RING_QUOTA:$spend"
