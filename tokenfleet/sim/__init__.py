"""The fleet simulator (`tokenfleet simulate`): gateways, quotas, the router and many replicas in simulated time,
each replica running the engine's real scheduler and block manager over a cost model of the GPU step."""
