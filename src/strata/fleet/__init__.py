"""The fleet: many hosts on one bucket, automatic failover, routing to the owner.

records.py (what the bucket holds), lease.py (renewal and the acknowledgement
window), member.py (one host's process), client.py (the remote Store through
any member). The fleet stands on the server and the engine's bucket tier and
nothing below imports it. docs/fleet.md has the model.
"""
