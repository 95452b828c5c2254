"""How gradients travel: the ways of aggregating behind one interface (:mod:`.way`; chosen
by name in :mod:`.ways`: separate servers, colocated, hierarchical, pipelined (flat or
hierarchical), PowerSGD's two low-rank rounds), the shard aggregator they share, the
compressors (host and device, one protocol: :mod:`.frames`) that encode a rank's gradient
into frames, the replica whose flat gradient and update they read and write, and the
broadcast and buffer helpers. Imports :mod:`..plan`, :mod:`..wire` and :mod:`..measure`,
never the roles."""
