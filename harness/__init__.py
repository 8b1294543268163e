"""bcastbench harness: worlds, payloads, timing, verification, records, sweeps and reports."""

import os

# Ray starts a cluster of its own (its defaults, a dashboard) when one of its calls finds none
# connected. After a Ray world closed, something did at the end of some sweeps (a compiled
# graph's teardown run by the garbage collector was one). The harness connects to the clusters
# it starts; a call after that is a bug to raise, not a cluster to start. Ray reads this when
# it is first imported.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
