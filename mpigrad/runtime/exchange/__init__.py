"""How gradients travel: the compressors (host and device) that encode a rank's gradient
into frames, the replica whose flat gradient and update they read and write, the
broadcast and buffer helpers, the two-round low-rank factors and the pipelined exchange.
Imports :mod:`..plan`, :mod:`..wire` and :mod:`..measure`, never the roles."""
