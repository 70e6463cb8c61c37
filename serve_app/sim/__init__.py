"""Size a fleet before buying it: ``inflight profile`` measures what an engine step costs on a machine
(``profile.py``, fitted by ``cost_model.py``), ``inflight simulate`` replays a trace (``trace.py``) through the
engine's own scheduler and KV block pool (``replica.py``) across N replicas behind the router's own replica choice
(``fleet.py``) on a virtual clock, and reports what each request would see (``report.py``, ``cli.py``)."""
