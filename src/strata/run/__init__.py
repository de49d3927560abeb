"""Steps: run a command in a throwaway sandbox as one transaction.

`spec.py` parses volume specs, `sandbox.py` builds the none/bwrap/gVisor
launch and enforces memory and time limits, `runner.py` pins volumes, mounts
them, runs the command, and publishes every changed volume atomically on
exit 0 (and nothing otherwise). The runner uses the mount layer and the
`Store` interface only.
"""
