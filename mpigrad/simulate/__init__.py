"""``mpigrad simulate``: mpigrad's protocol, and DDP's, replayed on SimGrid (docs/simulate.rst).

- :mod:`.traffic`: each iteration's messages from mpigrad's own code, an
  ``IterationTraffic`` from a config (``traffic_of``) or a trace (``trace_iterations``);
- :mod:`.platform`: the generated cluster (or a SimGrid file) and where each rank sits;
- :mod:`.plan`: each rank's phases of one iteration, mpigrad's and the peers', and what the
  results say (the breakdown, the NICs' bytes);
- :mod:`.engine`: a plan run on SimGrid in a child process (one engine per process);
- :mod:`.replay`: a simulation's record (``simulate``, ``Simulation``);
- :mod:`.sources`: a config's or a trace's simulation, with mpigrad's clock beside;
- :mod:`.cli`: the command; :mod:`.simgrid_module`: SimGrid's Python module, loaded by its path.

The runtime never imports this package (``tests/test_import_graph.py``); importing it loads
nothing heavy: each module imports torch and the runtime's builders only where it needs them.
"""
