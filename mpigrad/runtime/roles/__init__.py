"""Who does what in one iteration: the order of its phases (:mod:`.iteration`), rank 0's
:class:`~.server.ParameterServer`, the shard servers, the workers; fault injection and the
stop flag they poll. Built on :mod:`..exchange`; imported only by :mod:`..run`."""
