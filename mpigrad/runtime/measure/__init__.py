"""What a run records: the simulated clock and its traffic, the iteration record, the phase
log, the HDF5 trace rank 0 writes, and checkpoints. Imports only :mod:`..plan`."""
