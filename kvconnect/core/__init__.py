"""The transfer library: cache layouts and their byte math, descriptor plans, heterogeneous planning, wire
formats, the side channel, leases, pulls and the connector. Imports nothing else of kvconnect."""
